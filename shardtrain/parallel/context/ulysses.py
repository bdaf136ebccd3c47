"""Ulysses attention: an all-to-all trades the sequence split for a head split, attention
runs on the full sequence for H/N heads, and a second all-to-all trades back (Jacobs et al.
2023, "DeepSpeed Ulysses").

Forward, per attention call: one all_to_all of q, k, v packed together ([N, B, H/N + 2G'/N,
s, D]: chunk j carries heads j*H/N.. of q and j*G'/N.. of k and v), causal SDPA on the full
sequence (a fused kernel: on CPU SDPA dispatches to the flash kernel that ring attention's
pairs run, grouped-query included; tests/test_cp_kernels.py), one all_to_all of the output
back ([N, B, H/N, s, D]). Backward: the same two,
swapped: one all_to_all of dout, one of dq, dk, dv packed. All in the input dtype.
Bytes each rank sends (the ledger's all_to_all records; N = cp, s = S/N, e = dtype bytes):
  forward:  (N-1)/N * B*s*D*(H + 2G') * e  +  (N-1)/N * B*s*D*H * e
  backward: (N-1)/N * B*s*D*H * e          +  (N-1)/N * B*s*D*(H + 2G') * e
G' = G when N divides G; otherwise (N dividing H) the kv heads are repeated up to H before
the all_to_all (G' = H: each rank then gets the kv head of each of its query heads; their
gradients sum back through the repeat). N = 1: no message.

The gathered sequence arrives rank after rank in the split's local orders; under the
zig-zag split it is put in natural order before causal SDPA and back after. Packed
documents (data.document_mask): the whole rows are there after the gather, so each
document runs alone, one causal kernel call per document (model/attention.py), no mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardtrain.comm import Communicator
from shardtrain.model.attention import sdpa_core
from shardtrain.model.positions import Documents
from shardtrain.parallel.context.inputs import check_documents, check_group, check_qkv
from shardtrain.parallel.context.split import SequenceSplit
from shardtrain.parallel.context.timer import NoTimer

TAG_A2A = "cp.a2a"


def _to_heads(comm: Communicator, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sequence split -> head split, one all_to_all for all parts: each [B, h, s, D]
    (h divisible by N) -> [B, h/N, N*s, D], sequence rank after rank."""
    n = comm.size
    b, _, s, d = parts[0].shape
    widths = [p.shape[1] // n for p in parts]
    # [N, B, sum(widths), s, D]: chunk j (for rank j) holds head group j of every part.
    send = torch.cat([p.reshape(b, n, w, s, d) for p, w in zip(parts, widths)], dim=2)
    send = send.movedim(1, 0).contiguous()
    got = torch.empty_like(send)  # chunk i: rank i's tokens of our head group
    comm.all_to_all(got, send, tag=TAG_A2A)
    got = got.permute(1, 2, 0, 3, 4).reshape(b, sum(widths), n * s, d)  # [B, h', N*s, D]
    return list(got.split(widths, dim=1))


def _to_sequence(comm: Communicator, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Head split -> sequence split, one all_to_all: each [B, h/N, N*s, D] -> [B, h, s, D]."""
    n = comm.size
    b, _, ns, d = parts[0].shape
    s = ns // n
    widths = [p.shape[1] for p in parts]
    send = torch.cat(parts, dim=1).reshape(b, sum(widths), n, s, d)
    send = send.permute(2, 0, 1, 3, 4).contiguous()  # [N, B, h', s, D]: chunk j -> rank j
    got = torch.empty_like(send)  # chunk i: rank i's head group of our tokens
    comm.all_to_all(got, send, tag=TAG_A2A)
    got = got.movedim(0, 1)  # [B, N, h', s, D]
    return [t.reshape(b, n * w, s, d) for t, w in zip(got.split(widths, dim=2), widths)]


class _Ulysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Communicator, split: SequenceSplit, causal: bool,
                timer: Any, documents: Documents | None):
        qh, kh, vh = _to_heads(comm, [q, k, v])  # [B, H/N | G'/N, S, D]
        timer.start()
        order = split.order(q.device)  # [S]: the position of each gathered token
        natural = torch.argsort(order) if split.zigzag else None  # gathered index by position
        # The local graph is kept for backward (no recompute); none is built without grad.
        # Its saved tensors are held as they are (identity hooks, innermost wins): under
        # full activation checkpointing the block's hooks would otherwise turn them into
        # recompute handles, and this Function's backward would replay the whole block.
        with torch.set_grad_enabled(any(ctx.needs_input_grad[:3])), \
                torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            leaves = [t.detach().requires_grad_(torch.is_grad_enabled()) for t in (qh, kh, vh)]
            x = [t.index_select(2, natural) for t in leaves] if natural is not None else leaves
            # Causal (inside each document, if any): the kernel model/attention.py picks
            if causal:
                out = sdpa_core(*x, documents)
            else:
                out = F.scaled_dot_product_attention(*x, enable_gqa=x[0].shape[1] != x[1].shape[1])
            if natural is not None:
                out = out.index_select(2, order)  # back to rank order
        timer.stop()
        ctx.graph, ctx.comm, ctx.timer = (leaves, out), comm, timer
        (result,) = _to_sequence(comm, [out.detach()])  # [B, H, s, D]
        return result

    @staticmethod
    def backward(ctx, dout):
        leaves, out = ctx.graph
        (dout_h,) = _to_heads(ctx.comm, [dout])  # [B, H/N, S, D]
        ctx.timer.start()
        grads = torch.autograd.grad(out, leaves, dout_h)
        ctx.timer.stop()
        dq, dk, dv = _to_sequence(ctx.comm, list(grads))
        ctx.graph = None
        return dq, dk, dv, None, None, None, None, None


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      comm: Communicator, split: SequenceSplit, causal: bool = True,
                      timer=None, documents: Documents | None = None) -> torch.Tensor:
    """This rank's output [B, H, s, D] for its local q [B, H, s, D], k, v [B, G, s, D];
    with `documents` (the full rows' packed documents) attention stays inside each."""
    check_group(comm.size, split, "Ulysses attention")
    check_qkv(q, k, v, split.local_len, "Ulysses attention (train.seq_len / parallel.cp)")
    check_documents(documents, q.shape[0], split.seq_len, "Ulysses attention")
    n, h, g = comm.size, q.shape[1], k.shape[1]
    if h % n:
        raise ValueError(
            f"Ulysses attention splits heads over the cp ranks: {h} query heads (per tensor-"
            f"parallel rank: model.n_heads / parallel.tp) are not divisible by parallel.cp="
            f"{n}; pick model.n_heads, parallel.tp and parallel.cp so that they are, or use "
            f"ring attention")
    if g % n:  # repeat kv heads up to H so that each rank gets its query heads' kv heads
        k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    return _Ulysses.apply(q, k, v, comm, split, causal, timer or NoTimer(), documents)
