"""Tiny random Hugging Face checkpoints for the interop tests (test_hf_families.py,
test_hf_moe.py, test_hf_deepseek.py), the logits both sides compare, and the checks the
mixture-of-experts families share (load and export; layouts started from a checkpoint)."""

from __future__ import annotations

import torch

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def save_random(path, hf_config):
    """A random model of `hf_config` (a transformers config), saved to `path`; every 1-D
    weight (biases, norms) moved away from its init so a misplaced or unpermuted one shows
    in the logits."""
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.eval().save_pretrained(path)
    return model


def logits(model, ours: bool) -> torch.Tensor:
    """`model`'s logits on TOKENS: ours (a Transformer) or transformers' (`.logits`)."""
    with torch.no_grad():
        return model(TOKENS) if ours else model(TOKENS).logits


def check_layouts_from_checkpoint(tmp_path, model_type: str, *common: str) -> None:
    """The slow rows of the MoE families' interop tests: runs of the tiny preset with
    `common` (model.init_from among them) under ep=2 and under tp=2 (sp) train as one
    process does from the same weights (losses rtol 1e-5), and each run's last checkpoint
    exports (streamed, `shardtrain export`) to a `model_type` directory transformers loads
    with one process's logits."""
    import json

    import transformers

    from shardtrain import cli, config

    from dist import run_distributed
    from parity import tiny, train_layouts

    text = lambda name, *o: config.to_toml(tiny(tmp_path, name, *common, *o))  # noqa: E731
    one = train_layouts(0, 1, [text("one")])[0]
    runs = {"ep2": ("--parallel.ep", "2"), "tp2": ("--parallel.tp", "2", "--parallel.sp", "true")}
    per_rank = run_distributed(train_layouts, 2, [text(n, *o) for n, o in runs.items()])

    def exported(name: str) -> torch.Tensor:
        step = sorted((tmp_path / name / "checkpoints").glob("step_*"))[-1]
        out = tmp_path / f"{name}-hf"
        assert cli.main(["export", "--checkpoint", str(step), "--out", str(out)]) == 0
        assert json.loads((out / "config.json").read_text())["model_type"] == model_type
        return logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), False)

    ref = exported("one")
    for i, name in enumerate(runs):
        got = per_rank[0][i]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one["losses"]),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(exported(name), ref, rtol=0, atol=1e-4)


def check_load_and_export(tmp_path, ref):
    """The MoE families' round trip (test_hf_moe.py, test_hf_deepseek.py): the directory
    `tmp_path / "hf"` of transformers' `ref` loads with its logits (atol 1e-4); exports
    with and without the source config.json load in transformers with them, and back in
    shardtrain; the planner's total and active counts are transformers' parameters (the
    experts a token skips idle). Returns the loaded model's config."""
    import transformers

    from shardtrain.cost.counts import param_counts
    from shardtrain.model.hf import load_hf, save_hf, source_config

    ours = load_hf(tmp_path / "hf").eval()
    want = logits(ref, False)
    torch.testing.assert_close(logits(ours, True), want, rtol=0, atol=1e-4)
    for name, base in (("out", source_config(tmp_path / "hf")), ("fresh", None)):
        save_hf(ours, tmp_path / name, base_config=base)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert type(back) is type(ref), name
        torch.testing.assert_close(logits(back, False), want, rtol=0, atol=1e-4)
        again = load_hf(tmp_path / name).eval()
        torch.testing.assert_close(logits(again, True), want, rtol=0, atol=1e-4)
    cfg = ours.cfg
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in ref.parameters())
    idle = sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n) \
        * (1 - cfg.moe_top_k / max(cfg.n_experts, 1))
    assert counts.active == counts.total - idle
    return cfg
