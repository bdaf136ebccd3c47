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
from shardtrain.model.positions import Documents
from shardtrain.parallel.context.blocks import (attend, attend_backward, chunk_pairs, merge_into,
                                               pair_blocks)
from shardtrain.parallel.context.inputs import check_documents, check_group, check_qkv
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
    documents: Documents | None = None  # packed documents: spans over the full rows


def _forward(ring: _Ring, qs, ks, vs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per played rank: out [B, H, s, D] (the inputs' dtype) and lse [B, H, s] (fp32)."""
    split, tr, timer = ring.split, ring.transport, ring.timer
    n, c = split.cp, split.chunk_len
    scale = qs[0].shape[-1] ** -0.5
    kv = [torch.stack((k, v)) for k, v in zip(ks, vs)]  # [2, B, G, s, D], compute dtype
    # The running fp32 out [B, H, s, D] and lse [B, H, s] of each played rank's queries,
    # from (0, -inf): a query row no block reaches keeps them (none does: each sees itself).
    acc = [(torch.zeros_like(q, dtype=torch.float32),
            q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)) for q in qs]
    for step in range(n):
        pending = tr.shift(kv, TAG_KV) if step < n - 1 else None  # the next block in flight
        timer.start()
        for m, r in enumerate(tr.ranks):
            for qi, ki, blk in _blocks(ring, r, (r - step) % n):
                k_blk, v_blk = _cut(kv[m], ki, blk.k0, blk.m, blk.rows, c, 3).unbind(0)
                o, lse = attend(_cut(qs[m], qi, blk.q0, blk.n, blk.rows, c), k_blk, v_blk,
                                blk.kind, scale)
                merge_into(_cut(acc[m][0], qi, blk.q0, blk.n, blk.rows, c),
                           _cut(acc[m][1], qi, blk.q0, blk.n, blk.rows, c), o, lse)
        timer.stop()
        if pending is not None:
            kv = pending.wait()
    timer.start()
    outs = [o.to(q.dtype) for (o, _), q in zip(acc, qs)]
    timer.stop()
    return outs, [lse for _, lse in acc]


def _blocks(ring: _Ring, r: int, owner: int):
    """(local query chunk, local key chunk, Block) of every kernel call rank r makes on
    the kv block of `owner` (pairs masked out entirely, causally or by documents, have
    none: skipped, not computed)."""
    split = ring.split
    mine, theirs = split.chunks(r), split.chunks(owner)
    for qi, ki, kind in chunk_pairs(mine, theirs, ring.causal):
        for blk in pair_blocks(mine[qi], theirs[ki], split.chunk_len, kind, ring.documents):
            yield qi, ki, blk


def _cut(x: torch.Tensor, chunk: int, start: int, length: int, rows: slice, c: int,
         dim: int = 2) -> torch.Tensor:
    """Tokens [start, start + length) of local chunk `chunk` along `dim` (the sequence),
    batch rows `rows` along dim - 2 (the batch: [B, H, s, ...] or [2, B, G, s, D]): a view."""
    x = x.narrow(dim, chunk * c + start, length)
    return x[(slice(None),) * (dim - 2) + (rows,)]


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
            for qi, ki, blk in _blocks(ring, r, (r - step) % n):
                k_blk, v_blk = _cut(kv[m], ki, blk.k0, blk.m, blk.rows, c, 3).unbind(0)
                q_at = (qi, blk.q0, blk.n, blk.rows, c)
                dq, dk, dv = attend_backward(
                    _cut(qs[m], *q_at), k_blk, v_blk, blk.kind, scale, _cut(outs[m], *q_at),
                    _cut(lses[m], *q_at), _cut(douts[m], *q_at))
                _cut(dqs[m], *q_at).add_(dq)
                _cut(part[m][0], ki, blk.k0, blk.m, blk.rows, c).add_(dk)
                _cut(part[m][1], ki, blk.k0, blk.m, blk.rows, c).add_(dv)
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
                   timer=None, documents: Documents | None = None) -> torch.Tensor:
    """This rank's attention output [B, H, s, D] for its local q [B, H, s, D] and k, v
    [B, G, s, D] (s = S/N, the tokens `split` gives comm.rank); `timer` (ComputeTimer)
    sums the compute time; `documents` (the full rows' packed documents) keeps attention
    inside each."""
    check_group(comm.size, split, "ring attention")
    check_qkv(q, k, v, split.local_len, "ring attention (train.seq_len / parallel.cp)")
    check_documents(documents, q.shape[0], split.seq_len, "ring attention")
    ring = _Ring(CommTransport(comm), split, causal, timer or NoTimer(), documents)
    return _RingAttention.apply(ring, q, k, v)[0]


def simulated_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             split: SequenceSplit, causal: bool = True,
                             documents: Documents | None = None) -> torch.Tensor:
    """Ring attention of all N ranks in one process: FULL-sequence q [B, H, S, D], k, v
    [B, G, S, D] in natural order -> the full output [B, H, S, D] in natural order. Each
    rank's slice, every step, every block and every hop is the distributed algorithm's
    (LocalTransport rotates instead of sending); differentiable."""
    split.check()
    check_qkv(q, k, v, split.seq_len, "simulated ring attention (train.seq_len)")
    check_documents(documents, q.shape[0], split.seq_len, "simulated ring attention")
    ring = _Ring(LocalTransport(split.cp), split, causal, NoTimer(), documents)
    parts = [[split.take(t, r, dim=2) for r in range(split.cp)] for t in (q, k, v)]
    outs = _RingAttention.apply(ring, *parts[0], *parts[1], *parts[2])
    gathered = torch.cat(outs, dim=2)  # [B, H, S, D], ranks' tokens rank after rank
    natural = torch.argsort(split.order(q.device))  # gathered index of each position
    return gathered.index_select(2, natural)
