"""The expert-parallel all-to-all as an autograd function: rows to their ranks by uneven
splits, and in backward the gradients back by the swapped splits."""

from __future__ import annotations

import torch

from shardtrain.comm import Communicator


class _AllToAll(torch.autograd.Function):
    """Rows of x to the ranks by `in_rows`, received by `out_rows`; backward: the swap."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, out_rows: list[int],
                in_rows: list[int]) -> torch.Tensor:
        ctx.comm, ctx.rows = comm, (out_rows, in_rows)
        out = x.new_empty(sum(out_rows), *x.shape[1:])
        comm.all_to_all(out, x.contiguous(), output_splits=out_rows, input_splits=in_rows,
                        tag="ep")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_rows, in_rows = ctx.rows
        back = grad.new_empty(sum(in_rows), *grad.shape[1:])
        ctx.comm.all_to_all(back, grad.contiguous(), output_splits=in_rows,
                            input_splits=out_rows, tag="ep")
        return back, None, None, None


def all_to_all(x: torch.Tensor, comm: Communicator, out_rows: list[int],
               in_rows: list[int]) -> torch.Tensor:
    return _AllToAll.apply(x, comm, out_rows, in_rows)
