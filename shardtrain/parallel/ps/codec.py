"""Compression of pushed gradients (seed 001, "Sparsification and Quantization"), one
partition at a time, with comm/compress.py's packing and selection.

- none: the fp32 gradient as it is.
- int8: block-wise absmax int8 (`pack_int8`), one fp32 scale per `block` values; the server
  dequantizes. About 4x fewer bytes.
- topk: the ceil(ratio x n) largest-magnitude entries as (value, index) pairs (`TopKCompressor
  .select`); with error feedback (Seide et al. 2014; Stich et al. 2018) what was not sent is
  added to the partition's next push, so nothing is lost, only delayed.

Every payload's size depends only on the partition's size, so a server posts its receive
before the push arrives.
"""

from __future__ import annotations

import math

import torch

from shardtrain.comm.compress import TopKCompressor, pack_int8, unpack_int8

KINDS = ("none", "int8", "topk")


class PushCodec:
    def __init__(self, kind: str, numels: list[int], *, block: int = 256, ratio: float = 0.01,
                 error_feedback: bool = True):
        if kind not in KINDS:
            raise ValueError(f"comm.compress={kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.numels, self.block = kind, numels, block
        self.topk = TopKCompressor(ratio, error_feedback=error_feedback)
        self.residual: dict[int, torch.Tensor] = {}  # topk: what each partition kept back

    def _k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.topk.ratio * n)))

    def empty(self, j: int, device: torch.device) -> torch.Tensor:
        """A receive buffer for partition j's payload."""
        n = self.numels[j]
        if self.kind == "int8":
            blocks = -(-n // self.block)
            return torch.empty(blocks * self.block + 4 * blocks, dtype=torch.uint8, device=device)
        if self.kind == "topk":
            return torch.empty(2 * self._k(n), dtype=torch.int32, device=device)
        return torch.empty(n, dtype=torch.float32, device=device)

    def encode(self, j: int, grad: torch.Tensor) -> torch.Tensor:
        """grad [n] (a view of the parameter's gradient) -> a payload that owns its memory."""
        if self.kind == "none":
            return grad.to(torch.float32, copy=True)
        if self.kind == "int8":
            n = grad.numel()
            rows = torch.zeros(1, -(-n // self.block) * self.block, dtype=torch.float32,
                               device=grad.device)  # [1, blocks x block], zero-padded
            rows[0, :n] = grad
            return pack_int8(rows, self.block)[0]
        acc = grad.to(torch.float32, copy=True)
        if self.topk.error_feedback and j in self.residual:
            acc += self.residual[j]
        index = self.topk.select(acc)
        values = acc[index]
        if self.topk.error_feedback:
            acc[index] = 0
            self.residual[j] = acc
        return torch.cat([values.view(torch.int32), index.to(torch.int32)])  # [2k]

    def decode(self, j: int, payload: torch.Tensor) -> torch.Tensor:
        """A payload -> the fp32 gradient [n] (a new tensor)."""
        n = self.numels[j]
        if self.kind == "none":
            return payload.clone()
        if self.kind == "int8":
            blocks = -(-n // self.block)
            return unpack_int8(payload.view(1, -1), blocks, self.block)[0, :n].clone()
        k = payload.numel() // 2
        dense = torch.zeros(n, dtype=torch.float32, device=payload.device)
        dense[payload[k:].long()] = payload[:k].view(torch.float32)
        return dense

    def state_dict(self) -> dict:
        return {"residual": dict(self.residual)}

    def load_state_dict(self, state: dict) -> None:
        self.residual = dict(state["residual"])
