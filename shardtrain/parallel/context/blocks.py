"""The per-block math of ring attention: which (query chunk, key chunk) pairs a ring step
computes, one pair's fused attention kernel forward (output and log-sum-exp) and backward,
and the fp32 log-sum-exp merge of partial outputs (Dao et al. 2022, FlashAttention; Dao
2023, FlashAttention-2; the blockwise form of Liu et al. 2023, Ring Attention).

A pair never materialises its [c, c] scores: the kernel tiles them internally and returns
the output and the lse of its rows. Its backward takes the query chunk's FINAL output and
lse (over all key chunks), so the probabilities it recomputes, exp(S - lse), are the pair's
slice of the full softmax and delta = rowsum(dO * O) is the full row's: the dq, dk, dv of
every pair add up to the gradients of the whole attention.

The kernels run in the inputs' dtype (the compute dtype: bf16 under autocast) and accumulate
in fp32 inside; the lse comes back fp32. Grouped-query attention: q [B, H, c, D] with k, v
[B, G, c, D] (head h uses kv head h // (H/G), as SDPA's enable_gqa). The CPU flash kernel
and CUDA's flash kernel take G < H as they are; CUDA's memory-efficient kernel (the fp32
path on CUDA, where flash needs 16-bit inputs) does not, so kv heads are repeated for that
pair ([B, H, c, D] copies, freed after the pair) and their gradients summed back.
Shape legend: B batch, H query heads, G kv heads, c chunk length, D head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardtrain.model.positions import Documents

FULL, DIAG = "full", "diag"
_aten = torch.ops.aten


def chunk_pairs(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...],
                causal: bool) -> list[tuple[int, int, str]]:
    """(local query chunk index, local key chunk index, FULL | DIAG) for every pair a step
    computes. Chunks are ascending runs of positions, so under causal masking a key chunk
    before the query chunk is seen in full, the same chunk needs the lower triangle, and a
    later chunk is masked out entirely: it is skipped, not computed and masked. That skip
    is where the load balance comes from: with the contiguous split rank r's queries find
    r + 1 of the N key blocks unskipped, with the zig-zag split (chunks r and 2N-1-r) every
    rank computes two chunk pairs' worth in every step (two full pairs, or on its own block
    one full and two diagonal ones)."""
    out = []
    for qi, a in enumerate(q_chunks):
        for ki, b in enumerate(k_chunks):
            if not causal or b < a:
                out.append((qi, ki, FULL))
            elif b == a:
                out.append((qi, ki, DIAG))
    return out


class Block(NamedTuple):
    """One kernel call of a chunk pair: batch rows `rows`, query tokens [q0, q0 + n) of the
    query chunk and key tokens [k0, k0 + m) of the key chunk (chunk-local), FULL or DIAG."""
    rows: slice
    q0: int
    n: int
    k0: int
    m: int
    kind: str


def pair_blocks(a: int, b: int, c: int, kind: str,
                documents: Documents | None) -> list[Block]:
    """The kernel calls of the pair (query chunk a, key chunk b; `kind` from chunk_pairs)
    of chunk length c. Without documents: the whole pair, every row at once. With packed
    documents, per row, one call for each document present in both chunks -- its queries
    in chunk a over its keys in chunk b: FULL when b < a (all of them earlier), DIAG when
    a == b (the document's own causal triangle, square and aligned) -- so a pair attends
    only where documents overlap, and a pair no document spans is skipped, not computed."""
    if documents is None:
        return [Block(slice(None), 0, c, 0, c, kind)]
    out = []
    for row, spans in enumerate(documents.spans):
        for lo, hi in spans:
            q0, q1 = max(lo, a * c), min(hi, (a + 1) * c)  # the document's queries in a
            k0, k1 = max(lo, b * c), min(hi, (b + 1) * c)  # and its keys in b
            if q0 < q1 and k0 < k1:
                out.append(Block(slice(row, row + 1), q0 - a * c, q1 - q0, k0 - b * c,
                                 k1 - k0, kind))
    return out


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Fold a kernel call's (out [b, H, n, D], lse [b, H, n] fp32) into the running fp32
    (acc_out, acc_lse) views of its rows, in place: with lse' = log(exp(acc_lse) +
    exp(lse)), acc_out' = exp(acc_lse - lse') acc_out + exp(lse - lse') out. Rows start at
    (0, -inf): a call's lse is finite (every query sees at least itself), so the first
    call's weights are exactly 0 and 1."""
    new = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1)).addcmul_(
        out, torch.exp(lse - new).unsqueeze(-1))
    acc_lse.copy_(new)


