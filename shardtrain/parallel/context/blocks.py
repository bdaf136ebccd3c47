"""The per-block math of ring attention, in explicit fp32: which (query chunk, key chunk)
pairs a ring step computes, one pair's forward (output and log-sum-exp), the log-sum-exp
merge of partial outputs, and one pair's backward recomputed from the saved log-sum-exp
(Dao et al. 2022, FlashAttention; the blockwise form of Liu et al. 2023, Ring Attention).

Grouped-query attention is a grouped matmul: queries are viewed as [B, G, R, c, D] (R = H/G
query heads per kv head; head h uses kv head h // R, as in SDPA's enable_gqa), so kv heads
are never repeated. Shape legend: B batch, G kv heads, R query heads per kv head, c chunk
length, D head dim.
"""

from __future__ import annotations

import torch

FULL, DIAG = "full", "diag"


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


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """q [B, G, R, c, D], k [B, G, c, D] -> scaled scores [B, G, R, c, c]; the diagonal
    pair masks keys after the query (positions run in step within one chunk)."""
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if kind == DIAG:
        c = s.shape[-1]
        future = torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair, fp32: q [B, G, R, c, D], k, v [B, G, c, D] -> (out [B, G, R, c, D],
    lse [B, G, R, c]), out normalised over this block alone."""
    s = _scores(q, k, kind, scale)
    lse = torch.logsumexp(s, dim=-1)  # [B, G, R, c]; finite: each row keeps >= 1 key
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bgrqk,bgkd->bgrqd", p, v), lse


def merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into the running (out, lse) of a query chunk: with
    lse = log(sum_j exp(lse_j)), out = sum_j exp(lse_j - lse) out_j (fp32)."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)  # [B, G, R, c]
    w_acc = torch.exp(acc_lse - new).unsqueeze(-1)
    w_new = torch.exp(lse - new).unsqueeze(-1)
    return acc_out * w_acc + out * w_new, new


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str,
                    scale: float, lse: torch.Tensor, dout: torch.Tensor,
                    delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair's gradients, fp32, from the final lse [B, G, R, c] of its query chunk and
    delta = rowsum(dout * out) [B, G, R, c]: P = exp(S - lse) is this pair's slice of the
    full softmax, dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dQ = dS K * scale,
    dK = dS^T Q * scale. Returns (dq [B, G, R, c, D], dk, dv [B, G, c, D])."""
    p = torch.exp(_scores(q, k, kind, scale) - lse.unsqueeze(-1))  # [B, G, R, c, c]
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, dout)
    dp = torch.einsum("bgrqd,bgkd->bgrqk", dout, v)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k) * scale
    dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale
    return dq, dk, dv
