"""The attention core of one whole sequence: causal scaled-dot-product attention, or
causal attention inside each packed document, always on a kernel that keeps no [S, S]
scores or mask.

Which kernel runs is decided once (model/sdpa_kernels.py), for the runtime and the planner
(plan/layout.py's `attention` field) alike. SDPA picks among the kernels that take
its inputs, flash first, then memory-efficient, then math; the math kernel materialises
the whole [B, H, S, S] score matrix: 8.6 GB per layer per sequence at Llama-3-8B's 8192
tokens in fp32 (32 heads x 8192^2 x 4 bytes). It falls there for an arbitrary mask, and on
CUDA for grouped-query attention outside flash's 16-bit dtypes (the memory-efficient kernel
takes fp32 and masks but no GQA). So:

- packed documents (data.document_mask) pass no mask: each document runs its own causal
  kernel call on its [start, end) slice of q, k, v (per-document variable-length attention;
  the spans come from `Documents`, model/positions.py), so no [S, S] tensor is made;
- grouped kv heads that the chosen kernel does not take are repeated for the call
  ([B, H, S, D], what enable_gqa means; H / G x the k, v bytes, gradients summed back by
  autograd), which leaves the fused kernel the call.

Shape legend: B batch, S sequence, H query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardtrain.model import sdpa_kernels
from shardtrain.model.positions import Documents


def sdpa_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, S, D] over k, v [B, G, S, D] -> [B, H, S, D] (G divides
    H: grouped-query attention, Ainslie et al. 2023); with `documents`, causal inside each
    document of each row (`per_document`)."""
    device = q.device.type
    kernel = sdpa_kernels.attention_kernel(device, str(q.dtype).removeprefix("torch."),
                                           q.shape[-1])
    if q.shape[1] != k.shape[1] and sdpa_kernels.repeats_kv(kernel, device):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if documents is None:
        return causal(q, k, v)
    return per_document(q, k, v, documents)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One causal SDPA call, no mask tensor: q [B, H, L, D], k, v [B, G, L, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: Documents) -> torch.Tensor:
    """q [B, H, S, D], k, v [B, G, S, D] in position order -> [B, H, S, D]: every document
    of every row attends causally to itself alone, one kernel call on its slices (views:
    nothing is copied in). Compiled blocks leave this loop eager (parallel/compile.py): its
    spans are Python ints, which a graph would bake in and recompile for every batch."""
    if documents.seq_len != q.shape[2] or len(documents.spans) != q.shape[0]:
        raise ValueError(f"per-document attention: q, k, v [B={q.shape[0]}, S={q.shape[2]}] "
                         f"but the documents describe {len(documents.spans)} rows of "
                         f"{documents.seq_len} tokens")
    rows = []
    # split, not slicing: split's backward is one concatenation of the parts' gradients,
    # where each slice's backward would write its part into a zero tensor of the whole.
    for qb, kb, vb, spans in zip(q.split(1), k.split(1), v.split(1), documents.spans):
        sizes = [hi - lo for lo, hi in spans]
        parts = [causal(*x) for x in zip(*(t.split(sizes, dim=2) for t in (qb, kb, vb)))]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
