"""Today's open families through Hugging Face interop: tiny random Llama 3.2 (llama3 RoPE
scaling, tied), Qwen2.5 (q/k/v biases, tied, theta 1e6), Qwen3 (per-head q/k RMSNorm,
explicit head_dim, GQA) and Mistral (GQA, window 4096) load with the logits of
`transformers` and export to directories `transformers` loads with the same logits; the
planner counts their parameters exactly; refusals name the field and what is supported."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardtrain import cli  # noqa: E402
from shardtrain.config import ConfigError, ModelConfig  # noqa: E402
from shardtrain.cost.counts import param_counts  # noqa: E402
from shardtrain.model.hf import load_hf, save_hf, source_config  # noqa: E402
from shardtrain.model.transformer import build_model  # noqa: E402
from shardtrain.plan.layout import Layout  # noqa: E402
from shardtrain.plan.rank_states import rank0_tensors  # noqa: E402

from hf_tiny import logits, save_random  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
FAMILIES = {
    # max_position_embeddings beyond original_max_position_embeddings, and an
    # original length short enough that all three llama3 bands occur for D = 16.
    "llama3": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True, max_position_embeddings=128, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen2": (transformers.Qwen2Config, dict(
        tie_word_embeddings=True, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": (transformers.Qwen3Config, dict(
        head_dim=24, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "mistral": (transformers.MistralConfig, dict(
        sliding_window=4096, tie_word_embeddings=False, max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}


def tiny_family(path, family: str, **changes):
    """A random tiny checkpoint of `family`, saved (hf_tiny.save_random)."""
    kind, extra = FAMILIES[family]
    return save_random(path, kind(**{**SHAPE, **extra, **changes}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_both_ways_and_counts_are_exact(tmp_path, family):
    ref = tiny_family(tmp_path / "hf", family)
    ours = load_hf(tmp_path / "hf")
    cfg = ours.cfg
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert cfg.rope_scaling == ("llama3" if family == "llama3" else "none")
    assert cfg.head_dim == (24 if family == "qwen3" else 16)
    assert cfg.sliding_window == (4096 if family == "mistral" else 0)
    torch.testing.assert_close(logits(ours, True), logits(ref, False), rtol=0, atol=1e-4)
    save_hf(ours, tmp_path / "out", base_config=source_config(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(ref)
    torch.testing.assert_close(logits(back, False), logits(ref, False), rtol=0, atol=1e-4)
    # A fresh export (no source config.json) picks the family from the pieces.
    save_hf(ours, tmp_path / "fresh")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fresh").eval()
    assert type(fresh) is type(ref)
    torch.testing.assert_close(logits(fresh, False), logits(ref, False), rtol=0, atol=1e-4)
    # The planner's count is the built model's and transformers'.
    built = build_model(cfg)
    n = sum(p.numel() for p in built.parameters())
    assert param_counts(cfg).total == n == sum(p.numel() for p in ref.parameters())
    assert rank0_tensors(cfg, Layout()) == [(k, p.numel()) for k, p in built.named_parameters()]


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_linear_and_dynamic_rope_scaling_match(tmp_path, rope_type):
    ref = tiny_family(tmp_path / "hf", "llama3", rope_parameters=dict(
        rope_type=rope_type, rope_theta=10000.0, factor=4.0))
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.rope_scaling == rope_type and ours.cfg.rope_factor == 4.0
    torch.testing.assert_close(logits(ours, True), logits(ref, False), rtol=0, atol=1e-4)
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.rope_parameters["rope_type"] == rope_type
    torch.testing.assert_close(logits(back, False), logits(ref, False), rtol=0, atol=1e-4)


def test_qwen_window_is_a_limit_only_where_a_layer_slides(tmp_path):
    ref = tiny_family(tmp_path / "a", "qwen2", use_sliding_window=True, sliding_window=48,
                      max_window_layers=1)  # layer 1 slides
    assert load_hf(tmp_path / "a").cfg.sliding_window == 48
    torch.testing.assert_close(logits(load_hf(tmp_path / "a"), True), logits(ref, False),
                               rtol=0, atol=1e-4)
    tiny_family(tmp_path / "b", "qwen2", use_sliding_window=True, sliding_window=48,
                max_window_layers=2)  # no layer slides
    assert load_hf(tmp_path / "b").cfg.sliding_window == 0


def _edit(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_refusals_name_the_field_and_the_supported_values(tmp_path, capsys):
    hf = tmp_path / "hf"
    tiny_family(hf, "mistral", sliding_window=32)
    _edit(hf, model_type="gemma")
    with pytest.raises(ConfigError, match=r"model_type='gemma' is not supported; .*llama, "
                                          r"qwen2, qwen3, mistral, mixtral, qwen3_moe, deepseek_v3, gpt2"):
        load_hf(hf)
    _edit(hf, model_type="mistral", rope_parameters={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"rope_type=.longrope. is not supported .*default, "
                                          r"llama3, linear, dynamic, yarn"):
        load_hf(hf)
    _edit(hf, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    with pytest.raises(ConfigError, match=r"model.qkv_bias and model.qk_norm"):
        save_hf(build_model(ModelConfig(qkv_bias=True, qk_norm=True)), tmp_path / "x")
    # From the command line: exit 2, the reason on stderr, nothing written.
    run_dir = tmp_path / "run"
    for edits, reason in [({}, "train.seq_len=64 exceeds model.sliding_window=32 (the model's "
                               "attention window): shardtrain attends over the whole sequence"),
                          ({"model_type": "gemma"}, "model_type='gemma' is not supported"),
                          ({"rope_parameters": {"rope_type": "longrope"}},
                           "rope_type='longrope' is not supported")]:
        _edit(hf, **{"model_type": "mistral", "rope_parameters": {"rope_type": "default",
                                                                  "rope_theta": 1e6}, **edits})
        code = cli.main(["train", "--config", "finetune", "--model.init_from", str(hf),
                         "--train.seq_len", "64", "--train.run_dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2 and reason in err and not run_dir.exists(), err


def test_lora_fine_tune_runs_on_each_family(tmp_path):
    """`shardtrain train --config finetune --model.init_from DIR` on each family: the run
    trains, its export is the family's own class in transformers, and its checkpoint exports
    (streamed, `shardtrain export`) to the same logits, and with `--adapters-only` to
    adapters that peft loads over the base with those logits too."""
    from parity import tiny_data

    peft = pytest.importorskip("peft")

    for family in FAMILIES:
        hf, run = tmp_path / family, tmp_path / f"{family}-run"
        ref = tiny_family(hf, family)
        assert cli.main(["train", "--config", "finetune", "--model.init_from", str(hf),
                         "--train.run_dir", str(run), "--train.export_hf", str(run / "hf"),
                         "--train.steps", "2", "--train.seq_len", "32", "--train.global_batch",
                         "2", "--train.micro_batch", "2", "--train.eval_every", "0",
                         "--train.eval_batches", "1", "--train.sample_tokens", "0",
                         "--train.progress", "false", "--train.peak_flops", "1e12",
                         "--data.max_bytes", "200000", "--train.lr", "1e-2",
                         "--optim.warmup_steps", "0", *tiny_data(tmp_path)]) == 0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
        back = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
        assert type(back) is type(ref), family
        # The checkpoint's adapters in peft's format, over the base: the merged export.
        step = sorted((run / "checkpoints").glob("step_*"))[-1]
        assert cli.main(["export", "--checkpoint", str(step), "--out", str(run / "adapters"),
                         "--adapters-only"]) == 0
        assert cli.main(["export", "--checkpoint", str(step), "--out", str(run / "merged")]) == 0
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "merged").eval()
        torch.testing.assert_close(logits(merged, False), logits(back, False), rtol=0, atol=1e-5)
        adapted = peft.PeftModel.from_pretrained(ref, run / "adapters").eval()
        torch.testing.assert_close(logits(adapted, False), logits(back, False), rtol=0,
                                   atol=1e-4)


@pytest.mark.parametrize("extra", [{}, {"mscale": 1.0, "mscale_all_dim": 0.5}])
def test_yarn_rope_scaling_matches(tmp_path, extra):
    """YaRN as Qwen2.5 / Qwen3 long-context configs carry it: an original length short
    enough that the ramp falls inside D = 16's pairs, the attention factor from the factor
    or from mscale / mscale_all_dim."""
    ref = tiny_family(tmp_path / "hf", "qwen3", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
        **extra))
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_original_max_len == 32
    torch.testing.assert_close(logits(ours, True), logits(ref, False), rtol=0, atol=1e-4)
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(back, False), logits(ref, False), rtol=0, atol=1e-4)


@pytest.mark.parametrize("pieces", [{"qkv_bias": True}, {"qk_norm": True, "head_size": 24}])
def test_planner_tensor_parallel_slices_are_the_runtimes(pieces):
    """Rank 0's tensors at tp=2, built on the meta device by the runtime, are the planner's
    (the biases split with their rows, the q/k norms whole)."""
    from tp_meta import tp_rank0_tensors

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, **pieces)
    built = tp_rank0_tensors(cfg)
    assert built == rank0_tensors(cfg, Layout(tp=2, precision="fp32"))
