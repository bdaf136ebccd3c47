"""Context-parallel attention (shardtrain/parallel/context): the sequence split, ring
attention simulated in one process and run on Gloo, Ulysses on Gloo, each against dense
`F.scaled_dot_product_attention` on the full sequence (outputs and q, k, v gradients), the
bytes per call in the ledger against the counts documented in ring.py and ulysses.py, and
the errors for bad input."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from dist import run_distributed

from shardtrain.config.errors import ConfigError
from shardtrain.parallel.context import (
    TAG_A2A,
    TAG_DKV,
    TAG_KV,
    ContextAttention,
    SequenceSplit,
    ring_attention,
    simulated_ring_attention,
    ulysses_attention,
)

# ------------------------------------------------------------------ the split


@pytest.mark.parametrize("seq_len,cp,zigzag,chunks,chunk_len", [
    (16, 4, True, [(0, 7), (1, 6), (2, 5), (3, 4)], 2),
    (16, 4, False, [(0,), (1,), (2,), (3,)], 4),
    (24, 2, True, [(0, 3), (1, 2)], 6),
    (40, 4, True, [(0, 7), (1, 6), (2, 5), (3, 4)], 5),
    (40, 4, False, [(0,), (1,), (2,), (3,)], 10),
    (7, 1, False, [(0,)], 7),
])
def test_split_chunks_positions_and_take(seq_len, cp, zigzag, chunks, chunk_len):
    split = SequenceSplit(seq_len, cp, zigzag)
    split.check()
    assert split.chunk_len == chunk_len
    assert [split.chunks(r) for r in range(cp)] == chunks
    x = torch.arange(3 * seq_len).view(3, seq_len) * 10  # [B, S]
    pos = [split.positions(r, "cpu") for r in range(cp)]
    for r in range(cp):
        want = [c * chunk_len + i for c in chunks[r] for i in range(chunk_len)]
        assert pos[r].tolist() == want and pos[r].dtype == torch.int64
        assert torch.equal(split.take(x, r), x[:, pos[r]])
    # Every token exactly once: the ranks' slices, re-sorted by position, are the input.
    allpos = torch.cat(pos)
    joined = torch.cat([split.take(x, r) for r in range(cp)], dim=1)
    assert torch.equal(joined[:, torch.argsort(allpos)], x)
    assert torch.equal(split.order("cpu"), allpos)


def test_split_take_other_dims_and_gradient():
    split = SequenceSplit(12, 2, True)
    x = torch.randn(2, 3, 12, 4, requires_grad=True)  # [B, H, S, D]
    part = split.take(x, 1, dim=2)
    assert torch.equal(part, x[:, :, [3, 4, 5, 6, 7, 8]])
    part.sum().backward()
    assert x.grad[:, :, 3:9].eq(1).all() and x.grad[:, :, :3].eq(0).all()


@pytest.mark.parametrize("seq_len,cp,zigzag", [(20, 3, False), (12, 4, True), (10, 4, True),
                                               (0, 2, False)])
def test_split_refuses_an_uneven_sequence(seq_len, cp, zigzag):
    with pytest.raises(ConfigError, match=r"train\.seq_len.*parallel\.cp"):
        SequenceSplit(seq_len, cp, zigzag).check()


def test_split_refuses_bad_cp_rank_and_length():
    with pytest.raises(ConfigError, match=r"parallel\.cp=0"):
        SequenceSplit(8, 0, False).check()
    with pytest.raises(ValueError, match="outside the cp group"):
        SequenceSplit(8, 2, False).chunks(2)
    with pytest.raises(ValueError, match=r"train\.seq_len=8"):
        SequenceSplit(8, 2, False).take(torch.zeros(1, 6), 0)


# ------------------------------------------------------------------ one-process ring


def _inputs(h: int, g: int, seq: int, seed: int = 0, b: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, seq, d, generator=gen) for n in (h, g, g))
    dout = torch.randn(b, h, seq, d, generator=gen)
    return q, k, v, dout


def _dense(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _out_and_grads(fn, q, k, v, dout, dtype):
    """fn's output and q, k, v gradients for inputs in `dtype`, all returned in fp32."""
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*x)
    grads = torch.autograd.grad(out, x, dout.to(dtype))
    return [out.float(), *(t.float() for t in grads)]


