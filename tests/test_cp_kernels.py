"""Context-parallel attention on fused kernels (issue 30), in one process: one chunk pair's
kernel forward and backward plus the log-sum-exp merge (parallel/context/blocks.py) equal
dense SDPA (values and gradients, fp32, causal, grouped-query); ring attention keeps no
[c, c] tensor for backward and no op of its forward or backward even produces one; the
kernels run in the compute dtype (bf16 under autocast); Ulysses runs the same CPU flash
kernel on its gathered sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.comm import CommLedger, Communicator
from shardtrain.parallel.context import ContextAttention, SequenceSplit, simulated_ring_attention
from shardtrain.parallel.context.blocks import DIAG, FULL, attend, attend_backward, merge

FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu"


def _qkv(b: int, h: int, g: int, s: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=gen) for n in (h, g, g, h)]  # q, k, v, dout


class _Ops(TorchDispatchMode):
    """Every aten op run under it: (name, input dtypes, output shapes)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func).removesuffix(".default"),
                         [a.dtype for a in args if isinstance(a, torch.Tensor)],
                         [tuple(t.shape) for t in outs if isinstance(t, torch.Tensor)]))
        return out


def test_pair_kernels_and_lse_merge_match_sdpa():
    """Four query chunks of c = 6 over the key chunks up to their own (the diagonal pair
    causal): forward by merging the pairs, backward as the sum of every pair's kernel
    backward from its query chunk's final out and lse."""
    n, c, h, g = 4, 6, 4, 2
    q, k, v, dout = _qkv(2, h, g, n * c, 8)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want, x, dout)
    scores = (q @ k.repeat_interleave(h // g, 1).transpose(-1, -2)) * 8 ** -0.5
    causal = torch.ones(n * c, n * c, dtype=torch.bool).tril()
    want_lse = scores.masked_fill(~causal, float("-inf")).logsumexp(-1)  # [B, H, S]

    def chunk(t, i):
        return t.narrow(2, i * c, c)

    pairs = [(i, j, DIAG if i == j else FULL) for i in range(n) for j in range(i + 1)]
    acc: dict[int, tuple] = {}
    for i, j, kind in pairs:
        acc[i] = merge(acc.get(i), *attend(chunk(q, i), chunk(k, j), chunk(v, j), kind,
                                           8 ** -0.5))
    out = torch.cat([acc[i][0] for i in range(n)], dim=2)
    lse = torch.cat([acc[i][1] for i in range(n)], dim=2)
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, j, kind in pairs:
        dq, dk, dv = attend_backward(chunk(q, i), chunk(k, j), chunk(v, j), kind, 8 ** -0.5,
                                     chunk(out, i), chunk(lse, i), chunk(dout, i))
        chunk(grads[0], i).add_(dq)
        chunk(grads[1], j).add_(dk)
        chunk(grads[2], j).add_(dv)
    for name, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("autocast", [False, True])
def test_ring_keeps_and_makes_no_chunk_by_chunk_tensor(autocast):
    """cp = 2, zig-zag: S = 48 in four chunks of c = 12 (head dim 8, local length 24). No
    tensor saved for backward, and no op output in forward or backward, ends in [c, c]; the
    flash kernel runs on every pair, in bf16 under autocast (the compute dtype)."""
    c, split = 12, SequenceSplit(48, 2, True)
    q, k, v, dout = _qkv(1, 4, 2, 48, 8, seed=1)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    saved: list[tuple] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with _Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = simulated_ring_attention(*x, split=split)
        out.backward(dout)
    assert saved and all(s[-2:] != (c, c) for s in saved), saved
    made = [(name, shape) for name, _, shapes in ops.ops for shape in shapes]
    assert not [m for m in made if m[1][-2:] == (c, c)]
    dtype = torch.bfloat16 if autocast else torch.float32
    for phase in (FLASH_CPU, FLASH_CPU + "_backward"):
        runs = [dts for name, dts, _ in ops.ops if name == phase]
        # per rank: 3 pairs on its own block (two diagonal), 2 on the other rank's: 5 each
        assert len(runs) == 10, (phase, len(runs))
        assert all(dt in (dtype, torch.float32) and dts[0] == dtype for dts in runs
                   for dt in dts), (phase, runs[0])
    assert out.dtype == dtype and all(t.grad.dtype == torch.float32 for t in x)


def test_ulysses_runs_the_flash_kernel_on_the_gathered_sequence():
    """One rank (the same path as N ranks, no message): SDPA dispatches to the CPU flash
    kernel, forward and backward, and no [S, S] tensor is made."""
    comm = Communicator(None, name="cp", ranks=[0], ledger=CommLedger())
    core = ContextAttention(comm, SequenceSplit(40, 1, True), "ulysses")
    q, k, v, dout = _qkv(1, 4, 2, 40, 8, seed=2)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    with _Ops() as ops:
        core(*x).backward(dout)
    names = [name for name, _, _ in ops.ops]
    assert FLASH_CPU in names and FLASH_CPU + "_backward" in names
    assert not [s for _, _, shapes in ops.ops for s in shapes if s[-2:] == (40, 40)]


def test_a_device_without_a_pair_kernel_is_refused():
    q = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"CPU or CUDA.*train\.device"):
        attend(q, q, q, DIAG, 8 ** -0.5)
