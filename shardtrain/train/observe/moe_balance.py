"""The experts' balance in `shardtrain report`: per layer, MaxVio (max load / mean load -
1 of the step's routed slots over all replicas, model/moe.py `layer_balance`) against the
steps, from metrics.jsonl's `moe_maxvio`, drawn and summarised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtrain.train.observe.charts import pyplot, save_png


def moe_lines(records: list[dict[str, Any]]) -> list[str]:
    """Per MoE layer: MaxVio at the first and last logged step and its mean; [] for a
    dense run. A dense block (model.moe_first_dense) has None and no line."""
    rows = [r["moe_maxvio"] for r in records if r.get("moe_maxvio")]
    if not rows:
        return []
    lines = [f"{'layer':>5} {'MaxVio first':>12} {'last':>8} {'mean':>8}"]
    for layer in range(len(rows[0])):
        seen = [row[layer] for row in rows]
        if seen[0] is None:
            continue
        lines.append(f"{layer:>5} {seen[0]:>12.3f} {seen[-1]:>8.3f} "
                     f"{sum(seen) / len(seen):>8.3f}")
    return lines


def plot_moe_balance(records: list[dict[str, Any]], path: Path) -> bool:
    """MaxVio against steps, one line per layer, to `path` (PNG); False for a dense run."""
    rows = [(r["step"], r["moe_maxvio"]) for r in records if r.get("moe_maxvio")]
    if not rows:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [step for step, _ in rows]
    for layer in range(len(rows[0][1])):
        if rows[0][1][layer] is None:  # a dense block
            continue
        ax.plot(steps, [v[layer] for _, v in rows], label=f"layer {layer}", linewidth=1)
    ax.set(xlabel="step", ylabel="MaxVio (max load / mean load - 1)",
           title="expert load balance per layer")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    save_png(fig, path)
    return True
