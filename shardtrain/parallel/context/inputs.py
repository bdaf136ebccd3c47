"""The checks every context-attention entry point makes before any work or message."""

from __future__ import annotations

import torch

from shardtrain.model.positions import Documents
from shardtrain.parallel.context.split import SequenceSplit


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int,
              what: str) -> None:
    """q [B, H, S, D], k and v [B, G, S, D] with G dividing H and S == `tokens`."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what}: q, k, v must be [B, heads, S, D]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k, v {tuple(k.shape)}, "
                         f"{tuple(v.shape)} must agree on batch, sequence and head dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{what}: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} kv heads (model.n_heads / model.kv_heads)")
    if q.shape[2] != tokens:
        raise ValueError(f"{what}: q, k, v hold {q.shape[2]} tokens, expected {tokens}")


def check_group(comm_size: int, split: SequenceSplit, what: str) -> None:
    split.check()
    if comm_size != split.cp:
        raise ValueError(f"{what}: the cp group has {comm_size} ranks but the split is for "
                         f"parallel.cp={split.cp}")


def check_documents(documents: Documents | None, batch: int, seq_len: int, what: str) -> None:
    """Packed documents, when given, describe `batch` full rows of `seq_len` tokens."""
    if documents is not None and (len(documents.spans), documents.seq_len) != (batch, seq_len):
        raise ValueError(f"{what}: the documents describe {len(documents.spans)} rows of "
                         f"{documents.seq_len} tokens, but the batch has {batch} rows of "
                         f"{seq_len} (train.seq_len): pass the full rows' positions")
