"""ZeRO's flat units without processes: forward order, padding, each parameter once, the
shards tiling the buffer, weight decay's runs, and qwZ's block alignment."""

from __future__ import annotations

import torch

from shardtrain.model.transformer import build_model


def test_flat_units_pad_and_hold_every_parameter_once():
    """Units in forward order (a tied token table joins the head's unit, counted once; the
    position table keeps the embedding's), each
    padded to a multiple of dp = 3; the shards of the 3 ranks tile the buffer, and their
    weight-decay runs cover exactly the matrices' elements."""
    from shardtrain.config import ModelConfig
    from shardtrain.parallel.zero.units import build_units

    cfg = ModelConfig(style="gpt2", vocab_size=259, dim=20, n_layers=2, n_heads=4, n_kv_heads=0,
                      max_seq_len=16, tie_embeddings=True)
    reference = dict(build_model(cfg, seed=3).named_parameters())
    decayed = 0
    for rank in range(3):
        model = build_model(cfg, seed=3)
        units = build_units(model, dp_size=3, dp_rank=rank, dtype=torch.float32, tied=True)
        assert [u.names[0] for u in units] == ["pos_emb.weight", "layers.0.attn_norm.weight",
                                               "layers.1.attn_norm.weight", "tok_emb.weight"]
        assert model.head.weight is model.tok_emb.weight
        assert sum(u.numel for u in units) == sum(p.numel() for p in reference.values())
        assert any(u.padded > u.numel for u in units)
        for u in units:
            assert u.padded % 3 == 0 and u.padded - u.numel < 3
            assert u.shard.data_ptr() == u.flat.data_ptr() + rank * u.shard_numel * 4
            for name, p in zip(u.names, u.params):
                assert p.data_ptr() >= u.flat.data_ptr()  # a view of the flat buffer
                torch.testing.assert_close(p.detach(), reference[name], rtol=0, atol=0)
            decayed += sum(b - a for a, b in u.decay_runs())
    assert decayed == sum(p.numel() for p in reference.values() if p.ndim >= 2)
    # qwZ's alignment: every parameter and every shard starts on a block boundary, so no
    # quantization block mixes two parameters; the values are unchanged.
    model = build_model(cfg, seed=3)
    for u in build_units(model, dp_size=3, dp_rank=1, dtype=torch.float32, tied=True, align=8):
        assert all(o % 8 == 0 for o in u.offsets) and u.shard_numel % 8 == 0
        for name, p in zip(u.names, u.params):
            torch.testing.assert_close(p.detach(), reference[name], rtol=0, atol=0)

