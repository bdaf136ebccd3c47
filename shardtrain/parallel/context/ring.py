"""Ring attention: K and V blocks travel around the cp ring while each rank attends with
its own queries (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the
causal imbalance across ranks: Brandon et al. 2023; the zig-zag split that removes it:
split.py).

At step i (0 <= i < N) rank r attends to the kv block of rank (r - i) mod N; the block of
step i + 1 is already in flight (isend to r + 1, irecv from r - 1, posted before the step's
compute and waited after it). Partial outputs merge by their log-sum-exp (blocks.py).
Every pair runs a fused attention kernel in the compute dtype (bf16 under autocast) that
never materialises its [c, c] scores (blocks.py); only q, k, v, out and lse are kept for
backward, where each pair's backward kernel recomputes its tiles from the final out and lse;
dq accumulates locally in fp32, and the fp32 dK/dV accumulator of a block follows the block
around the ring (each rank adds its part and passes it on; one last hop returns it to its
owner).

Bytes each rank sends per attention call (the planner reproduces these; N = cp, s = S/N
local tokens, kv = 2*B*G*s*D elements in the compute dtype, packed as one [2, B, G, s, D]
tensor per message; the same counts are received):
  forward:  (N-1) messages of kv              -> (N-1) * kv * dtype_bytes   (tag cp.kv)
  backward: (N-1) messages of kv              -> (N-1) * kv * dtype_bytes   (tag cp.kv)
            + N messages of the dK/dV sum     -> N * kv * 4 (fp32)          (tag cp.dkv)
N = 1 sends nothing (the same math, plain causal attention). The ledger records each
message as a send on this rank and a recv on its neighbour (group "cp").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.comm import Communicator
from shardtrain.parallel.context.blocks import attend, attend_backward, chunk_pairs, merge
from shardtrain.parallel.context.inputs import check_group, check_qkv
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.context.timer import NoTimer
from shardtrain.parallel.context.transport import CommTransport, LocalTransport

TAG_KV, TAG_DKV = "cp.kv", "cp.dkv"


@dataclass
class _Ring:
    transport: Any  # CommTransport | LocalTransport: the ranks this process plays
    split: SequenceSplit
    causal: bool
    timer: Any  # ComputeTimer | NoTimer


def _chunk(x: torch.Tensor, i: int, c: int, dim: int) -> torch.Tensor:
    return x.narrow(dim, i * c, c)


def _forward(ring: _Ring, qs, ks, vs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per played rank: out [B, H, s, D] (the inputs' dtype) and lse [B, H, s] (fp32)."""
    split, tr, timer = ring.split, ring.transport, ring.timer
    n, c = split.cp, split.chunk_len
    scale = qs[0].shape[-1] ** -0.5
    kv = [torch.stack((k, v)) for k, v in zip(ks, vs)]  # [2, B, G, s, D], compute dtype
    acc: list[list] = [[None] * len(split.chunks(r)) for r in tr.ranks]
    for step in range(n):
        pending = tr.shift(kv, TAG_KV) if step < n - 1 else None  # the next block in flight
        timer.start()
        for m, r in enumerate(tr.ranks):
            owner = (r - step) % n
            for qi, ki, kind in chunk_pairs(split.chunks(r), split.chunks(owner), ring.causal):
                k_blk, v_blk = _chunk(kv[m], ki, c, 3).unbind(0)  # [B, G, c, D]
                o, lse = attend(_chunk(qs[m], qi, c, 2), k_blk, v_blk, kind, scale)
                acc[m][qi] = merge(acc[m][qi], o, lse)  # fp32 [B, H, c, D], [B, H, c]
        timer.stop()
        if pending is not None:
            kv = pending.wait()
    timer.start()
    outs = [torch.cat([o for o, _ in a], dim=2).to(q.dtype) for a, q in zip(acc, qs)]
    lses = [torch.cat([lse for _, lse in a], dim=2) for a in acc]  # [B, H, s]
    timer.stop()
    return outs, lses