CASES = [(n, zigzag, causal, heads) for n in (1, 2, 4) for zigzag in (True, False)
         for causal in (True, False) for heads in ((4, 2), (4, 4))]


@pytest.mark.parametrize("n,zigzag,causal,heads", CASES)
def test_simulated_ring_matches_dense_fp32(n, zigzag, causal, heads):
    q, k, v, dout = _inputs(*heads, seq=24)
    split = SequenceSplit(24, n, zigzag)
    got = _out_and_grads(lambda *x: simulated_ring_attention(*x, split=split, causal=causal),
                         q, k, v, dout, torch.float32)
    want = _out_and_grads(lambda *x, c=causal: _dense(*x, c), q, k, v, dout, torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


# bf16: inputs are rounded to bf16 once and the fp32 dense reference takes the same rounded
# values, so what is compared is the attention arithmetic alone. The ring runs the bf16
# flash kernel per chunk pair (fp32 inside), rounds each pair's output and gradients to bf16
# and merges or sums them in fp32; delta = rowsum(dO * O) takes the bf16 output. The bound:
# 2^-6 of the tensor's largest magnitude (two bf16 ulps at the top of its range). bf16 dense
# SDPA, the yardstick, must meet it too (its worst here is about 2^-7.4; the ring's about
# 2^-7.1, with the pair math in fp32 before issue 30 about 2^-8.1).
BF16_BOUND = 2.0 ** -6


@pytest.mark.parametrize("n,zigzag,causal,heads", [c for c in CASES if c[0] > 1])
def test_simulated_ring_matches_dense_bf16(n, zigzag, causal, heads):
    q, k, v, dout = (t.bfloat16().float() for t in _inputs(*heads, seq=16, seed=1))
    split = SequenceSplit(16, n, zigzag)
    ring = _out_and_grads(lambda *x: simulated_ring_attention(*x, split=split, causal=causal),
                          q, k, v, dout, torch.bfloat16)
    sdpa = _out_and_grads(lambda *x: _dense(*x, causal), q, k, v, dout, torch.bfloat16)
    want = _out_and_grads(lambda *x, c=causal: _dense(*x, c), q, k, v, dout, torch.float32)
    for name, a, s, b in zip(("out", "dq", "dk", "dv"), ring, sdpa, want):
        top = b.abs().max()
        assert (s - b).abs().max() <= BF16_BOUND * top, f"{name}: the yardstick itself"
        assert (a - b).abs().max() <= BF16_BOUND * top, name


def test_simulated_ring_skips_masked_blocks_not_just_masks_them():
    """A causal ring must never read a key chunk after the query chunk: poison the last
    quarter of k and v with NaN; outputs of the first three quarters stay finite."""
    q, k, v, _ = _inputs(4, 2, seq=16)
    k[:, :, 12:], v[:, :, 12:] = float("nan"), float("nan")
    for split in (SequenceSplit(16, 2, True), SequenceSplit(16, 4, False)):  # chunk 3: 12..15
        out = simulated_ring_attention(q, k, v, split=split)
        assert torch.isfinite(out[:, :, :12]).all() and torch.isnan(out[:, :, 12:]).all()
        torch.testing.assert_close(out[:, :, :12], _dense(q[:, :, :12], k[:, :, :12],
                                                          v[:, :, :12], True))


def test_cp_of_one_runs_the_same_path_without_a_message():
    """World size 1 is not a special case: a one-rank communicator, no ledger record."""
    from shardtrain.comm import CommLedger, Communicator

    ledger = CommLedger()
    comm = Communicator(None, name="cp", ranks=[0], ledger=ledger)
    q, k, v, dout = _inputs(4, 2, seq=12)
    want = _out_and_grads(lambda *x: _dense(*x, True), q, k, v, dout, torch.float32)
    for mode in ("ring", "ulysses"):
        core = ContextAttention(comm, SequenceSplit(12, 1, True), mode)
        got = _out_and_grads(core, q, k, v, dout, torch.float32)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{mode} {name}")
        assert core.compute_s > 0
        core.reset()
        assert core.compute_s == 0
        with torch.no_grad():  # inference: same output, nothing kept for a backward
            torch.testing.assert_close(core(q, k, v), want[0], atol=1e-5, rtol=1e-5)
    assert ledger.records == []


# ------------------------------------------------------------------ bad input


def test_bad_inputs_are_refused_before_any_message():
    fake = types.SimpleNamespace(size=4, rank=0, device=torch.device("cpu"))
    split = SequenceSplit(16, 4, True)
    q, k, v = torch.zeros(1, 6, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"model\.n_heads.*parallel\.tp.*parallel\.cp=4"):
        ulysses_attention(q, k, v, comm=fake, split=split)
    with pytest.raises(ValueError, match=r"hold 8 tokens, expected 4"):
        ring_attention(torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8),
                       torch.zeros(1, 2, 8, 8), comm=fake, split=split)
    with pytest.raises(ValueError, match="not a multiple of 4 kv heads"):
        ring_attention(torch.zeros(1, 6, 4, 8), torch.zeros(1, 4, 4, 8),
                       torch.zeros(1, 4, 4, 8), comm=fake, split=split)
    with pytest.raises(ValueError, match="must agree"):
        ring_attention(q[:, :4], k, v[..., :4], comm=fake, split=split)
    with pytest.raises(ValueError, match=r"parallel\.cp=2"):
        ContextAttention(fake, SequenceSplit(16, 2, True), "ring")
    with pytest.raises(ValueError, match="'ring', 'ulysses'|ring, ulysses"):
        ContextAttention(fake, split, "stripes")
    with pytest.raises(ConfigError, match=r"train\.seq_len=18"):
        ContextAttention(fake, SequenceSplit(18, 4, True), "ulysses")
    with pytest.raises(ValueError, match=r"\[B, heads, S, D\]"):
        simulated_ring_attention(torch.zeros(4, 16, 8), torch.zeros(2, 16, 8),
                                 torch.zeros(2, 16, 8), split=split)


