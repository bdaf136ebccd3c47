"""Chat SFT (data.format = chat): the assistant's tokens found with and without generation
marks in the template, conversations packed or padded into rows, the loss averaged over
the counted tokens of the global batch, bad input refused before any work, and the
acceptance run: a 40-step full fine-tune learns a fixed reply to random words only when
the loss is on the assistant's tokens.

The layout rows (dp=2, ZeRO-2, tp=2, pp=2 against one process, on chat data) run in
tests/test_finetune.py's spawn."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chat_data import (REPLY, WITHOUT_MARKS, conversation, llama_dir, tokenizer_dir,
                       write_chat)
from parity import make_mesh, tiny
from shardtrain.config import ConfigError, DataConfig
from shardtrain.config.data import IGNORE
from shardtrain.data.chat import load_chat_tokenizer, render
from shardtrain.data.chat_rows import COUNTED, START, pack
from shardtrain.data.rows import Rows
from shardtrain.train.start.prepare import prepare_run
from shardtrain.train.trainer import Trainer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("chat")


@pytest.fixture(scope="module")
def llama(tmp):
    return llama_dir(tmp / "llama")


def chat_cfg(tmp, llama, name, *overrides):
    return tiny(tmp, name, "--model.init_from", str(llama), "--data.format", "chat",
                "--data.source", str(write_chat(tmp / "chat.jsonl", 400, turns=2)),
                "--train.lr", "1e-2", *overrides)


def test_assistant_tokens_with_and_without_generation_marks(tmp, llama):
    marked = load_chat_tokenizer(DataConfig(tokenizer=str(llama)))
    plain = load_chat_tokenizer(DataConfig(tokenizer=str(tokenizer_dir(tmp / "plain",
                                                                      WITHOUT_MARKS))))
    reply = marked.encode(REPLY, add_special_tokens=False) + [marked.eos_token_id]
    for seed in range(5):
        messages = conversation(random.Random(seed), turns=1 + seed % 3)
        ids, mask = render(marked, messages, "c")
        assert (ids, mask) == render(plain, messages, "c")  # prefix spans == marks
        # Exactly the replies and their EOS, each turn's.
        kept = [i for i, m in zip(ids, mask) if m]
        assert kept == reply * (1 + seed % 3)
        assert ids[0] == marked.bos_token_id and not mask[0]


def test_rows_packed_without_crossing_or_padded():
    convs = [([1] * n, [False] * (n - 2) + [True, True]) for n in (4, 5, 3, 9, 2)]
    table, stats = pack(convs, 8, packed=True, pad_id=0)
    tokens, flags = table
    # 4 fits, 5 does not (a fresh row), 3 joins it, 9 is cut to 8, 2 starts a row.
    starts = [list(np.flatnonzero(r & START)) for r in flags]
    assert starts == [[0, 4], [0, 5], [0], [0, 2]] and stats == {"conversations": 5, "cut": 1}
    assert (flags[0] & COUNTED).tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # padding: not counted
    table, _ = pack(convs, 8, packed=False, pad_id=7)
    assert table.shape == (2, 5, 8) and table[0, 0].tolist() == [1, 1, 1, 1, 7, 7, 7, 7]
    # A conversation's first token is never a target, however it is flagged.
    assert not any(table[1, :, 0] & COUNTED)
    # Rows become (inputs, targets, positions): positions restart per conversation.
    rows = Rows(np.arange(16).reshape(2, 8), counted=np.ones((2, 8), bool),
                starts=np.isin(np.arange(8), [0, 3])[None].repeat(2, 0))
    inputs, targets, positions = rows.batch()
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert targets[1].tolist() == list(range(9, 16)) and inputs.shape == (2, 7)


def test_loss_is_the_mean_over_the_global_batchs_counted_tokens(tmp, llama):
    """Micro-batches with unequal counts: the step's loss is sum(token losses) / count,
    not the mean of the micro-batches' means."""
    cfg = chat_cfg(tmp, llama, "norm", "--data.document_mask", "true", "--train.steps", "1")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    batches = trainer.sampler.next_step()
    counts = [int(t.ne(IGNORE).sum()) for _, t, _ in batches]
    assert sum(counts) == trainer.sampler.loss_tokens and len(set(counts)) > 1
    with torch.no_grad():
        model = trainer.parallel.module
        summed = sum(F.cross_entropy(model(x, p).flatten(0, 1), t.flatten(), reduction="sum")
                     for x, t, p in batches)
        means = [F.cross_entropy(model(x, p).flatten(0, 1), t.flatten()) for x, t, p in batches]
    loss = trainer.parallel.forward_backward(batches, trainer.sampler.loss_tokens)
    torch.testing.assert_close(loss, summed / sum(counts), rtol=1e-6, atol=0)
    # The mean of the micro-batches' means differs by more than the parity tolerance.
    assert abs(sum(means) / len(means) / loss - 1) > 1e-5


def test_chat_sft_learns_the_reply_only_with_assistant_only_loss(tmp, llama):
    """The acceptance run: docs/finetuning.md records its figures."""
    runs = {}
    for masked in ("true", "false"):
        cfg = chat_cfg(tmp, llama, f"sft-{masked}", "--data.assistant_only_loss", masked,
                       "--data.document_mask", "true", "--train.steps", "40")
        runs[masked] = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run()
        records = [json.loads(line) for line in
                   (tmp / f"sft-{masked}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss_tokens"] for r in records] == [h["loss_tokens"]
                                                       for h in runs[masked].history]
        counts = [r["loss_tokens"] for r in records]
        print(f"assistant_only_loss={masked}: loss {runs[masked].losses[0]:.3f} -> "
              f"{runs[masked].losses[-1]:.4f} (every 5 steps: "
              f"{[round(x, 3) for x in runs[masked].losses[4::5]]}), eval "
              f"{runs[masked].eval_loss:.4f}, loss tokens per step {min(counts)}-{max(counts)}")
    assert runs["true"].losses[-1] < 0.3 and runs["true"].eval_loss < 0.3
    # Random words cannot be learned: the loss over every token stays far above.
    assert runs["false"].losses[-1] > 1.0
    assert (runs["true"].history[0]["loss_tokens"] < runs["false"].history[0]["loss_tokens"])


def test_bad_chat_input_is_refused_before_any_work(tmp, llama):
    def refused(match, *overrides, source=None):
        cfg = chat_cfg(tmp, llama, "bad", *overrides)
        if source is not None:
            cfg.data.source = str(source)
        with pytest.raises(ConfigError, match=match):
            prepare_run(cfg, 1, prepare_data=False)
        assert not (tmp / "bad").exists()

    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    refused(r"bad\.jsonl:1: 'messages' \(data\.messages_field\) must be a list", source=bad)
    bad.write_text(json.dumps({"text": "hi"}) + "\n")
    refused(r"bad\.jsonl:1: .*data\.messages_field.*the row has no such field", source=bad)
    text = tmp / "notes.txt"
    text.write_text("plain text, no records")
    refused(r"data.format=chat reads records, but .*notes.txt is text", source=text)
    refused(r"data.tokenizer='byte' is not a Hugging Face tokenizer directory",
            "--model.init_from", "", "--data.tokenizer", "byte")
    refused(r"no chat template", "--data.tokenizer", str(tokenizer_dir(tmp / "none", "")))
    with pytest.raises(ConfigError, match="data.format=chat with data.streaming=true"):
        DataConfig(format="chat", streaming=True, eval_source="x").validate()
    with pytest.raises(ConfigError, match="data.assistant_only_loss=false applies to "):
        DataConfig(assistant_only_loss=False).validate()
