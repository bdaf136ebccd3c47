"""Tables, acceptance figures, JSON and the busbw plot of a `shardtrain bench comm` run.

algbw = S / t; busbw = algbw x 2(p-1)/p (all_reduce), x (p-1)/p (all_gather,
reduce_scatter, all_to_all), x 1 (rooted ops): the nccl-tests definitions (FORMULAS.md),
comparable with the link bandwidth whatever the op.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

from shardtrain.bench import fit
from shardtrain.cost import collectives as cost

SHORT = {"native": "native", "ring": "ring", "tree": "tree", "recursive_doubling": "rec_dbl",
         "halving_doubling": "halv_dbl", "rabenseifner": "rabens", "hierarchical": "hier",
         "torus2d": "torus", "auto": "auto", "gather_broadcast": "gath_bc", "mesh2d": "mesh2d",
         "torus3d": "torus3d", "ring_tree": "ring_tree"}


def annotate(result: dict) -> list[dict]:
    """Add algbw, busbw and the model's prediction (fitted link) to every row."""
    p, link, local = result["p"], result["link"], result["local_size"]
    for row in result["rows"]:
        t, n = row["time_s"], row["bytes"]
        row["algbw_GBps"] = n / t / 1e9
        row["busbw_GBps"] = cost.bus_bandwidth(row["op"], n, p, t) / 1e9
        row["predicted_s"] = fit.predict(row["op"], row["algorithm"], n, p, link, local)
    return result["rows"]


def size_label(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def print_tables(rows: list[dict], out=sys.stdout) -> None:
    by_op: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row)
    for op, op_rows in by_op.items():
        algorithms = list(dict.fromkeys(r["algorithm"] for r in op_rows))
        cells = {(r["bytes"], r["algorithm"]): r for r in op_rows}
        print(f"\n{op}: busbw GB/s (time us; model us)   best = fastest fixed algorithm", file=out)
        print(f"{'size':>9} " + " ".join(f"{SHORT[a]:>22}" for a in algorithms)
              + f" {'best':>9} {'auto picks':>10}", file=out)
        for n in sorted({r["bytes"] for r in op_rows}):
            line = f"{size_label(n):>9} "
            for a in algorithms:
                r = cells.get((n, a))
                if r is None:
                    line += f"{'-':>22} "
                    continue
                model = f"{r['predicted_s'] * 1e6:.0f}" if r["predicted_s"] is not None else "-"
                line += f"{r['busbw_GBps']:6.3f} ({r['time_s'] * 1e6:6.0f};{model:>6}) "
            best = best_fixed(op_rows, n)
            auto = cells.get((n, "auto"))
            line += f"{SHORT[best['algorithm']]:>9} {SHORT[auto['chosen']] if auto else '-':>10}"
            print(line, file=out)


def best_fixed(op_rows: list[dict], n: int) -> dict:
    return min((r for r in op_rows if r["bytes"] == n and r["algorithm"] != "auto"),
               key=lambda r: r["time_s"])


def acceptance(rows: list[dict]) -> dict:
    """The issue's figures: ring vs native all-reduce busbw at >= 16 MiB; auto vs the best
    fixed algorithm at every size (the first sweep's winner, hierarchical and auto's own
    pick, timed in the same turns as auto), split into the choice (the pick against the
    best) and the noise (auto against its pick, the same algorithm timed twice);
    |model - measured| / measured at >= 1 MiB."""
    cells = {(r["op"], r["bytes"], r["algorithm"]): r for r in rows}
    ring_vs_native = {
        size_label(n): cells[("all_reduce", n, "ring")]["busbw_GBps"]
        / cells[("all_reduce", n, "native")]["busbw_GBps"]
        for (op, n, a) in cells if op == "all_reduce" and a == "ring" and n >= 16 * 2**20
        and ("all_reduce", n, "native") in cells}
    auto_vs_best = {}  # against the best fixed algorithm timed in the same turns as auto
    for (op, n, a), r in cells.items():
        if a == "auto" and r.get("rivals_s"):
            rivals, pick = r["rivals_s"], r["chosen"]
            best = min(rivals, key=rivals.get)
            auto_vs_best[f"{op} {size_label(n)}"] = {
                "auto_vs_best": r["time_s"] / rivals[best], "pick": pick, "best": best,
                # the choice alone: auto's pick timed as a fixed algorithm, against the best
                "pick_vs_best": rivals[pick] / rivals[best] if pick in rivals else None,
                # one algorithm timed twice in the same turns: the machine's noise
                "auto_vs_pick": r["time_s"] / rivals[pick] if pick in rivals else None}
    errors = {f"{r['op']} {r['algorithm']} {size_label(r['bytes'])}":
              (r["predicted_s"] - r["time_s"]) / r["time_s"]
              for r in rows if r["bytes"] >= 2**20 and r["predicted_s"] is not None
              and r["algorithm"] != "native"}
    return {"ring_vs_native_busbw": ring_vs_native, "auto_vs_best_time": auto_vs_best,
            "model_relative_error": errors}


