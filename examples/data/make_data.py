"""Writes the small corpus of docs/data.md's commands in every source form (run from the
repository root: python examples/data/make_data.py). Sentences drawn from a fixed grammar
with a fixed seed, so the files are the same on every run."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import datasets

HERE = Path(__file__).parent
SUBJECTS = ["the model", "a rank", "the sampler", "each shard", "the optimizer", "a worker"]
VERBS = ["reads", "writes", "reduces", "gathers", "shuffles", "tokenizes", "checkpoints"]
OBJECTS = ["the gradients", "a batch", "the token stream", "its parameters", "one window",
           "the loss", "every document"]


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(2, 6))).capitalize() for _ in range(n)]


def main() -> None:
    docs = datasets.Dataset.from_dict({"text": documents(60, seed=0)})
    docs.to_json(str(HERE / "corpus.jsonl"))
    (HERE / "corpus.json").write_text(json.dumps([{"text": t} for t in docs["text"]]))
    docs.to_csv(str(HERE / "corpus.csv"), index=False)
    docs.to_parquet(str(HERE / "corpus.parquet"))
    shutil.rmtree(HERE / "saved", ignore_errors=True)
    docs.save_to_disk(str(HERE / "saved"))
    shutil.rmtree(HERE / "shards", ignore_errors=True)
    (HERE / "shards").mkdir()
    for i in range(2):
        docs.shard(2, i, contiguous=True).to_parquet(str(HERE / "shards" / f"part-{i}.parquet"))
    datasets.Dataset.from_dict({"text": documents(20, seed=1)}).to_json(str(HERE / "eval.jsonl"))


if __name__ == "__main__":
    main()
