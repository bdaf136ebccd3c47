"""ZeRO++ primitives against the exact collectives (4 ranks, virtual nodes of 2): quantized
all-gather (qwZ) and quantized reduce-scatter over all-to-all (qgZ) agree within their
quantization error and move the bytes the ledger says; hpZ's backward all-gathers stay
inside nodes and return exactly the forward's weights; qgZ's hierarchical path within its
stated bound. Training with each option: tests/test_zeropp_training.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dist import run_distributed
from parity import make_mesh, tiny
from shardtrain.comm import build_mesh
from shardtrain.cost.units import BLOCK
from shardtrain.mesh import MeshShape
from shardtrain.parallel.zero.zeropp import (ZeroPlusPlusComm, hierarchical_reduce_scatter,
                                             inter_node_comm, node_comm, quantized_all_gather,
                                             quantized_reduce_scatter)
from shardtrain.train.trainer import Trainer

BLOCK = 64
N = 1000  # elements per shard: not a multiple of BLOCK (the last block is padded)


def _half_steps(x: torch.Tensor) -> torch.Tensor:
    """Per element, half the int8 step of its block (the rounding error bound)."""
    blocks = -(-x.numel() // BLOCK)
    padded = torch.cat([x, x.new_zeros(blocks * BLOCK - x.numel())])
    return (padded.abs().view(-1, BLOCK).amax(1) / 127 / 2).repeat_interleave(BLOCK)[:x.numel()]


def _primitives(rank: int, world_size: int) -> dict:
    # ring: our point-to-point algorithms count the bytes that cross nodes.
    mesh = build_mesh(MeshShape(dp=world_size), rank=rank, node_size=2, algorithm="ring")
    dp, ledger = mesh.comm("dp"), mesh.ledger
    out: dict = {}

    # qwZ: shards of very different scales, gathered exactly (bf16 and fp32) and quantized.
    torch.manual_seed(rank)
    shard = torch.randn(N) * (rank + 1)
    exact = torch.empty(world_size * N)
    dp.all_gather(exact, shard, tag="exact")
    bf16 = torch.empty(world_size * N, dtype=torch.bfloat16)
    dp.all_gather(bf16, shard.bfloat16(), tag="exact-bf16")
    got = torch.empty(world_size * N)
    quantized_all_gather(dp, got, shard, block=BLOCK)
    bound = torch.cat([_half_steps(s) for s in exact.view(world_size, N)])
    out["qw_within"] = bool(torch.all((got - exact).abs() <= bound * 1.001))
    out["qw_error"] = float((got - exact).abs().max())
    out["qw"] = got
    bytes_of = {r.tag: r.sent_bytes for r in ledger.records}
    out["qw_bytes"] = (bytes_of["param:int8"], bytes_of["exact-bf16"], bytes_of["exact"])

    # qgZ: each rank's full gradient [p * N]; its chunk of the average.
    grad = torch.randn(world_size * N) * torch.linspace(0.1, 3, world_size * N)
    exact_rs, got_rs = torch.empty(N), torch.empty(N)
    dp.reduce_scatter(exact_rs, grad, "avg", tag="exact-rs")
    quantized_reduce_scatter(dp, got_rs, grad, "avg", block=BLOCK)
    out["qg"] = (grad, exact_rs, got_rs)
    bytes_of = {r.tag: r.sent_bytes for r in ledger.records}
    out["qg_bytes"] = (bytes_of["grad:int8"], bytes_of["exact-rs"])

    # qgZ's hierarchical path over nodes of 2: the same gradient, its bytes by group.
    node, inter = node_comm(mesh), inter_node_comm(mesh)
    first = len(ledger.records)
    two_hop = torch.empty(N)
    hierarchical_reduce_scatter(node, inter, two_hop, grad, "avg", block=BLOCK)
    out["qg2"] = two_hop
    out["qg2_records"] = [(r.group, r.sent_bytes, r.sent_inter_node_bytes)
                          for r in ledger.records[first:]]
    out["inter_ranks"] = inter.ranks

    # hpZ: forward gather over dp, backward gather inside the node from the secondary shard.
    out["node_ranks"] = node.ranks
    zc = ZeroPlusPlusComm(dp, node=node, quantize_weights=True, block=BLOCK)
    first = len(ledger.records)
    # stands for a FlatUnit: its identity, and its key (a block's, whose backward reads it)
    unit = _Unit(key=(BLOCK, 0, 0))
    forward, backward = torch.empty(world_size * N), torch.empty(world_size * N)
    zc.gather_params(unit, forward, shard, phase="forward").wait()
    zc.gather_params(unit, backward, shard, phase="backward").wait()
    out["hpz_equal"] = torch.equal(forward, backward)
    out["hpz_forward_equals_qw"] = torch.equal(forward, got)
    out["hpz_records"] = [(r.op, r.group, r.tag, r.sent_bytes, r.sent_inter_node_bytes)
                          for r in ledger.records[first:]]
    out["hpz_secondary_bytes"] = zc.held_param_bytes
    return out


@dataclass(eq=False)  # hashed by identity, as a FlatUnit
class _Unit:
    key: tuple[int, int, int]


def test_zeropp_primitives_match_exact_collectives_and_ledger_bytes():
    world = 4
    per_rank = run_distributed(_primitives, world)
    p, blocks = world, -(-N // BLOCK)
    crossing = 0  # bytes the forward (dp-wide) gathers sent across nodes, all ranks
    for rank, r in enumerate(per_rank):
        # qwZ: within half an int8 step of every block, identical on every rank.
        assert r["qw_within"] and r["qw_error"] > 0, r["qw_error"]
        assert torch.equal(r["qw"], per_rank[0]["qw"])
        int8, bf16, fp32 = r["qw_bytes"]
        assert int8 == (p - 1) * (blocks * BLOCK + 4 * blocks)  # ring: (p-1)/p of p packed shards
        print(f"rank {rank} all-gather bytes: int8 {int8}, bf16 {bf16} ({int8 / bf16:.3f}x), "
              f"fp32 {fp32} ({int8 / fp32:.3f}x)")
        assert 0.5 <= int8 / bf16 <= 0.5 * (1 + 4 / BLOCK) * blocks * BLOCK / N + 1e-9
        # qgZ: sender i's chunk for this rank is off by at most half its block's step; the
        # average is off by at most the mean of those bounds (plus fp32 summation order).
        _, exact_rs, got_rs = r["qg"]
        sent = [q["qg"][0].view(p, N)[rank] for q in per_rank]
        bound = torch.stack([_half_steps(c) for c in sent]).mean(0)
        error = (got_rs - exact_rs).abs()
        assert error.max() > 0 and torch.all(error <= bound * 1.001 + 1e-6), error.max()
        _hierarchical_within_bound(rank, r, per_rank, exact_rs, bound)
        int8_rs, fp32_rs = r["qg_bytes"]
        assert int8_rs == (p - 1) * (blocks * BLOCK + 4 * blocks)  # pairwise all-to-all
        assert int8_rs / fp32_rs <= 0.25 * (1 + 4 / BLOCK) * blocks * BLOCK / N + 1e-9
        print(f"rank {rank} reduce-scatter bytes: int8 {int8_rs}, fp32 {fp32_rs} "
              f"({int8_rs / fp32_rs:.3f}x)")
        # hpZ: nodes of 2 consecutive ranks; the backward gather equals the forward one and
        # sends nothing across nodes; the forward ones do (on the ring, from 1 and 3).
        assert r["node_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["hpz_equal"] and r["hpz_forward_equals_qw"]
        forward = [x for x in r["hpz_records"] if x[2] == "param:int8"]
        backward = [x for x in r["hpz_records"] if x[2] == "param:hpz"]
        assert len(forward) == 1 and forward[0][1] == "dp"
        crossing += forward[0][4]
        assert len(backward) == 1 and backward[0][:2] == ("all_gather", "dp_node")
        assert backward[0][4] == 0 and backward[0][3] == world * N * 4 // 2  # (s-1)/s of S, s=2
        assert r["hpz_secondary_bytes"] == world * N * 4 // 2
    assert crossing > 0


def _hierarchical_within_bound(rank: int, r: dict, per_rank: list[dict],
                                exact_rs: torch.Tensor, one_hop_bound: torch.Tensor) -> None:
    """qgZ's two hops (nodes {0, 1}, {2, 3}; hop 2 between ranks at the same place). Bound:
    hop 1 rounds each sender's value once, as the one-hop form does (`one_hop_bound`, the
    mean of half-steps); hop 2 rounds node k's partial sum P_k, within half a step of its
    block, whose absmax is at most that of the exact partial plus hop 1's errors in it:
    |error| <= one_hop_bound + (1/p) sum_k (absmax_k(exact P_k) + sum_{i in k} d_i) / 254."""
    p, got = len(per_rank), r["qg2"]
    sent = [q["qg"][0].view(p, N)[rank] for q in per_rank]  # [N] from each sender
    second = torch.zeros(N)
    for k in (0, 1):  # |P_k| + its hop-1 error: its absmax per block bounds the rounded P_k's
        partial = (sent[2 * k] + sent[2 * k + 1]).abs() \
            + _half_steps(sent[2 * k]) + _half_steps(sent[2 * k + 1])
        second += _half_steps(partial) * 2  # absmax per block / 127
    bound = one_hop_bound + second / 2 / p
    error, one_hop = (got - exact_rs).abs(), (r["qg"][2] - exact_rs).abs()
    print(f"rank {rank} qgZ error vs fp32: one hop {one_hop.max():.2e}, two hops "
          f"{error.max():.2e} (bound {bound.max():.2e}); vs one hop "
          f"{(got - r['qg'][2]).abs().max():.2e}")
    assert error.max() > 0 and torch.all(error <= bound * 1.001 + 1e-6), error.max()
    assert not torch.equal(got, r["qg"][2])  # a second rounding: not the one-hop numbers
    # Bytes: hop 1 inside the node, the N chunks bound for each place (s - 1 = 1 row of
    # N = 2 packed chunks); hop 2 across nodes, N - 1 = 1 packed chunk. In all the one-hop
    # form's (p - 1) packed chunks, but 1 of them crosses nodes instead of p - s = 2.
    packed = -(-N // BLOCK) * (BLOCK + 4)
    assert r["inter_ranks"] == [rank % 2, rank % 2 + 2]
    assert r["qg2_records"] == [("dp_node", 2 * packed, 0), ("dp_inter", packed, packed)]


def test_qwz_keeps_exact_master_weights_at_stage_1(tmp_path):
    """Stages 1-2 gather the updated parameters over this rank's own shard: with qwZ the
    dequantized values land there, so the fp32 master must live apart (one process: the
    same path, the collectives degenerate to copies)."""
    cfg = tiny(tmp_path, "qwz1", "--train.steps", "2", "--parallel.zero", "1",
               "--parallel.zero_quantized_weights", "true")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    trainer.train_step()
    zero = trainer.parallel.update
    for k, unit in enumerate(zero.units):
        master = zero.optimizer.master(k)
        assert master.data_ptr() != unit.shard.data_ptr()
        assert not torch.equal(master, unit.shard)  # the shard holds int8-rounded values
        torch.testing.assert_close(unit.shard, master, rtol=0, atol=_half_steps(master).max())
