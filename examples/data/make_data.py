"""Writes the small corpus of docs/data.md's commands in every source form (run from the
repository root: python examples/data/make_data.py). Sentences drawn from a fixed grammar
with a fixed seed, so the files are the same on every run. Also the chat examples
(docs/finetuning.md): conversations about the same grammar (chat.jsonl) and a small
tokenizer directory with a chat template (chat_tokenizer/; needs transformers)."""

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


# A ChatML-like template; {% generation %} marks the assistant's tokens (data/chat.py).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{% else %}"
                 "{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subject = rng.choice(SUBJECTS)
        answer = f"{subject} {rng.choice(VERBS)} {rng.choice(OBJECTS)}.".capitalize()
        out.append([{"role": "user", "content": f"what does {subject} do?"},
                    {"role": "assistant", "content": answer}])
    return out


def chat() -> None:
    """chat.jsonl (200 conversations) and chat_tokenizer/: a 200-token BPE over their text
    (Metaspace keeps the spaces), EOS <|end|>, with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    convs = conversations(200, seed=2)
    (HERE / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    texts = [m["content"] for c in convs for m in c]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=200, show_progress=False,
        special_tokens=["<unk>", "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(HERE / "chat_tokenizer"))


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
    chat()


if __name__ == "__main__":
    main()
