"""Every worked example of the seed notes that no other test asserts (the audit's "WE" rows
with status P or M, ../shared/seed-audit.md), each through the project's own functions.
Where a seed's figure is wrong, the test asserts the project's value and says why.

Seconds in all: pure arithmetic (cost/, plan/), torch for the bf16 bytes, and the
collectives and tensor-parallel layers run by threads of this process over an in-memory
transport (tests/thread_teams.py): the project's ring algorithm and layers, no process spawned.
Seed 004's size-to-strategy table is checked against the planner's search at the end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardtrain.comm.algorithms import ring
from shardtrain.comm.p2p import Team, even_bounds
from shardtrain.config import OptimConfig, load
from shardtrain.cost import hardware
from shardtrain.cost.counts import param_counts
from shardtrain.parallel.pipeline.partition import layer_ranges
from shardtrain.parallel.tensor.layers import ColumnParallelLinear, Region, RowParallelLinear
from shardtrain.parallel.tensor.sharding import Placement
from shardtrain.plan.evaluate import evaluate
from shardtrain.plan.layout import Layout
from shardtrain.plan.closed_form import activation_bytes_per_layer
from shardtrain.plan.memory import model_states
from shardtrain.plan.traffic import data_parallel_ops, step_ops
from shardtrain.train.optim import build_optimizer
from thread_teams import Teams, TpComm

GB, TB = 1e9, 1e12
TINY = load("tiny").model
GPT3 = load("gpt3-175b").model
LLAMA8B = load("llama3-8b").model


# --- parameters and model states ---------------------------------------------------------

def test_embedding_50000_by_12000_is_600m_seed_000():
    """S0: "a vocabulary of 50,000 and embedding dimension of 12,000 yields hundreds of
    millions of parameters": V x d = 600,000,000 (a tied table: one matrix)."""
    cfg = dataclasses.replace(TINY, vocab_size=50_000, dim=12_000, tie_embeddings=True)
    assert param_counts(cfg).embedding == 600_000_000


def test_175b_needs_35_gpus_of_80_gb_seed_000():
    """S0: 2800 GB / 80 GB ~ 35 GPUs minimum: 175B at 16 bytes per parameter, sharded
    by ZeRO-3, is exactly 80 GB on 35 ranks and more on 34."""
    assert model_states(175e9).total == pytest.approx(2800 * GB)
    assert model_states(175e9, nd=35, zero=3).total == pytest.approx(80 * GB)
    assert model_states(175e9, nd=34, zero=3).total > 80 * GB


def test_7b_at_16_bytes_is_112_gb_seed_003():
    """S3: 7B in bf16 is 14 GB of weights; 16 bytes per parameter make 112 GB > 80 GB."""
    states = model_states(7e9)
    assert states.params == pytest.approx(14 * GB)
    assert states.total == pytest.approx(112 * GB) and states.total > 80 * GB


def test_7b_model_states_seed_004_leave_out_the_master_copy():
    """S4 itemises a 7B model as 14 (params) + 14 (grads) + 56 (optimizer) = 84 GB. Its 56
    GB is Adam's two fp32 moments (8 bytes per parameter) without the fp32 master copy that
    bf16 mixed precision keeps (4 more bytes: Rajbhandari et al. 2020, K = 12; S3's own
    16-byte accounting). The project counts the master: 112 GB; the seed's three terms are
    the project's less its master."""
    states = model_states(7e9)
    assert states.params + states.grads + states.optimizer == pytest.approx(84 * GB)
    assert states.master == pytest.approx(28 * GB) and states.total == pytest.approx(112 * GB)


def test_175b_and_100b_model_states_seed_004():
    """S4: "175B ... model states alone require 2.1 TB" and "a 100B model requires 1.2 TB
    on every GPU" under DP. Both are K x Psi (master + Adam moments, 12 bytes per parameter)
    without the 16-bit parameters and gradients; with them (the seed's own ZeRO formulas,
    (2 + 2 + K) Psi) the project gives 2.8 TB and 1.6 TB."""
    for psi, seed, project in ((175e9, 2.1 * TB, 2.8 * TB), (100e9, 1.2 * TB, 1.6 * TB)):
        states = model_states(psi)
        assert states.master + states.optimizer == pytest.approx(seed)
        assert states.total == pytest.approx(project)