# ------------------------------------------------------------------ on Gloo


def _sent(records, op: str, tag: str) -> tuple[int, int, int]:
    """(calls, bytes sent, bytes received) of the records of one op and tag."""
    mine = [r for r in records if r.op == op and r.tag == tag and r.group == "cp"]
    sent = [r for r in mine if r.sent_bytes]
    return len(sent), sum(r.sent_bytes for r in mine), sum(r.recv_bytes for r in mine)


def _cp_worker(rank: int, world: int) -> dict:
    """Every mode x split x head layout at cp = world: this rank's errors against dense
    SDPA (output and q, k, v gradients of its own tokens) and its ledger bytes."""
    from shardtrain.comm import build_mesh
    from shardtrain.mesh import MeshShape

    mesh = build_mesh(MeshShape(cp=world), rank=rank, timeout_s=60)
    comm, ledger = mesh.comm("cp"), mesh.ledger
    out: dict = {}
    heads = [(4, 2), (4, 4), (8, 4)]
    cases = [(mode, zz, True, h, torch.float32) for mode in ("ring", "ulysses")
             for zz in (True, False) for h in heads]
    cases += [("ring", True, False, (4, 2), torch.float32),
              ("ulysses", True, False, (4, 2), torch.float32),
              ("ring", True, True, (4, 2), torch.bfloat16),
              ("ulysses", True, True, (4, 2), torch.bfloat16)]
    fns = {"ring": ring_attention, "ulysses": ulysses_attention}
    for mode, zigzag, causal, (h, g), dtype in cases:
        split = SequenceSplit(8 * world, world, zigzag)
        q, k, v, dout = (t.to(dtype).float() for t in _inputs(h, g, seq=8 * world, seed=h + g))
        want = _out_and_grads(lambda *x, c=causal: _dense(*x, c), q, k, v, dout, torch.float32)
        mark = len(ledger.records)
        x = [split.take(t, rank, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
        y = fns[mode](*x, comm=comm, split=split, causal=causal)
        fwd = ledger.records[mark:]
        mark = len(ledger.records)
        grads = torch.autograd.grad(y, x, split.take(dout, rank, dim=2).to(dtype))
        bwd = ledger.records[mark:]
        got = [y, *grads]
        err = max(((a.float() - split.take(b, rank, dim=2)).abs().max()
                   / (1 if dtype == torch.float32 else b.abs().max())).item()
                  for a, b in zip(got, want))
        out[(mode, zigzag, causal, h, g, str(dtype))] = {
            "err": err, "fwd": fwd, "bwd": bwd, "local": tuple(y.shape)}
    # The core the model calls: ring by default path, timer running, reset to zero.
    core = ContextAttention(comm, SequenceSplit(8 * world, world, True), "ring")
    q, k, v, dout = _inputs(4, 2, seq=8 * world)
    x = [SequenceSplit(8 * world, world, True).take(t, rank, dim=2).requires_grad_()
         for t in (q, k, v)]
    core(*x).sum().backward()
    out["compute_s"] = core.compute_s
    core.reset()
    out["compute_s_after_reset"] = core.compute_s
    return out


def _expected_bytes(mode, n, h, g, dtype, b=2, s=8, d=8):
    """The per-call counts documented at the top of ring.py and ulysses.py."""
    e = torch.empty((), dtype=dtype).element_size()
    if mode == "ring":
        kv = 2 * b * g * s * d
        return {"fwd": {(TAG_KV,): (n - 1, (n - 1) * kv * e)},
                "bwd": {(TAG_KV,): (n - 1, (n - 1) * kv * e), (TAG_DKV,): (n, n * kv * 4)}}
    g2 = g if g % n == 0 else h
    qkv, o = b * s * d * (h + 2 * g2) * e, b * s * d * h * e
    return {"fwd": {(TAG_A2A,): (2, (n - 1) * qkv // n + (n - 1) * o // n)},
            "bwd": {(TAG_A2A,): (2, (n - 1) * o // n + (n - 1) * qkv // n)}}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_on_gloo_match_dense_and_the_documented_bytes(world):
    results = run_distributed(_cp_worker, world)
    for rank, res in enumerate(results):
        assert res["compute_s"] > 0 and res["compute_s_after_reset"] == 0
        for (mode, zigzag, causal, h, g, dtype), r in ((k, v) for k, v in res.items()
                                                      if isinstance(k, tuple)):
            case = f"rank {rank} {mode} zigzag={zigzag} causal={causal} H={h} G={g} {dtype}"
            assert r["local"] == (2, h, 8, 8), case
            # fp32: absolute 1e-5 on O(1) values; bf16: relative to the largest magnitude,
            # the bound of the one-process bf16 test (the inputs are the same bf16 values).
            assert r["err"] <= (1e-5 if dtype == "torch.float32" else BF16_BOUND), case
            want = _expected_bytes(mode, world, h, g, getattr(torch, dtype[6:]))
            op = "send" if mode == "ring" else "all_to_all"
            for phase in ("fwd", "bwd"):
                tags = {rec.tag for rec in r[phase]}
                assert {rec.group for rec in r[phase]} == {"cp"}, case
                assert tags == {t for (t,) in want[phase]}, (case, phase, tags)
                for (tag,), (calls, sent) in want[phase].items():
                    assert _sent(r[phase], op, tag)[:2] == (calls, sent), (case, phase, tag)
                    if mode == "ring":  # every message sent is received by a neighbour
                        assert _sent(r[phase], "recv", tag)[2] == sent, (case, phase, tag)
