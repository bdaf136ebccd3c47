"""train.fp8 under tensor (and sequence) parallelism (quant/float8_tp.py): the scales are
agreed over tp, so a sharded operand is cast with the whole tensor's scale; at tp = 1 the
tensor-parallel fp8 matmul is torchao's Float8Linear to the bit; each block's
attention and MLP at tp = 2, with and without sp, equal the single process's Float8Linear
block, outputs and gradients; without the agreement they would not; one training step's
ledger of tp traffic equals the planner's, fp8 scale all-reduces included. One spawn of two
ranks. (Whole-run parity rows: tests/test_fp8_parity.py.)

Bounds: fp32. Tensorwise casts every element with the single process's scale, so the
layers differ by fp32 sum order only, and where that moves a value across an e4m3 rounding
tie: measured below 1e-6 relative (L2). Rowwise returns each matmul in bf16 (float8.py), and
a row-parallel matmul's partial sums (and a column-parallel one's input-gradient parts) are
each rounded to bf16 before tp sums them: a few bf16 ulps, bound 1e-2 relative (L2).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist import run_distributed
from tests.parity import tiny
from shardtrain import config
from shardtrain.cost import hardware
from shardtrain.plan.layout import config_layout
from shardtrain.plan.traffic import step_ops
from tests.test_wire_dtypes import _one_step

pytest.importorskip("torchao", reason="train.fp8 needs the fp8 extra (torchao)")

B, S = 2, 32
BOUND = {"tensorwise": 1e-5, "rowwise": 1e-2}  # relative L2, fp32 (module docstring)
CASES = [(recipe, sp) for recipe in ("tensorwise", "rowwise") for sp in (False, True)]
TP2 = ("--parallel.tp", "2")
STEP = {"tensorwise": (*TP2, "--train.fp8", "tensorwise"),
        "rowwise sp": (*TP2, "--parallel.sp", "true", "--train.fp8", "rowwise"),
        # GPT-2: biases, an ungated MLP (6 converted linears); full recomputation reruns
        # each forward's agreements
        "gpt2 full recompute": (*TP2, "--train.fp8", "tensorwise", "--model.style", "gpt2",
                                "--model.n_kv_heads", "0",
                                "--train.activation_checkpointing", "full"),
        "gpt2 full recompute rowwise": (*TP2, "--train.fp8", "rowwise", "--model.style",
                                        "gpt2", "--model.n_kv_heads", "0",
                                        "--train.activation_checkpointing", "full")}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _block_errors(comm, recipe: str, sp: bool, agree: bool = True) -> dict[str, float]:
    """Relative L2 errors of one llama block's attention and MLP at tp (fp8 `recipe`)
    against the single process's converted block: outputs, input and weight gradients."""
    from shardtrain.config import ModelConfig
    from shardtrain.model.transformer import build_model
    from shardtrain.parallel.tensor.layers import apply_tensor_parallel
    from shardtrain.parallel.tensor.sharding import TensorShards
    from shardtrain.quant.float8 import convert_blocks
    from shardtrain.quant.float8_tp import Float8Tp

    t, r = comm.size, comm.rank
    cfg = ModelConfig(style="llama", vocab_size=256, dim=64, n_layers=1, n_heads=4,
                      n_kv_heads=2, max_seq_len=S)
    dense = build_model(cfg, seed=1)
    ours = copy.deepcopy(dense)
    convert_blocks(dense, recipe)
    placements, _ = apply_tensor_parallel(ours, comm, sp=sp)
    convert_blocks(ours, recipe)
    if not agree:  # each rank's own amax: what the agreement prevents
        for m in ours.layers.modules():
            if getattr(m, "fp8", None) is not None:
                m.fp8 = Float8Tp(m.fp8.config, m.fp8.kind, lambda a: a)
    shards = TensorShards(ours, comm, placements)
    rope = (dense.rope_cos[:S], dense.rope_sin[:S])
    errors = {}
    for sub in ("attn", "mlp"):
        d, o = dense.layers[0].get_submodule(sub), ours.layers[0].get_submodule(sub)
        gen = torch.Generator().manual_seed(2)
        x = (torch.randn(B, S, cfg.dim, generator=gen) *
             torch.logspace(-1, 1, S)[:, None]).requires_grad_()  # uneven token scales
        g = torch.randn(B, S, cfg.dim, generator=gen)
        args = (rope,) if sub == "attn" else ()
        out = d(x, *args)
        (out * g).sum().backward()
        x_in = (x.chunk(t, 1)[r] if sp else x).detach().clone().requires_grad_()
        mine = o(x_in, *args)  # [B, S/t, C] under sp, else [B, S, C]
        errors[f"{sub} out"] = _rel(mine, out.chunk(t, 1)[r] if sp else out)
        (mine * (g.chunk(t, 1)[r] if sp else g)).sum().backward()
        errors[f"{sub} grad x"] = _rel(x_in.grad, x.grad.chunk(t, 1)[r] if sp else x.grad)
        shards.sum_partial_grads()
        dense_grads = dict(d.named_parameters())
        for name, p in o.named_parameters():
            want = shards.placement(f"layers.0.{sub}.{name}").shard(dense_grads[name].grad)
            errors[f"{sub} grad {name}"] = _rel(p.grad, want)
    return errors


