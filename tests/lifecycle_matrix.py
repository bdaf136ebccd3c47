"""The lifecycle matrix's rows: which values of which factors a row combines.

Factors are what a user combines on the first day (layout, precision, model family,
attention mask, compile, offload, asynchronous save); each value is a set of config
overrides on the tiny preset. A row is valid when the config's own validation accepts it
at the matrix's world size (`Config.validate`: the pairs it refuses, such as compile or
fp16 with a parameter server, are excluded that way and no other).

`covering(strength, seed)` picks rows greedily from every valid row until each
`strength`-wise combination of values that some valid row holds appears in a chosen row
(AETG's greedy idea, Cohen et al. 1997, over an enumerable space: 2,160 candidate rows),
ties broken by a seeded draw. Each new feature adds its values here.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterable

from shardtrain import config
from shardtrain.config import ConfigError

WORLD = 2  # every layout below fits two processes (the matrix's one spawn)
Z = "--parallel.zero"
FACTORS: dict[str, dict[str, tuple[str, ...]]] = {
    "layout": {
        "dp": (),
        "zero1": (Z, "1"),
        "zero2": (Z, "2"),
        "zero3": (Z, "3"),
        # seed 001's inter-layer partitioning, both blocks of the tiny model in one unit
        "zero3-layer": (Z, "3", "--parallel.zero_partition", "layer",
                        "--parallel.zero_unit_blocks", "2"),
        "tp+sp": ("--parallel.tp", "2", "--parallel.sp", "true"),
        "pp": ("--parallel.pp", "2"),
        "pp-zb": ("--parallel.pp", "2", "--parallel.schedule", "zb-h1"),  # split backward
        "cp": ("--parallel.cp", "2"),
        "ep": ("--parallel.ep", "2"),
        "ps": ("--parallel.ps_servers", "1"),
        # two replica groups of one rank (HSDP's outer dim), DiLoCo's outer Nesterov step
        # every 2 steps: its outer copy and momentum save, resume and reshard
        "diloco": ("--parallel.replicas", "2", "--parallel.sync", "diloco",
                   "--parallel.sync_every", "2"),
    },
    "precision": {p: ("--train.precision", p)
                  for p in ("fp32", "bf16", "fp16", "bf16-true", "fp16-true")},
    "model": {
        "llama": (),  # the tiny preset: untied, grouped-query (4 heads, 2 kv heads)
        "llama-tied": ("--model.tie_embeddings", "true"),
        "gpt2": ("--model.style", "gpt2", "--model.n_kv_heads", "0",
                 "--model.tie_embeddings", "true"),
        # Qwen3: per-head q/k norms, one kv head, a head size that is not dim / heads
        "qwen3": ("--model.qk_norm", "true", "--model.n_kv_heads", "1",
                  "--model.head_size", "32"),
        # DeepSeek-V3's shape and routing: a dense first block, fine-grained experts with a
        # shared one, sigmoid scores limited to one of two groups (ep's grouped exchange),
        # the expert bias (state that saves, resumes and samples) with its sequence-wise loss
        "moe": ("--model.n_experts", "4", "--model.moe_top_k", "2", "--model.moe_score",
                "sigmoid", "--model.moe_balance", "bias", "--model.moe_aux_loss_coef", "0.001",
                "--model.moe_ffn_dim", "32", "--model.moe_shared_experts", "1",
                "--model.moe_first_dense", "1", "--model.moe_groups", "2",
                "--model.moe_max_groups", "1"),
        # DeepSeek-V3 whole: latent attention with a q bottleneck (v narrower than q and k:
        # padded for the core) over the MoE above, routed scale, one MTP module
        "mla": ("--model.attention", "mla", "--model.n_kv_heads", "0", "--model.q_lora_rank",
                "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
                "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "16",
                "--model.moe_route_scale", "2.5", "--model.n_experts", "4", "--model.moe_top_k",
                "2", "--model.moe_score", "sigmoid", "--model.moe_balance", "bias",
                "--model.moe_aux_loss_coef", "0.001", "--model.moe_ffn_dim", "32",
                "--model.moe_shared_experts", "1", "--model.moe_first_dense", "1",
                "--model.moe_groups", "2", "--model.moe_max_groups", "1", "--model.mtp_depth",
                "1"),
    },
    "attention": {"plain": (), "document": ("--data.document_mask", "true")},
    "optim": {o: ("--optim.name", o) for o in ("adamw", "rmsprop", "adagrad")},
    "compile": {"off": (), "on": ("--train.compile", "true")},
    "offload": {"none": (), "cpu": ("--parallel.offload", "cpu")},
    # saved activations to host memory in forward, back one block ahead in backward
    "activation_offload": {"none": (), "cpu": ("--train.activation_offload", "cpu")},
    "save": {"sync": (), "async": ("--checkpoint.async_save", "true")},
    # the blocks' linears on torchao's float8 (train.fp8), ZeRO-3 gathering them in e4m3
    "fp8": {"none": (), "tensorwise": ("--train.fp8", "tensorwise")},
}
# Where a row resumes: the next layout in this order that its other values allow (a
# parameter server's checkpoint resumes only with servers: train/checkpoint/checkpoint.py;
# DiLoCo's in DiLoCo, as its steps are not dp's: into one group, tests/test_replicas.py).
RESUME_ORDER = ("dp", "zero3", "tp+sp", "zero3-layer", "zero2", "pp", "pp-zb", "zero1", "cp",
                "ep")

Row = dict[str, str]  # factor -> value


def overrides(row: Row) -> list[str]:
    return [arg for factor, value in row.items() for arg in FACTORS[factor][value]]


@functools.cache
def _valid(items: tuple[tuple[str, str], ...]) -> bool:
    try:
        config.load("tiny", overrides(dict(items))).validate(WORLD)
    except ConfigError:
        return False
    return True


def valid(row: Row) -> bool:
    return _valid(tuple(sorted(row.items())))


def all_rows() -> list[Row]:
    names = list(FACTORS)
    return [dict(zip(names, values)) for values in itertools.product(*map(FACTORS.get, names))]


def _combos(row: Row, strength: int) -> Iterable[tuple[tuple[str, str], ...]]:
    return itertools.combinations(sorted(row.items()), strength)


def cost(row: Row) -> int:
    """A row's relative cost: compiling traces every block, about as long as the rest of the
    row (each of its runs compiles)."""
    return 2 if row["compile"] == "on" else 1


def covering(strength: int = 2, seed: int = 0, only: dict[str, set[str]] | None = None
             ) -> tuple[list[Row], int]:
    """Valid rows covering every `strength`-wise combination some valid row holds, and how
    many such combinations there are. Each pick covers the most new combinations per unit
    of `cost` (pairwise: 8 compiled rows, the least that meets every layout, not 20).
    `only`: factors limited to some of their values (the rows that hold them only)."""
    candidates = [r for r in all_rows() if valid(r)
                  and all(r[f] in values for f, values in (only or {}).items())]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    uncovered = {c for r in candidates for c in _combos(r, strength)}
    total, rows = len(uncovered), []
    while uncovered:
        best = max(candidates,
                   key=lambda r: len(uncovered.intersection(_combos(r, strength))) / cost(r))
        uncovered.difference_update(_combos(best, strength))
        rows.append(best)
    return rows, total


def excluded_pairs() -> list[tuple[tuple[str, str], ...]]:
    """The value pairs no valid row holds (what the config refuses together)."""
    held = {c for r in all_rows() if valid(r) for c in _combos(r, 2)}
    return sorted({c for r in all_rows() for c in _combos(r, 2)} - held)


def resume_layout(row: Row) -> Row:
    """The row as it resumes: the next layout in RESUME_ORDER after its own that is valid
    with its other values; compile and offload dropped where that layout refuses them."""
    if row["layout"] in ("ps", "diloco"):
        return dict(row)
    start = RESUME_ORDER.index(row["layout"])
    for layout in RESUME_ORDER[start + 1:] + RESUME_ORDER[:start]:
        for drop in ((), ("offload",), ("compile",), ("offload", "compile")):
            other = {**row, "layout": layout, **{f: _OFF[f] for f in drop}}
            if valid(other):
                return other
    raise AssertionError(f"no layout to resume {row} in")


_OFF = {"offload": "none", "compile": "off"}


def label(row: Row) -> str:
    return " ".join(row.values())
