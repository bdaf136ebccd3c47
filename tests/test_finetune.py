"""Fine-tuning end to end: a `transformers` Llama directory fine-tuned with QLoRA and 8-bit
AdamW by the trainer, exported, reloaded by `transformers` and sampled by `shardtrain
generate`; parity rows for LoRA under dp=2, ZeRO-2, pp=2 (ZB-H1) and tp=2 (with and without sp; dp=2
and tp=2 in bf16 too, tp within the bf16 bound of parity.py), for QLoRA under dp=2 and
ZeRO-2 and for adamw8bit under ZeRO-2; the memory ledger of an adapter run. Chat SFT rows
(tests/test_chat.py has the rest) share the spawn: packed conversations under dp=2 with
other micro-batches than the reference's, tp=2 with sp (vocab-parallel loss; the mask over
the gathered sequence) and pp=2 (positions through the stages), padded ones under ZeRO-2
with micro-batches of one and under cp=2 (each rank's half of a sequence counts its own
tokens): with unequal loss-token counts per micro-batch, only a loss averaged over the
global batch's count agrees across them."""

from __future__ import annotations

import json

import pytest
import torch

from dist import run_distributed
from parity import (BF16_LOSS_RTOL, assert_parity, make_mesh, tiny, train_layout,
                    train_layouts, worst_loss_deviation)
from shardtrain import cli, config
from shardtrain.config import ConfigError
from shardtrain.train.start.prepare import prepare_run
from shardtrain.train.finetune.finetune import build_skeleton, resolve_init_from
from shardtrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def hf_dir(tmp):
    """A random tiny Llama with the tiny preset's shape (so the preset's model section
    agrees with its config.json), saved as a Hugging Face directory."""
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp / "hf")
    return tmp / "hf"


@pytest.fixture(scope="module")
def chat(tmp):
    """The reference overrides of the chat rows: a tiny Llama with a chat tokenizer and
    conversations (chat_data.py), packed under data.document_mask."""
    from chat_data import llama_dir, write_chat

    return ("--model.init_from", str(llama_dir(tmp / "chat-llama")), "--data.format", "chat",
            "--data.source", str(write_chat(tmp / "chat.jsonl", 200, turns=2)),
            "--data.document_mask", "true")


@pytest.fixture(scope="module")
def jsonl(tmp):
    import inspect

    import argparse as source  # any text will do: Python source, as JSONL (the standard
    lines = inspect.getsource(source).splitlines()  # library's: it does not change with ours)
    path = tmp / "data.jsonl"
    records = [json.dumps({"text": "\n".join(lines[i:i + 20])}) for i in range(0, len(lines), 20)]
    path.write_text("\n".join(records * 4) + "\n")
    return path


def test_qlora_adamw8bit_fine_tune_exports_to_transformers(tmp, hf_dir, jsonl, capsys):
    cfg = tiny(tmp, "qlora", "--model.init_from", str(hf_dir), "--data.source", str(jsonl),
               "--data.eval_fraction", "0.1", "--lora.rank", "8", "--lora.targets",
               "q,k,v,o,gate,up,down", "--lora.quantize_base", "nf4", "--optim.name",
               "adamw8bit", "--train.steps", "30", "--train.lr", "1e-2",
               "--train.export_hf", str(tmp / "export"))
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    before = trainer.evaluate()
    result = trainer.run()
    print(f"QLoRA + adamw8bit fine-tune: eval loss {before:.4f} -> {result.eval_loss:.4f}")
    assert result.eval_loss < before - 0.3
    ledger = result.history[-1]
    n_adapter = sum(p.numel() for n, p in trainer.parallel.module.named_parameters()
                    if p.requires_grad)
    assert ledger["grads_bytes"] == 4 * n_adapter and ledger["nf4_base_bytes"] > 0
    # The export: transformers loads it and agrees with the trained model.
    model = trainer.parallel.module  # one process: the whole model (LoRA linears, NF4 bases)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export").eval()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(tmp / "export"), "--tokens", "5",
                     "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    # And the checkpoint exports the same way from the command line.
    step = sorted((tmp / "qlora" / "checkpoints").glob("step_*"))[-1]
    assert cli.main(["export", "--checkpoint", str(step), "--out", str(tmp / "export2")]) == 0
    assert cli.main(["export", "--checkpoint", str(step), "--out", str(tmp / "adapters"),
                     "--adapters-only"]) == 0
    assert (tmp / "adapters" / "adapter_model.safetensors").is_file()  # peft's format