def test_12b_exercise_dp_and_zero3_over_8_seed_003():
    """S3's exercise: 12B at 16 bytes per parameter: 192 GB per worker replicated, 24 GB
    under ZeRO-3 over eight workers."""
    assert model_states(12e9).total == pytest.approx(192 * GB)
    assert model_states(12e9, nd=8, zero=3).total == pytest.approx(24 * GB)


def test_1t_on_1024_gpus_under_zero3_seed_004():
    """S4: Psi = 1e12 "requires 16 TB total; with 1024 GPUs, each needs only 16 GB":
    16 TB / 1024 = 15.625 GB (the seed rounds it)."""
    assert model_states(1e12).total == pytest.approx(16 * TB)
    assert model_states(1e12, nd=1024, zero=3).total == pytest.approx(15.625 * GB)


def test_zero1_memory_formula_seed_000():
    """S0 writes ZeRO-1 as 2 Psi + 14 Psi / N_d, which is ZeRO-2's line (gradients sharded
    too). ZeRO-1 shards only K = 12: 4 Psi + 12 Psi / N_d (Rajbhandari et al. 2020, sec. 5,
    and S2 and S4)."""
    psi, nd = 7.5e9, 64
    assert model_states(psi, nd=nd, zero=1).total == pytest.approx(4 * psi + 12 * psi / nd)
    assert model_states(psi, nd=nd, zero=2).total == pytest.approx(2 * psi + 14 * psi / nd)


def test_gpt3_moves_350_gb_of_16_bit_gradients_per_iteration_seed_001():
    """S1: GPT-3's 16-bit gradient is 350 GB, reduced every iteration: the planner's
    gradient all-reduce carries 2 x 175e9 bytes a step (any bucketing)."""
    ops = data_parallel_ops(params=175e9, size=64, zero=0, precision="bf16")
    assert sum(o.message_bytes * o.calls for o in ops) == pytest.approx(350 * GB)


# --- activations and pipelines -----------------------------------------------------------

def test_activations_of_the_gpt3_batch_seed_000():
    """S0/S1: b = 3.2M tokens / 2048, s = 2048, h = 12288, a = 96, L = 96 at 16 bits,
    5 a s^2 b + 34 s b h per layer (Korthikanti et al. 2022): the seed says "hundreds of
    gigabytes or even a terabyte". That holds for one sequence (2.87 GB per layer, 275 GB
    over 96 layers); the 3.2M-token batch the seed names keeps 4.48 TB per layer and 430 TB
    in all, 1,562.5 times more: the seed understates its own example."""
    s, h, a, L = 2048, GPT3.dim, GPT3.n_heads, GPT3.n_layers
    one = activation_bytes_per_layer(s=s, b=1, h=h, a=a)
    assert one == s * h * (34 + 5 * a * s / h) and one == pytest.approx(2.869e9, rel=1e-3)
    assert L * one == pytest.approx(275.4e9, rel=1e-3)
    batch = activation_bytes_per_layer(s=s, b=3.2e6 / s, h=h, a=a)
    assert batch == pytest.approx(4.48 * TB, rel=1e-3)
    assert L * batch == pytest.approx(430 * TB, rel=1e-3)


def test_24_layers_on_4_stages_seed_003():
    """S3: 24 layers on four devices -> 0-5, 6-11, 12-17, 18-23 (equal layer costs; the
    runtime also weighs the embedding and head, which may move a cut)."""
    assert [stage[0] for stage in layer_ranges(24, 4)] == [range(0, 6), range(6, 12),
                                                           range(12, 18), range(18, 24)]


def test_boundary_activation_is_32_mib_seed_003():
    """S3: b = 2, s = 2048, h = 4096 in bf16: 33,554,432 bytes = 32 MiB per boundary, sent
    in forward and again in backward (Llama-3 8B has h = 4096)."""
    ops = step_ops(LLAMA8B, Layout(pp=2, micro_batch=2, microbatches=4), hardware.get("h100"),
                   seq_len=2048)
    (pp,) = [o for o in ops if o.group == "pp"]
    assert pp.message_bytes == 33_554_432 == 32 * 2 ** 20
    assert pp.calls == 2 * 4  # per micro-batch: forward and backward


# --- collectives, data parallelism, tensor parallelism (threads, no processes) -----------

def _all_reduce(team: Team, x: torch.Tensor) -> torch.Tensor:
    ring.all_reduce(team, x, "sum")
    return x