def print_summary(result: dict, figures: dict, out=sys.stdout) -> None:
    link = result["link"]
    print(f"\n{result['p']} processes, virtual nodes of {result['node_size']} "
          f"({result['local_size']} per node in the group)", file=out)
    print(f"fitted: alpha {link.alpha_s * 1e6:.1f} us, beta {link.beta_s_per_byte * 1e9:.3f} ns/B "
          f"({_rate(link.beta_s_per_byte)}), gamma {link.gamma_s_per_byte * 1e9:.3f} ns/B, "
          f"shared {link.shared_s_per_byte * 1e9:.3f} ns/B; native: alpha "
          f"{link.native_alpha_s * 1e6:.1f} us, staging {link.staging_s_per_byte * 1e9:.3f} ns/B; "
          f"a local fp32 add measured {result['local_add_s_per_byte'] * 1e9:.3f} ns/B", file=out)
    ratios = figures["ring_vs_native_busbw"]
    if ratios:
        print("ring / native all_reduce busbw (>= 16 MiB): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), file=out)
    auto = figures["auto_vs_best_time"]
    if auto:
        worst_key, worst = max(auto.items(), key=lambda kv: kv[1]["auto_vs_best"])
        print(f"auto / best fixed time: within 10% at {_within(auto, 'auto_vs_best')} (op, size) "
              f"points; worst {worst['auto_vs_best']:.2f}x at {worst_key} (auto {worst['pick']}, "
              f"best {worst['best']})", file=out)
        print(f"  its pick timed as a fixed algorithm / best: within 10% at "
              f"{_within(auto, 'pick_vs_best')}; auto / its pick (one algorithm timed twice, "
              f"the machine's noise): within 10% at {_within(auto, 'auto_vs_pick')}", file=out)
    errors = figures["model_relative_error"]
    if errors:
        absolute = sorted(abs(e) for e in errors.values())
        worst = max(errors.items(), key=lambda kv: abs(kv[1]))
        print(f"model vs measured at >= 1 MiB: median |error| {absolute[len(absolute) // 2]:.0%}, "
              f"within 25% at {sum(e <= 0.25 for e in absolute)} of {len(absolute)}; worst "
              f"{worst[1]:+.0%} ({worst[0]})", file=out)


def _within(points: dict, key: str, limit: float = 1.10) -> str:
    ratios = [v[key] for v in points.values() if v[key] is not None]
    return f"{sum(r <= limit for r in ratios)} of {len(ratios)}"


def _rate(beta: float) -> str:
    return f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "inf GB/s"


def plot(rows: list[dict], path: str) -> str:
    """busbw vs size, one panel per op, one line per algorithm; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("no plot written: matplotlib is not installed; "
                "pip install 'shardtrain[plot]'")
    ops = list(dict.fromkeys(r["op"] for r in rows))
    cols = min(4, len(ops))
    fig, axes = plt.subplots(math.ceil(len(ops) / cols), cols, squeeze=False,
                             figsize=(4.5 * cols, 3.5 * math.ceil(len(ops) / cols)))
    for ax, op in zip(axes.flat, ops):
        for a in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows
                         if r["op"] == op and r["algorithm"] == a)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=SHORT[a])
        ax.set(xscale="log", title=op, xlabel="bytes", ylabel="busbw GB/s")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return f"plot: {path}"
