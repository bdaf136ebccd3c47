"""train.fp8 in one process (quant/float8.py, config/fp8.py): which layers the conversion
swaps (on meta, keeping every parameter object), the refused configs (the planner refuses
them too), each recipe's forward and backward against a dequantize-then-matmul reference of
the same roundings, and the planner's fp8 gather terms.
(Multi-rank parity rows: tests/test_fp8_parity.py; ZeRO-3's fp8 gathers: test_fp8_zero.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parity import make_mesh, tiny
from shardtrain.config import ConfigError
from shardtrain.cost import hardware
from shardtrain.model.transformer import Transformer
from shardtrain.plan.layout import Layout, trainer_refusal
from shardtrain.plan.traffic import step_ops
from shardtrain.train.trainer import Trainer

pytest.importorskip("torchao", reason="train.fp8 needs the fp8 extra (torchao)")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from shardtrain.quant.float8 import convert_blocks  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_conversion_swaps_the_blocks_linears_on_meta(tmp_path):
    cfg = tiny(tmp_path, "convert")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    before = dict(model.named_parameters())
    names = convert_blocks(model, "tensorwise")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.{i}.{part}" for i in range(cfg.model.n_layers) for part in
                         ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2",
                          "mlp.w3")}
    assert sorted(names) == sorted(f"{n}.weight" for n in converted)
    assert type(model.head) is nn.Linear  # the head, embedding and norms stay as they are
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()  # same names: checkpoints and ZeRO units unchanged
    assert all(after[n] is p and p.device.type == "meta" for n, p in before.items())


@pytest.mark.parametrize("overrides, field", [
    (("--train.precision", "fp16"), "train.precision=fp16"),
    (("--model.n_experts", "4"), "model.n_experts"),
    (("--parallel.tp", "4"), "parallel.tp=4 above model.n_kv_heads"),  # kv heads shared
    (("--lora.rank", "4"), "lora.rank"),
    (("--model.dim", "72", "--model.n_heads", "4", "--model.n_kv_heads", "2"), "model.dim"),
])
def test_refused_configs_name_the_field(tmp_path, overrides, field):
    cfg = tiny(tmp_path, "bad", "--train.fp8", "tensorwise", *overrides)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg.validate(4 if "--parallel.tp" in overrides else 1)
    tiny(tmp_path, "ok", "--train.fp8", "rowwise").validate(1)  # fp32 and bf16 both run
    tiny(tmp_path, "ok", "--train.fp8", "tensorwise", "--train.precision", "bf16").validate(1)


def _fp8(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """t cast to `dtype` and back, scaled by max / amax (over `dim`, or the whole tensor),
    the scale in fp64 then fp32, floored to a power of 2 under `pow2`: torchao's rounding."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / a.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    m = torch.finfo(dtype).max
    return (t * scale).clamp(-m, m).to(dtype).float() / scale


def _reference(x, w, go, recipe: str):
    """(out, grad_input, grad_weight) of y = x w^T, each matmul on dequantized fp8 operands:
    tensorwise e4m3 forward, e5m2 output gradient; rowwise e4m3 throughout, each operand
    scaled along the matmul's inner dimension, scales powers of 2, results in bf16
    (torchao's recipes)."""
    if recipe == "tensorwise":
        q = {k: (lambda t, d=d: _fp8(t, d, None, False)) for k, d in
             (("x", E4M3), ("w", E4M3), ("go", E5M2))}
        out = q["x"](x) @ q["w"](w).t()
        return out, q["go"](go) @ q["w"](w), q["go"](go).t() @ q["x"](x)
    r = lambda t, dim: _fp8(t, E4M3, dim, True)  # noqa: E731
    # torchao's row-scaled matmuls return bf16 (_scaled_mm has no fp32 output with row
    # scales); the scales are powers of 2, so rounding before or after them is the same
    b = lambda t: t.bfloat16().float()  # noqa: E731
    out = r(x, -1) @ r(w, -1).t()  # [M, K] x [K, N]: inner dimension K
    return b(out), b(r(go, -1) @ r(w, 0)), b(r(go, 0).t() @ r(x, 0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_matches_the_dequantized_reference(recipe):
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 48, bias=False))])
    assert convert_blocks(model, recipe) == ["layers.0.0.weight"]
    layer = model.layers[0][0]
    x = (torch.randn(32, 64) * torch.logspace(-2, 1, 32)[:, None]).requires_grad_()  # [M, K]
    go = torch.randn(32, 48) * torch.logspace(-3, 0, 48)  # [M, N]: uneven rows and columns
    out = layer(x)
    out.backward(go)
    ref_out, ref_gi, ref_gw = _reference(x.detach(), layer.weight.detach(), go, recipe)
    for got, ref in ((out, ref_out), (x.grad, ref_gi), (layer.weight.grad, ref_gw)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # fp32 sum order only
    plain = x.detach() @ layer.weight.detach().t()
    assert (out - plain).abs().max() > 1e-4  # the fp8 roundings are really there


def test_the_planner_refuses_what_fp8_refuses_and_counts_fp8_gathers(tmp_path):
    model = tiny(tmp_path, "plan").model
    refusal = trainer_refusal(Layout(dp=1, tp=4, fp8="tensorwise"), model, seq_len=32)
    assert refusal is not None and "parallel.tp=4 above" in refusal  # tiny: 2 kv heads
    assert trainer_refusal(Layout(dp=1, tp=2, sp=True, fp8="rowwise"), model, seq_len=32) \
        is None
    assert "train.fp8" in trainer_refusal(Layout(dp=2, fp8="fp4"), model, seq_len=32)
    hw = hardware.get("h100")

    def dp_ops(fp8: str, zero: int = 3, tp: int = 1) -> dict[str, float]:
        lay = Layout(dp=2, tp=tp, zero=zero, precision="amp", fp8=fp8)
        assert trainer_refusal(lay, model, seq_len=32) is None
        ops = step_ops(model, lay, hw, seq_len=32)
        return {o.op: o.bytes_sent for o in ops if o.group == "dp"}

    bf16, fp8 = dp_ops("none"), dp_ops("tensorwise")
    assert "all_reduce" not in bf16 and fp8["all_reduce"] > 0  # the amax all-reduces
    assert fp8["all_gather"] < bf16["all_gather"] and fp8["reduce_scatter"] == \
        bf16["reduce_scatter"]
    assert dp_ops("rowwise") == bf16 and dp_ops("tensorwise", zero=2) == dp_ops("none", 2)
    # under tp ZeRO-3 gathers tp slices in bf16 (cost/fp8.py), as the runtime does
    assert dp_ops("tensorwise", tp=2) == dp_ops("none", tp=2)


def test_recompute_and_activation_offload_keep_fp8_bitwise(tmp_path):
    """Selective recomputation reruns the attention core, activation offload moves what the
    blocks save (Float8Linear saves its high-precision input and weight): fp32, one process,
    the same losses bit for bit. (Full recomputation under pp: test_fp8_parity.py.)"""
    losses = {}
    for name, o in [("plain", ()), ("selective", ("--train.activation_checkpointing",
                                                  "selective")),
                    ("offload", ("--train.activation_offload", "cpu"))]:
        cfg = tiny(tmp_path, name, "--train.fp8", "tensorwise", "--train.steps", "2", *o)
        trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
        losses[name] = [trainer.train_step()["loss"] for _ in range(2)]
    assert losses["selective"] == losses["plain"] == losses["offload"], losses
