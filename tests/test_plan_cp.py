"""The planner's context-parallel figures follow what parallel/context/ does.

Bytes one rank sends on the cp group per step, hand-computed for ring attention and
Ulysses at cp = 2 and 4, GQA and MHA, bf16 and fp32, with and without full recomputation
(docs/planner.md, "Context parallelism"); activation memory with cp; the layout's cp_mode
(parsed, checked, searched).
"""

from __future__ import annotations

import pytest

from shardtrain.config import ModelConfig
from shardtrain.cost import hardware
from shardtrain.plan.activations import runtime_activation_bytes
from shardtrain.plan.layout import Layout, PlanError, check
from shardtrain.plan.layout_text import parse_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.search import candidates
from shardtrain.plan.traffic import bytes_per_step, context_parallel_ops, cp_bytes_per_step, step_ops

S, B, L, M = 1024, 2, 3, 3  # sequence, micro-batch, layers, micro-batches per step
MODELS = {  # dim 256, 8 query heads of 32
    "gqa": ModelConfig(style="llama", vocab_size=256, dim=256, n_layers=L, n_heads=8,
                       n_kv_heads=2, max_seq_len=S),
    "mha": ModelConfig(style="llama", vocab_size=256, dim=256, n_layers=L, n_heads=8,
                       max_seq_len=S),
}
PRECISION = {2: "bf16", 4: "fp32"}

# Bytes per attention call (one layer, one micro-batch), s = S/N, G kv heads, D = 32:
# ring: (N-1) (2, or 3 with full recompute) sends of 2 b G s D values + N sends of the same
#   elements in fp32 (dK, dV), e.g. gqa N=2 bf16: 2 x 131072 x 2 + 2 x 131072 x 4.
# ulysses: (qkv + out) x (2, or 3 with full) x (N-1)/N with qkv = b s (H + 2G') D v,
#   out = b s H D v, G' = G if N divides G else H; e.g. gqa N=4 (G' = 8) bf16:
#   (2 x 256 x 24 x 32 x 2 + 2 x 256 x 8 x 32 x 2) x 2 x 3/4.
PER_CALL = [  # (model, N, value bytes, recompute, ring, ulysses)
    ("gqa", 2, 2, "none", 1572864, 1310720),
    ("gqa", 2, 2, "full", 1835008, 1966080),
    ("gqa", 2, 4, "none", 2097152, 2621440),
    ("gqa", 2, 4, "full", 2621440, 3932160),
    ("gqa", 4, 2, "none", 1835008, 1572864),
    ("gqa", 4, 2, "full", 2228224, 2359296),
    ("gqa", 4, 4, "none", 2621440, 3145728),
    ("gqa", 4, 4, "full", 3407872, 4718592),
    ("mha", 2, 2, "none", 6291456, 2097152),
    ("mha", 2, 2, "full", 7340032, 3145728),
    ("mha", 2, 4, "none", 8388608, 4194304),
    ("mha", 2, 4, "full", 10485760, 6291456),
    ("mha", 4, 2, "none", 7340032, 1572864),
    ("mha", 4, 2, "full", 8912896, 2359296),
    ("mha", 4, 4, "none", 10485760, 3145728),
    ("mha", 4, 4, "full", 13631488, 4718592),
]


def _layout(n: int, value: int, recompute: str, mode: str, **kw) -> Layout:
    return Layout(cp=n, cp_mode=mode, precision=PRECISION[value], recompute=recompute,
                  micro_batch=B, microbatches=M, **kw)


@pytest.mark.parametrize("name, n, value, recompute, ring, ulysses", PER_CALL)
def test_cp_bytes_per_step_hand_computed(name, n, value, recompute, ring, ulysses):
    cfg = MODELS[name]
    for mode, per_call in (("ring", ring), ("ulysses", ulysses)):
        lay = _layout(n, value, recompute, mode)
        assert cp_bytes_per_step(cfg, lay, S) == L * M * per_call, mode
        # step_ops carries the same ops, priced on a cluster
        ops = step_ops(cfg, lay, hardware.get("h100"), seq_len=S)
        assert sum(bytes_per_step(ops)["cp"].values()) == L * M * per_call


def test_selective_leaves_cp_traffic_alone():
    """A context-parallel core declares recomputes_in_backward: selective does not wrap it."""
    cfg = MODELS["gqa"]
    for n in (2, 4):
        for mode in ("ring", "ulysses"):
            bytes_ = {r: cp_bytes_per_step(cfg, _layout(n, 2, r, mode), S)
                      for r in ("none", "selective", "full")}
            assert bytes_["selective"] == bytes_["none"] < bytes_["full"]


