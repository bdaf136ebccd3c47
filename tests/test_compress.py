"""Compressors on one process (a communicator of one rank moves bytes by copying): the
quantization error bound, top-k selection (whole tensor or per segment), and error feedback
losing nothing; and on four ranks, top-k's colliding indices summed in one order everywhere.
Training with compressed updates on a real dp group: test_compressed_update.py."""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed
from shardtrain.comm import CommLedger, Communicator, build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.comm.compress import (Int8Compressor, TopKCompressor, make_compressor,
                                       pack_int8)


def _comm() -> Communicator:
    return Communicator(None, name="dp", ranks=[0], ledger=CommLedger())


def test_int8_round_trip_error_is_within_half_a_step_per_quantization():
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.linspace(0.01, 10, 5000)  # blocks of very different scale
    c = Int8Compressor(block=256)
    y = x.clone()
    c.all_reduce(_comm(), y, "sum", "grad")
    # Two quantizations (the parts, then the reduced part), each off by <= scale / 2.
    padded = torch.cat([x, torch.zeros(5120 - 5000)])
    scale = padded.abs().view(-1, 256).amax(1).repeat_interleave(256)[:5000] / 127
    error = (y - x).abs()
    assert torch.all(error <= scale * 1.01) and error.max() > 0
    packed = pack_int8(torch.zeros(1, 512), 256)
    assert packed.dtype == torch.uint8 and packed.numel() == 512 + 2 * 4  # int8 + fp32 scales


def test_topk_sends_the_largest_and_error_feedback_keeps_the_rest():
    torch.manual_seed(1)
    c = TopKCompressor(0.1)
    total_in, total_out = torch.zeros(1000), torch.zeros(1000)
    for step in range(5):
        g = torch.randn(1000)
        y = g.clone()
        c.all_reduce(_comm(), y, "avg", "grad")
        assert int((y != 0).sum()) <= 100
        total_in += g
        total_out += y
        # Everything received so far plus the residual is everything produced.
        assert torch.allclose(total_out + c.residual, total_in, atol=1e-5)
    y = torch.tensor([0.1, -5.0, 0.2, 3.0])
    TopKCompressor(0.5, error_feedback=False).all_reduce(_comm(), y, "sum", "grad")
    assert y.tolist() == [0.0, -5.0, 0.0, 3.0]


def test_topk_segments_each_send_their_own_largest():
    """Per-tensor top-k over a flat vector of tensors: each segment sends ceil(ratio x its
    length) entries, at least one, even where another segment's entries are all larger."""
    y = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.01, -0.02])
    c = TopKCompressor(0.25, segments=(4, 2))
    c.all_reduce(_comm(), y, "sum", "grad")
    assert y.tolist() == pytest.approx([0.0, -5.0, 0.0, 0.0, 0.0, -0.02])
    assert c.residual.tolist() == pytest.approx([0.1, 0.0, 0.2, 3.0, 0.01, 0.0])
    with pytest.raises(ValueError, match="segments cover 5 entries, the tensor has 6"):
        TopKCompressor(0.25, segments=(4, 1)).all_reduce(_comm(), y, "sum", "grad")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="comm.compress='zip' is not one of none, int8"):
        make_compressor("zip")
    with pytest.raises(ValueError, match="topk compresses optimizer updates"):
        make_compressor("topk")
    with pytest.raises(ValueError, match=r"comm.topk_ratio=0 must be in \(0, 1\]"):
        TopKCompressor(0)
    with pytest.raises(ValueError, match="op 'max' is not supported"):
        Int8Compressor().all_reduce(_comm(), torch.ones(4), "max", "grad")
    assert make_compressor("none") is None


# fp32 has 24 mantissa bits: 2^24 + 1 rounds back to 2^24, so the sum of these four depends
# on the order of addition: 0 in group order, 2 if the two ones were added first.
BIG = float(2 ** 24)
COLLIDING = (BIG, 1.0, 1.0, -BIG)


def _topk_replicas(rank: int, world: int) -> dict:
    comm = build_mesh(MeshShape(dp=world), rank=rank).comm("dp")
    c = TopKCompressor(0.25, error_feedback=False)  # the sent values are exactly these
    g = torch.Generator().manual_seed(rank)
    outputs = []
    for step in range(4):
        x = torch.randn(64, generator=g)
        x[:4] = 0.01 * torch.randn(4, generator=g)
        x[step % 4] = COLLIDING[rank] * 2 ** step  # every rank's largest, at one index
        x[16:24] = torch.tensor([3.0, -2.0, 2.5, 1.5, -1.25, 1.75, -3.5, 2.25]) * (1 + rank)
        c.all_reduce(comm, x, "sum", "grad")
        outputs.append(x)
    return {"outputs": outputs}


def test_topk_colliding_indices_sum_in_group_order_and_replicas_stay_bitwise_equal():
    ranks = run_distributed(_topk_replicas, 4)
    for r in ranks[1:]:
        for a, b in zip(r["outputs"], ranks[0]["outputs"], strict=True):
            assert torch.equal(a, b)
    for step, out in enumerate(ranks[0]["outputs"]):
        assert out[step % 4].item() == 0.0  # each ((2^24 + 1) + 1) - 2^24, times 2^step