def test_fine_tune_config_errors(tmp, hf_dir):
    with pytest.raises(ConfigError, match=r"model.dim=128 conflicts with .*config.json"):
        prepare_run(tiny(tmp, "bad", "--model.init_from", str(hf_dir), "--model.dim", "128"),
                        1, prepare_data=False)
    with pytest.raises(ConfigError, match="lora.rank=4 with parallel.tp=2: an NF4 base"):
        tiny(tmp, "bad", "--lora.rank", "4", "--parallel.tp", "2", "--lora.quantize_base",
             "nf4").validate(2)
    with pytest.raises(ConfigError, match="lora.rank=4 with parallel.zero=3"):
        tiny(tmp, "bad", "--lora.rank", "4", "--parallel.zero", "3").validate(2)
    with pytest.raises(ConfigError, match="config.json: missing"):
        prepare_run(tiny(tmp, "bad", "--model.init_from", str(tmp)), 1, prepare_data=False)


B8 = ("--train.global_batch", "8", "--train.steps", "4")
LORA = ("--lora.rank", "4", "--lora.targets", "q,v,gate,down", "--train.lr", "1e-2")
QLORA = (*LORA, "--lora.quantize_base", "nf4")
LORA16 = (*LORA, "--train.precision", "bf16")
ROWS = [("lora dp2", LORA, []),
        ("lora zero2 dp2", LORA, ["--parallel.zero", "2"]),
        ("lora tp2", LORA, ["--parallel.tp", "2"]),
        ("lora tp2 sp", LORA, ["--parallel.tp", "2", "--parallel.sp", "true"]),
        # a frozen base under split backward (test_pipeline_zero_bubble.py has the rest)
        ("lora pp2 zb-h1", LORA, ["--parallel.pp", "2", "--parallel.schedule", "zb-h1"]),
        ("lora dp2 bf16", LORA16, []),
        ("lora tp2 bf16", LORA16, ["--parallel.tp", "2"]),
        ("qlora dp2", QLORA, []),
        ("qlora zero2 dp2", QLORA, ["--parallel.zero", "2"]),
        ("adamw8bit zero2 dp2", ("--optim.name", "adamw8bit"), ["--parallel.zero", "2"])]


def adapter_memory(trainer: Trainer) -> dict:
    return {"memory": trainer.memory_ledger()}


def test_lora_and_adamw8bit_parity_with_single_process(tmp, hf_dir, chat):
    def text(name, *overrides):
        return config.to_toml(tiny(tmp, name, "--model.init_from", str(hf_dir), *B8, *overrides))

    padded = (*chat, "--data.document_mask", "false")
    # The same 4 eval rows (micro_batch x eval_batches), batched otherwise: the eval loss,
    # a mean over their counted tokens, must not change either.
    rows = ROWS + [("chat dp2 micro_batch 4", chat,
                    ["--train.micro_batch", "4", "--train.eval_batches", "1"]),
                   ("chat padded zero2 dp2 micro_batch 1", padded,
                    ["--parallel.zero", "2", "--train.micro_batch", "1",
                     "--train.eval_batches", "4"]),
                   ("chat tp2 sp", chat, ["--parallel.tp", "2", "--parallel.sp", "true"]),
                   ("chat pp2", chat, ["--parallel.pp", "2"]),
                   ("chat padded cp2", padded, ["--parallel.cp", "2"])]
    texts = [text(f"row{i}", *ref, *layout) for i, (_, ref, layout) in enumerate(rows)]
    per_rank = run_distributed(train_layouts, 2, texts, adapter_memory)
    refs: dict[tuple, dict] = {}
    for i, (label, ref, layout) in enumerate(rows):
        if ref not in refs:
            refs[ref] = train_layout(0, 1, text(f"ref{len(refs)}", *ref), adapter_memory)
        for rank, results in enumerate(per_rank):
            if ref == LORA16 and "--parallel.tp" in layout:  # bf16 split matmuls (parity.py)
                worst = worst_loss_deviation(refs[ref]["losses"], results[i]["losses"])
                assert worst <= BF16_LOSS_RTOL[True], f"{label} rank {rank}: {worst:.2e}"
            else:
                assert_parity(refs[ref], results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
    # The 2-process LoRA run's checkpoint exports, and transformers reloads it equal.
    step = sorted((tmp / "row0" / "checkpoints").glob("step_*"))[-1]
    assert cli.main(["export", "--checkpoint", str(step), "--out", str(tmp / "row0-hf")]) == 0
    cfg = config.loads(texts[0])
    resolve_init_from(cfg)
    model = build_skeleton(cfg, device="cpu")
    model.load_state_dict(per_rank[0][0]["weights"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp / "row0-hf").eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    full = train_layout(0, 1, text("full", "--train.steps", "1"), adapter_memory)["memory"]
    lora = per_rank[0][0]["memory"]
    print(f"memory ledger, dp2: full model grads {full['grads_bytes']} B, optimizer "
          f"{full['optimizer_bytes']} B; LoRA (q,v,gate,down, r=4) grads {lora['grads_bytes']} "
          f"B, optimizer {lora['optimizer_bytes']} B")
    assert lora["grads_bytes"] < full["grads_bytes"] / 20
    # AdamW: m and v per adapter value (and a 4-byte step count per tensor).
    assert 2 * lora["grads_bytes"] <= lora["optimizer_bytes"] <= 2 * lora["grads_bytes"] + 256