def _scales(comm) -> dict[str, float]:
    """The tensorwise scale a column-parallel shard of a weight is cast with, and the whole
    weight's (torchao's Float8Linear's)."""
    from torchao.float8.float8_utils import tensor_to_scale

    from shardtrain.parallel.tensor.layers import ColumnParallelLinear, Region
    from shardtrain.quant.float8 import float8_config

    gen = torch.Generator().manual_seed(3)
    whole = torch.randn(64, 32, generator=gen) * torch.logspace(-2, 0, 64)[:, None]  # [out, in]
    layer = ColumnParallelLinear(whole.chunk(comm.size)[comm.rank].clone(), None,
                                 Region(comm, sp=False))
    layer.use_float8(float8_config("tensorwise"))
    (wq,), _ = layer.fp8.cast([(layer.weight.detach().t(), "weight", "weight", 0)], {})
    return {"shard": wq._scale.item(), "whole": tensor_to_scale(whole, wq._data.dtype).item(),
            "own": tensor_to_scale(layer.weight.detach(), wq._data.dtype).item()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_linear_held_whole_gives_the_float8_linears_bits(tmp_path, recipe, kind):
    """At tp = 1 (nothing to agree) the tensor-parallel fp8 matmul is torchao's Float8Linear
    to the bit: output, input and weight gradients, in fp32 and under bf16 autocast."""
    from torch import nn

    from shardtrain.parallel.tensor.layers import ColumnParallelLinear, Region, \
        RowParallelLinear
    from shardtrain.quant.float8 import convert_blocks, float8_config
    from tests.parity import make_mesh

    comm = make_mesh(tiny(tmp_path, "whole"), 0, 1).comm("tp")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen)  # [out, in]
    dense = nn.Module()
    dense.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 48, bias=False))])
    dense.layers[0][0].weight.data.copy_(w)
    convert_blocks(dense, recipe)
    region = Region(comm, sp=False)
    ours = ColumnParallelLinear(w.clone(), None, region) if kind == "column" else \
        RowParallelLinear(w.clone(), None, comm, sp=False)
    ours.use_float8(float8_config(recipe))
    for autocast in (False, True):
        x = torch.randn(2, 16, 64, generator=gen) * torch.logspace(-2, 1, 16)[:, None]
        go = torch.randn(2, 16, 48, generator=gen)
        got = []
        for layer in (dense.layers[0][0], ours):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                out = layer(xi)
            out.backward(go.to(out.dtype))
            got.append((out, xi.grad, layer.weight.grad))
            layer.weight.grad = None
        for want, mine in zip(*got):
            assert torch.equal(want, mine), (recipe, kind, autocast)