def test_gradient_average_and_sgd_step_seed_003():
    """S3: four workers' local gradients 0.20, 0.10, -0.05, 0.15: the all-reduce sum is
    0.40, the average 0.10, and SGD at lr 0.001 moves the parameter by -0.0001. The sum
    runs through the project's ring all-reduce, the step through its optimizer builder."""
    grads = [torch.tensor([g], dtype=torch.float64) for g in (0.20, 0.10, -0.05, 0.15)]
    summed = Teams(4).run(_all_reduce, grads)
    assert all(s.item() == pytest.approx(0.40) for s in summed)
    average = summed[0] / 4
    assert average.item() == pytest.approx(0.10)
    model = torch.nn.Linear(1, 1, bias=False).double()
    before = model.weight.detach().clone()
    plain = OptimConfig(name="sgd", momentum=0.0, weight_decay=0.0)  # the seed's plain SGD
    opt = build_optimizer(model, plain, lr=0.001)
    model.weight.grad = average.view(1, 1)
    opt.step()
    assert (model.weight - before).item() == pytest.approx(-0.0001)


def test_all_gather_concatenates_all_reduce_adds_seed_003():
    """S3: worker 0 has [1, 2] and worker 1 [3, 4]: all-gather gives both [1, 2, 3, 4];
    all-reduce sum gives both [4, 6]."""
    shards = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]

    def gather(team: Team, mine: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(4)
        bounds = even_bounds(4, team.size)
        x[bounds[team.index]:bounds[team.index + 1]] = mine
        ring.all_gather(team, x, bounds)
        return x

    for out in Teams(2).run(gather, shards):
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0]
    for out in Teams(2).run(_all_reduce, [s.clone() for s in shards]):
        assert out.tolist() == [4.0, 6.0]


def test_bf16_byte_layout_seed_003():
    """S3: a row-sharded [1, 8] bf16 activation, four elements per worker, 16 bytes in all
    (the split partitions, it does not compress): 1.0..4.0 are 80 3f 00 40 40 40 80 40,
    5.0..8.0 are a0 40 c0 40 e0 40 00 41 (little-endian bfloat16)."""
    x = torch.arange(1.0, 9.0, dtype=torch.bfloat16).view(1, 8)
    place = [Placement(dim=1, size=8, parts=2, index=i) for i in range(2)]
    shards = [p.shard(x) for p in place]
    hexes = [s.contiguous().view(torch.uint8).numpy().tobytes().hex(" ") for s in shards]
    assert hexes == ["80 3f 00 40 40 40 80 40", "a0 40 c0 40 e0 40 00 41"]
    assert sum(s.numel() * s.element_size() for s in shards) == 16 == x.numel() * 2