def _backward(ring: _Ring, qs, ks, vs, outs, lses, douts):
    """Per played rank: dq [B, H, s, D], dk, dv [B, G, s, D], fp32 sums of the pairs'
    gradients. Each pair's kernel gets its query chunk's final out and lse
    (blocks.attend_backward)."""
    split, tr, timer = ring.split, ring.transport, ring.timer
    n, c = split.cp, split.chunk_len
    scale = qs[0].shape[-1] ** -0.5
    timer.start()
    douts = [d.to(q.dtype) for d, q in zip(douts, qs)]
    dqs = [torch.zeros_like(q, dtype=torch.float32) for q in qs]  # [B, H, s, D]
    timer.stop()
    kv = [torch.stack((k, v)) for k, v in zip(ks, vs)]  # [2, B, G, s, D], compute dtype
    travelling = None  # the dK/dV accumulators in flight from the previous step
    for step in range(n):
        pending = tr.shift(kv, TAG_KV) if step < n - 1 else None
        timer.start()
        part = [b.new_zeros(b.shape, dtype=torch.float32) for b in kv]  # [2, B, G, s, D]
        for m, r in enumerate(tr.ranks):
            owner = (r - step) % n
            for qi, ki, kind in chunk_pairs(split.chunks(r), split.chunks(owner), ring.causal):
                k_blk, v_blk = _chunk(kv[m], ki, c, 3).unbind(0)  # [B, G, c, D]
                dq, dk, dv = attend_backward(
                    _chunk(qs[m], qi, c, 2), k_blk, v_blk, kind, scale,
                    _chunk(outs[m], qi, c, 2), _chunk(lses[m], qi, c, 2),
                    _chunk(douts[m], qi, c, 2))
                _chunk(dqs[m], qi, c, 2).add_(dq)
                _chunk(part[m][0], ki, c, 2).add_(dk)
                _chunk(part[m][1], ki, c, 2).add_(dv)
        timer.stop()
        if travelling is not None:  # what the ranks before us added for this same block
            part = [a + p for a, p in zip(travelling.wait(), part)]
        # Pass the sum on with the block (after the last step: the hop home to its owner).
        travelling = tr.shift(part, TAG_DKV) if n > 1 else None
        if pending is not None:
            kv = pending.wait()
    dkv = travelling.wait() if travelling is not None else part  # own block, all ranks' sum
    return dqs, [d[0] for d in dkv], [d[1] for d in dkv]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the kernels run in: autocast's where it is on (as SDPA would run), else the
    inputs' own (fp32 runs stay fp32)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _RingAttention(torch.autograd.Function):
    """Inputs: the ring, then q, k, v of every played rank (m each); outputs: m outs, in the
    compute dtype. Saved for backward: q, k, v (compute dtype), out and lse: O(s), never
    a chunk pair's [c, c] scores."""

    @staticmethod
    def forward(ctx, ring: _Ring, *tensors: torch.Tensor):
        m = len(ring.transport.ranks)
        dtype = _compute_dtype(tensors[0])
        ctx.in_dtypes = [t.dtype for t in tensors]
        tensors = [t.to(dtype) for t in tensors]
        qs, ks, vs = tensors[:m], tensors[m:2 * m], tensors[2 * m:]
        # Autocast off inside: the kernels take the compute dtype as given, and the merge
        # of partial outputs stays fp32 (under autocast its products would run in bf16).
        with torch.autocast(qs[0].device.type, enabled=False):
            outs, lses = _forward(ring, qs, ks, vs)
        ctx.ring = ring
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts: torch.Tensor):
        m = len(douts)
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * m:(i + 1) * m] for i in range(5))
        with torch.autocast(qs[0].device.type, enabled=False):
            grads = _backward(ctx.ring, qs, ks, vs, outs, lses, douts)
        grads = [g.to(dt) for g, dt in zip((x for gs in grads for x in gs), ctx.in_dtypes)]
        return (None, *grads)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   comm: Communicator, split: SequenceSplit, causal: bool = True,
                   timer=None) -> torch.Tensor:
    """This rank's attention output [B, H, s, D] for its local q [B, H, s, D] and k, v
    [B, G, s, D] (s = S/N, the tokens `split` gives comm.rank); `timer` (ComputeTimer)
    sums the compute time."""
    check_group(comm.size, split, "ring attention")
    check_qkv(q, k, v, split.local_len, "ring attention (train.seq_len / parallel.cp)")
    ring = _Ring(CommTransport(comm), split, causal, timer or NoTimer())
    return _RingAttention.apply(ring, q, k, v)[0]


def simulated_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             split: SequenceSplit, causal: bool = True) -> torch.Tensor:
    """Ring attention of all N ranks in one process: FULL-sequence q [B, H, S, D], k, v
    [B, G, S, D] in natural order -> the full output [B, H, S, D] in natural order. Each
    rank's slice, every step, every block and every hop is the distributed algorithm's
    (LocalTransport rotates instead of sending); differentiable."""
    split.check()
    check_qkv(q, k, v, split.seq_len, "simulated ring attention (train.seq_len)")
    ring = _Ring(LocalTransport(split.cp), split, causal, NoTimer())
    parts = [[split.take(t, r, dim=2) for r in range(split.cp)] for t in (q, k, v)]
    outs = _RingAttention.apply(ring, *parts[0], *parts[1], *parts[2])
    gathered = torch.cat(outs, dim=2)  # [B, H, S, D], ranks' tokens rank after rank
    natural = torch.argsort(split.order(q.device))  # gathered index of each position
    return gathered.index_select(2, natural)