def _worker(rank: int, world: int, texts: list[str]) -> dict:
    from tests.parity import make_mesh

    mesh = make_mesh(config.loads(texts[0]), rank, world)
    comm = mesh.comm("tp")
    return {"cases": {case: _block_errors(comm, *case) for case in CASES},
            "unagreed": _block_errors(comm, "tensorwise", False, agree=False),
            "scales": _scales(comm), "steps": _one_step(rank, world, texts)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict, list]:
    tmp = tmp_path_factory.mktemp("fp8tp")
    cfgs = {name: tiny(tmp, name.replace(" ", "_"), *o) for name, o in STEP.items()}
    out = run_distributed(_worker, 2, [config.to_toml(c) for c in cfgs.values()])
    return cfgs, out


def test_a_sharded_weight_is_cast_with_the_whole_weights_scale(ranks):
    for r in ranks[1]:
        s = r["scales"]
        assert s["shard"] == s["whole"]
    assert any(r["scales"]["own"] != r["scales"]["whole"] for r in ranks[1])  # it matters


def test_tp_blocks_equal_the_single_process_fp8_blocks(ranks):
    for recipe, sp in CASES:
        worst = max(max(r["cases"][recipe, sp].values()) for r in ranks[1])
        print(f"{recipe} sp={sp}: worst relative L2 {worst:.1e} (bound {BOUND[recipe]:.0e})")
        assert worst <= BOUND[recipe], (recipe, sp, ranks[1][0]["cases"][recipe, sp])
    unagreed = max(max(r["unagreed"].values()) for r in ranks[1])
    print(f"tensorwise without the agreement: {unagreed:.1e}")
    assert unagreed > 100 * BOUND["tensorwise"]


def test_ledger_equals_the_planner_with_the_scale_all_reduces(ranks):
    """The scale all-reduces (ledger tag tp:amax) equal the planner's fp8 terms (its tp
    bytes with fp8 less without), and the whole tp traffic the planner's, in every run
    (under full recomputation too: plan/tensor_traffic.py counts the MLP's g once)."""
    import dataclasses

    cfgs, out = ranks
    hw = hardware.get("h100")

    def planned(cfg, **change) -> float:
        lay = dataclasses.replace(config_layout(cfg, 2), **change)
        return sum(op.bytes_sent for op in step_ops(cfg.model, lay, hw,
                                                    seq_len=cfg.train.seq_len)
                   if op.group == "tp")

    for i, (name, cfg) in enumerate(cfgs.items()):
        amax = planned(cfg) - planned(cfg, fp8="none")
        for r in out:
            tags = r["steps"][i]["by_tag"]
            print(f"{name}: ledger tp {tags.get('tp', 0)} + tp:amax {tags.get('tp:amax')} B, "
                  f"planner {planned(cfg):.0f} B ({amax:.0f} B amaxes)")
            assert tags.get("tp:amax", 0) == pytest.approx(amax, abs=8) and amax > 0, name
            assert tags["tp"] + tags["tp:amax"] == pytest.approx(planned(cfg), abs=8), name


@pytest.mark.slow
def test_compiled_fp8_tp_blocks_match_eager(tmp_path):
    """train.compile with tp + sp under fp8 (test_compile.py's harness and backend for its
    tp rows): each block one graph, no graph break (quant/float8_tp.py's Function passes
    each tensor once and mutates nothing dynamo cannot see), the same collectives, scale
    all-reduces included, and eager's numbers (fp32 parity)."""
    from tests.parity import assert_parity
    from tests.test_compile import STEPS, _runs

    o = (*STEP["tensorwise"], "--parallel.sp", "true")
    texts = [config.to_toml(tiny(tmp_path, c, *STEPS, *o, "--train.compile", c))
             for c in ("false", "true")]
    eager, compiled = run_distributed(_runs, 2, texts, ["aot_eager_decomp_partition"] * 2)[0]
    assert (compiled["graphs"], compiled["breaks"]) == (1, 0)
    assert compiled["comm"] == eager["comm"]
    assert any(key[2] == "tp:amax" for key in compiled["comm"])
    assert_parity(eager, compiled, "compiled tp2 sp fp8")