def _kernel(x: torch.Tensor) -> str:
    """The one place a pair's kernel is chosen, by the tensor's device: "cpu" (CPU's flash
    kernel, any float dtype), on CUDA "flash" for fp16 / bf16 and "efficient" (the
    memory-efficient kernel) otherwise, fp32 included, which flash does not take."""
    if x.device.type == "cpu":
        return "cpu"
    if x.device.type == "cuda":
        return "flash" if x.dtype in (torch.float16, torch.bfloat16) else "efficient"
    raise ValueError(f"ring attention runs its chunk pairs on CPU or CUDA kernels; the "
                     f"tensors are on {x.device} (set train.device to cpu or cuda)")


def _repeat_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, G, c, D] -> [B, H, c, D] (head h uses kv head h // (H/G))."""
    return x if x.shape[1] == h else x.repeat_interleave(h // x.shape[1], dim=1)


def _fold_kv(dx: torch.Tensor, g: int) -> torch.Tensor:
    """The repeat's adjoint: [B, H, c, D] -> [B, G, c, D], summing each kv head's copies."""
    b, h, c, d = dx.shape
    return dx if h == g else dx.view(b, g, h // g, c, d).sum(2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair (or one document's share of it: pair_blocks): q [B, H, c, D], k, v
    [B, G, c', D] -> (out [B, H, c, D] in q's dtype, normalised over this block alone; lse
    [B, H, c] fp32). DIAG is the causal triangle of two chunks at the same positions
    (square, so the kernel's top-left causal mask)."""
    causal, kernel = kind == DIAG, _kernel(q)
    if kernel == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    elif kernel == "efficient":
        h = q.shape[1]
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, h), _repeat_kv(v, h), None, True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]  # the kernel pads its lse rows to a multiple of 32
    else:
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.float()


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                    scale: float, out: torch.Tensor, lse: torch.Tensor,
                    dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair's gradients from its query chunk's final out [B, H, c, D] (q's dtype), final
    lse [B, H, c] (fp32) and dout [B, H, c, D]: (dq [B, H, c, D], dk, dv [B, G, c, D]) in
    q's dtype, this pair's share of the full attention's gradients."""
    causal, kernel = kind == DIAG, _kernel(q)
    if kernel == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    c, g = q.shape[2], k.shape[1]
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: unread
    if kernel == "efficient":
        h, pad = q.shape[1], -c % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, h), _repeat_kv(v, h), None, out, lse_p.contiguous(),
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _fold_kv(dk, g), _fold_kv(dv, g)
    # Dense inputs: no cumulative sequence lengths (None: the kernel's dense path).
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, c, k.shape[2], 0.0, causal, seed, seed,
        scale=scale)


def merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out [B, H, c, D], lse [B, H, c]) into the running fp32 (out, lse)
    of a query chunk: with lse = log(sum_j exp(lse_j)), out = sum_j exp(lse_j - lse) out_j.
    The running out is updated in place: pass blocks' outs this merge may own (a kernel's
    fresh output), never a tensor kept elsewhere."""
    if acc is None:  # the first block's out (cast to fp32) becomes the running out
        return out.float(), lse
    acc_out, acc_lse = acc
    acc_lse = acc_lse.clone()
    merge_into(acc_out, acc_lse, out, lse)
    return acc_out, acc_lse