def test_tensor_parallel_toy_shapes_seed_003():
    """S3's toy: X [1, 8] times the MLP expansion W [8, 16] on two workers. Column
    parallelism splits W into two [8, 8] column blocks: worker i computes Y_i = X W_i
    [1, 8] and Y = [Y_0 Y_1] [1, 16] is their concatenation (an all-gather). Row
    parallelism splits X into [1, 4] and W into [4, 16] along the hidden dimension: each
    worker's partial output is [1, 16], and their all-reduced sum is X W. Through the
    project's ColumnParallelLinear and RowParallelLinear (torch's [out, in] weights)."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 8, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    weight = w.t().contiguous()  # [16, 8]: nn.Linear's layout

    def column(team: Team, _: None) -> torch.Tensor:
        place = Placement(dim=0, size=16, parts=2, index=team.index)
        comm = TpComm(team)  # the layers reach it by a weak reference: held here
        layer = ColumnParallelLinear(place.shard(weight), None, Region(comm, sp=False))
        assert tuple(layer.weight.shape) == (8, 8)
        return layer(x).detach()

    blocks = Teams(2).run(column, [None, None])
    assert [tuple(b.shape) for b in blocks] == [(1, 8), (1, 8)]
    torch.testing.assert_close(torch.cat(blocks, dim=1), x @ w)

    def row(team: Team, _: None) -> tuple:
        place = Placement(dim=1, size=8, parts=2, index=team.index)
        comm = TpComm(team)
        layer = RowParallelLinear(place.shard(weight), None, comm, sp=False)
        mine = Placement(dim=1, size=8, parts=2, index=team.index).shard(x)
        partial = torch.nn.functional.linear(mine, layer.weight).detach()
        return tuple(layer.weight.shape), tuple(mine.shape), partial, layer(mine).detach()

    for shape, x_shape, partial, y in Teams(2).run(row, [None, None]):
        assert shape == (16, 4) and x_shape == (1, 4) and tuple(partial.shape) == (1, 16)
        torch.testing.assert_close(y, x @ w)


# --- seed 004's size-to-strategy table against the planner (docs/planner.md) -------------

_SMALL = ("--model.dim", "1024", "--model.n_layers", "24", "--model.n_heads", "16",
          "--model.ffn_dim", "4096")  # GPT-2 medium's shape: 0.36B parameters
_MOE = ("--model.n_experts", "24", "--model.moe_top_k", "2")  # Llama-3 8B, 24 experts: 138B
# row, (preset, overrides, H100s, seq), the search's pick (2^22-token batches), the seed's
# strategy at its best settings (the fastest that fits, or the least memory when none fits)
GUIDE = [
    ("<1B on 1-8: FSDP + ZeRO-2", ("gpt3-175b", _SMALL, 8, 2048),
     Layout(dp=8, zero=3, microbatches=256), Layout(dp=8, zero=2, microbatches=256)),
    ("1-10B on 8-64: FSDP + ZeRO-3", ("llama3-8b", (), 32, 8192),
     Layout(dp=4, cp=8, zero=3, micro_batch=4, microbatches=32),
     Layout(dp=32, zero=3, microbatches=16, recompute="selective")),
    ("10-70B on 64-512: tp=8, pp=4, dp", ("llama3-70b", (), 256, 8192),
     Layout(dp=2, pp=16, cp=8, zero=1, microbatches=256, schedule="zb-h1"),
     Layout(dp=8, tp=8, pp=4, microbatches=64, sp=True, recompute="selective",
            schedule="interleaved", v=4)),
    ("70-175B on 512-2048: 3D + ZeRO-3", ("gpt3-175b", (), 1024, 2048),
     Layout(dp=32, tp=2, pp=16, zero=1, microbatches=64, sp=True, recompute="selective",
            schedule="zbv", v=2),
     Layout(dp=16, tp=8, pp=8, zero=3, microbatches=128, sp=True, schedule="interleaved",
            v=4)),
    ("175B+ on 2000+: 3D + ZeRO-3 + ZeRO++", ("llama3-405b", (), 2048, 8192),
     Layout(dp=256, tp=2, cp=4, zero=3, micro_batch=2, microbatches=1, sp=True,
            recompute="full"),
     Layout(dp=128, tp=8, pp=2, zero=3, microbatches=4, sp=True, recompute="full")),
    ("MoE 100B+ on 512+: 3D + EP", ("llama3-8b", _MOE, 512, 8192),
     Layout(dp=2, pp=32, cp=8, ep=4, zero=1, microbatches=256, schedule="zb-h1"),
     Layout(dp=32, tp=2, pp=8, ep=4, zero=1, microbatches=16, sp=True,
            recompute="selective", schedule="interleaved", v=4)),
]
H100 = hardware.get("h100")


def _plan(case, layout):
    preset, extra, _, seq = case
    return evaluate(load(preset, list(extra)).model, layout, H100,
                    global_batch=2 ** 22 // seq, seq_len=seq)


@pytest.mark.parametrize("row, case, pick, seed", GUIDE, ids=[g[0] for g in GUIDE])
def test_guideline_table_seed_004(row, case, pick, seed):
    """Each row's disagreement, as docs/planner.md explains it: the search's pick is at
    least as fast as the seed's strategy; the 405B row's 3D + ZeRO-3 does not fit."""
    ours, theirs = _plan(case, pick), _plan(case, seed)
    assert ours.fits and ours.layout.gpus == theirs.layout.gpus == case[2]
    if row.startswith("175B+"):  # tp=8 leaves pp <= 2 (pp | 126 layers, dp | 512)
        assert not theirs.fits
    else:
        assert theirs.fits and ours.time.step_s <= theirs.time.step_s


@pytest.mark.slow
@pytest.mark.parametrize("row, case, pick, seed", GUIDE, ids=[g[0] for g in GUIDE])
def test_search_proposes_the_recorded_pick(row, case, pick, seed):
    from shardtrain.plan.search import search

    preset, extra, gpus, seq = case
    best = search(load(preset, list(extra)).model, H100, gpus=gpus, global_batch=2 ** 22 // seq,
                  seq_len=seq, top=1).ranked[0].layout
    assert best == dataclasses.replace(pick, precision=best.precision)