def test_ring_overlaps_compute_and_ulysses_is_exposed():
    cfg = MODELS["gqa"]
    ring = context_parallel_ops(cfg, _layout(2, 2, "none", "ring"), seq_len=S)
    uly = context_parallel_ops(cfg, _layout(2, 2, "none", "ulysses"), seq_len=S)
    assert {op.overlap for op in ring} == {"compute"} and {op.op for op in ring} == {"send_recv"}
    assert {op.overlap for op in uly} == {"none"} and {op.op for op in uly} == {"all_to_all"}


def test_tensor_parallel_splits_the_heads_cp_sends():
    cfg = MODELS["mha"]  # 8 kv heads: 4 per tp rank at tp = 2
    one = cp_bytes_per_step(cfg, _layout(2, 2, "none", "ring"), S)
    assert cp_bytes_per_step(cfg, _layout(2, 2, "none", "ring", tp=2), S) == one / 2
    uly = cp_bytes_per_step(cfg, _layout(2, 2, "none", "ulysses"), S)
    assert cp_bytes_per_step(cfg, _layout(2, 2, "none", "ulysses", tp=2), S) == uly / 2


def test_activation_memory_with_cp():
    """s = S/N local tokens; ring: the flash terms (q, k, v, out, lse), wo's input a view of
    its out (laid out as q); Ulysses (contiguous split): the same on [b, S, H/N, D] plus
    wo's copy of out (kv repeated to G' = H when
    N does not divide G); under the zigzag split also the rank-ordered q, k, v and out the
    Function keeps and two int64 [S] indices. (Measured on the context-parallel branch's
    cores with SavedActivations plus the Function's held graph: equal to the byte in fp32.)"""
    cfg = MODELS["gqa"]
    s, h, d, v = S // 4, 8, 32, 4
    flash = runtime_activation_bytes(cfg, s=s, b=B)  # one rank's share, no cp
    wo_copy = B * s * h * d * v
    assert runtime_activation_bytes(cfg, s=s, b=B, cp=4) == flash
    repeated = 2 * B * s * (h - 2) * d * v  # k, v at 8 heads instead of 2
    contiguous = flash + wo_copy + repeated
    assert runtime_activation_bytes(cfg, s=s, b=B, cp=4, cp_mode="ulysses",
                                    cp_split="contiguous") == contiguous
    qkv_out = B * s * (h + 2 * h + h) * d * v
    assert runtime_activation_bytes(cfg, s=s, b=B, cp=4, cp_mode="ulysses") == (
        contiguous + qkv_out + 2 * 8 * S)
    for recompute in ("none", "selective"):  # cp cores are not wrapped
        mem = memory_per_gpu(cfg, _layout(4, 4, recompute, "ring", dp=1), seq_len=S)
        assert mem.activations_per_layer == flash


def test_layout_cp_mode_parsed_checked_and_searched():
    cfg = MODELS["gqa"]
    lay = parse_layout("cp=4,cp_mode=ulysses", gpus=4, global_batch=2, precision="bf16")
    assert (lay.cp, lay.cp_mode, lay.dp) == (4, "ulysses", 1)
    assert "cp_mode=ulysses" in lay.describe()
    check(lay, cfg, gpus=4, node_size=8, global_batch=2, seq_len=S)
    bad = Layout(cp=4, tp=4, cp_mode="ulysses", micro_batch=2)  # 2 heads per tp rank
    with pytest.raises(PlanError, match="cp_mode=ulysses"):
        check(bad, cfg, gpus=16, node_size=8, global_batch=2, seq_len=S)
    with pytest.raises(PlanError, match="cp_mode"):
        check(Layout(cp=2, cp_mode="zigzag", micro_batch=2), cfg, gpus=2, node_size=8,
              global_batch=2, seq_len=S)
    long = ModelConfig(style="llama", vocab_size=256, dim=256, n_layers=2, n_heads=8,
                       n_kv_heads=2, max_seq_len=8192)
    found = {(c.cp, c.tp, c.cp_mode) for c in candidates(long, gpus=8, node_size=8,
                                                         global_batch=8, seq_len=8192,
                                                         precision="bf16")}
    assert {(2, 1, "ring"), (2, 1, "ulysses"), (8, 1, "ulysses")} <= found
    assert not any(mode == "ulysses" and (8 // tp) % cp for cp, tp, mode in found)
