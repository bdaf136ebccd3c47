"""Source forms through `datasets` (JSONL, JSON, CSV, Parquet, Arrow, save_to_disk, shard
directories), the refusals before launch, and a held-out eval source with perplexity."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from parity import make_mesh, tiny
from shardtrain.cli import main
from shardtrain.config import ConfigError, DataConfig
from shardtrain.data import check_source
from shardtrain.data.sources import iter_documents
from shardtrain.train.trainer import Trainer

WORDS = "alpha beta gamma delta ☃ epsilon zeta eta theta iota kappa lambda".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) for _ in range(n)]


def table(docs: list[str]) -> datasets.Dataset:
    # An extra non-text column: data.text_field picks the one to read.
    return datasets.Dataset.from_dict({"id": list(range(len(docs))), "body": docs})


def write_forms(root: Path, docs: list[str]) -> dict[str, Path]:
    """One corpus in every source form; the keys name the form."""
    root.mkdir(parents=True, exist_ok=True)
    ds = table(docs)
    forms = {"jsonl": root / "c.jsonl", "json": root / "c.json", "csv": root / "c.csv",
             "parquet": root / "c.parquet", "saved": root / "saved", "shards": root / "shards"}
    forms["jsonl"].write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    forms["json"].write_text(json.dumps([{"body": d} for d in docs]))
    ds.to_csv(str(forms["csv"]), index=False)
    ds.to_parquet(str(forms["parquet"]))
    ds.save_to_disk(str(forms["saved"]))
    forms["arrow"] = next(forms["saved"].glob("*.arrow"))  # save_to_disk's shard: Arrow
    half = len(docs) // 2  # two Parquet shards, read in name order, and a README beside them
    forms["shards"].mkdir()
    ds.select(range(half)).to_parquet(str(forms["shards"] / "part-0.parquet"))
    ds.select(range(half, len(docs))).to_parquet(str(forms["shards"] / "part-1.parquet"))
    (forms["shards"] / "README.md").write_text("not data")
    return forms


def test_every_form_reads_the_same_documents(tmp_path):
    docs = corpus(40) + [""]  # an empty row is no document
    forms = write_forms(tmp_path / "forms", docs)
    for form, path in forms.items():
        cfg = DataConfig(source=str(path), text_field="body")
        check_source(cfg)
        assert list(iter_documents(cfg)) == docs[:-1], form
    with pytest.raises(ConfigError, match=r"c\.parquet has no column 'text' \(data\.text_field\)"
                                          r".*\['id', 'body'\]"):
        check_source(DataConfig(source=str(forms["parquet"])))
    with pytest.raises(ConfigError, match=r"column 'id' \(data\.text_field\) holds int"):
        check_source(DataConfig(source=str(forms["saved"]), text_field="id"))
    # A glob over Parquet shards reads them as tables, as their directory does.
    glob_cfg = DataConfig(source=str(forms["shards"] / "*.parquet"), text_field="body")
    assert list(iter_documents(glob_cfg)) == docs[:-1]


def test_hub_names_and_binary_files_are_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"'someorg/somedata'.*no hub access.*save_to_disk"):
        check_source(DataConfig(source="someorg/somedata"))
    blob = tmp_path / "weights.bin"
    blob.write_bytes(random.Random(0).randbytes(4096))  # random bytes, NULs among them
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--data.source", str(blob),
                 "--train.run_dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and not run_dir.exists(), err  # refused before anything was written
    assert str(blob) in err and "binary file of no supported format" in err and ".parquet" in err


def run(tmp: Path, name: str, *overrides: str) -> tuple[list[dict], Trainer]:
    cfg = tiny(tmp, name, "--train.steps", "3", *overrides)
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    trainer.run()
    lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], trainer


def test_jsonl_parquet_and_saved_train_identically_and_eval_source(tmp_path):
    forms = write_forms(tmp_path / "forms", corpus(300))
    losses = {}
    for form in ("jsonl", "parquet", "saved"):
        records, _ = run(tmp_path, form, "--data.source", str(forms[form]),
                         "--data.text_field", "body")
        losses[form] = [r["loss"] for r in records]
    assert losses["jsonl"] == losses["parquet"] == losses["saved"]  # bit for bit

    held_out = write_forms(tmp_path / "held", corpus(40, seed=1))["csv"]
    records, trainer = run(tmp_path, "eval", "--data.source", str(forms["jsonl"]),
                           "--data.text_field", "body", "--data.eval_source", str(held_out))
    final = records[-1]
    assert final["eval_perplexity"] == pytest.approx(math.exp(final["eval_loss"]))
    # The eval source's tokens are the eval split; the whole training source trains.
    ids = trainer.data.eval.tolist()
    assert bytes(ids).replace(b"\xff", b"\n").decode().split("\n")[:-1] == corpus(40, seed=1)
    assert trainer.data.train[-1] == 0xFF and len(trainer.data.train) == sum(
        len(d.encode()) + 1 for d in corpus(300))


def test_parallel_tokenization_writes_the_same_stream(tmp_path, monkeypatch):
    from shardtrain.data import load_dataset, tokenize

    monkeypatch.setattr(tokenize, "BATCH_CHARS", 2000)  # ~10 batches: the workers start
    src = write_forms(tmp_path / "forms", corpus(200))["parquet"]
    streams = []
    for n_proc in (1, 2):
        cfg = DataConfig(source=str(src), text_field="body", tokenizer="bpe", bpe_vocab_size=300,
                         num_proc=n_proc, cache_dir=str(tmp_path / f"cache{n_proc}"))
        ds = load_dataset(cfg, seq_len=8)
        streams.append(np.concatenate([ds.train, ds.eval]))
    assert np.array_equal(streams[0], streams[1])
    eos = ds.tokenizer.eos_id
    assert (streams[0] == eos).sum() == 200 and streams[0][-1] == eos
