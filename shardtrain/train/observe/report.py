"""`shardtrain report RUN_DIR`: the pipeline schedule of a run, as measured, and each
rank's compute and wait seconds with the stragglers named (train/pace.py).

A training run writes `<run_dir>/timeline_rank{R}.json` per rank (every layout runs the
pipeline executor; with parallel.pp = 1 it is one stage): the actions of its last step
(forward F, backward B, sends and receives of activations and gradients), each with its
start and end in seconds from the origin the pipeline group agreed at its first step
(parallel/pipeline/executor.py). From them this module draws a Gantt chart
(`<run_dir>/timeline.png`, one row per rank) and measures the bubble:

    bubble(stage) = 1 - busy compute seconds of the stage / span of the step

where the span runs from the first forward or backward of any rank to the last action's
end (a receive posted early, while the previous step's last backward still runs on
another stage, does not start the step: no barrier aligns the stages' starts). With
equal-cost
stages that is the idle share the formula predicts, (p-1)/(m+p-1) for GPipe and 1F1B and
(p-1)/(v m + p-1) for the interleaved schedule (Narayanan et al. 2021;
`plan.timing.bubble_fraction`, FORMULAS.md), and beside it the schedule simulator's replay
at the measured costs (simulated.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from shardtrain.config import ConfigError
from shardtrain.parallel.pipeline.schedules import COMPUTE, TRANSFERS
from shardtrain.plan.timing import bubble_fraction
from shardtrain.train.observe.charts import pyplot, save_png
from shardtrain.train.observe.moe_balance import moe_lines, plot_moe_balance
from shardtrain.train.observe.replica_chart import plot_replica_loss, replica_lines
from shardtrain.train.observe.simulated import simulated_lines
from shardtrain.train.pace import busy_seconds, pace_table

_HEADER = ("rank", "stage", "pp", "microbatches", "virtual_stages", "schedule", "step")
_SHARED = ("pp", "microbatches", "virtual_stages", "schedule", "step")
_FILE = re.compile(r"timeline_rank(\d+)\.json")

Timeline = dict[str, Any]  # one rank's file, in the format above


def load_timelines(run_dir: Path) -> list[Timeline]:
    """Every rank's timeline, in rank order, checked to describe one step of one schedule."""
    files = sorted((int(m.group(1)), p) for p in run_dir.glob("timeline_rank*.json")
                   if (m := _FILE.fullmatch(p.name)))
    if not files:
        raise ConfigError(f"no pipeline timelines (timeline_rank*.json) in {str(run_dir)!r}: "
                          "a training run writes them when it ends; to see a pipeline's schedule, "
                          "train with parallel.pp > 1 (e.g. --parallel.pp 2) and "
                          "train.run_dir set to this directory")
    timelines = []
    for rank, path in files:
        try:
            t = json.loads(path.read_text())
            missing = [k for k in (*_HEADER, "actions") if k not in t]
            actions = t.get("actions", [])
            bad = [a for a in actions
                   if a.get("op") not in COMPUTE + TRANSFERS or not a["end"] >= a["start"]]
            computes = sum(a["op"] in COMPUTE for a in actions)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{path}: not a timeline file ({e})") from None
        if missing or bad or not computes or t["rank"] != rank:
            raise ConfigError(f"{path}: not a timeline file (missing fields {missing}, "
                              f"{len(bad)} malformed actions, {computes} forwards or "
                              f"backwards, rank {t.get('rank')} in a file named {rank})")
        timelines.append(t)
    first = timelines[0]
    for t in timelines[1:]:
        differ = [k for k in _SHARED if t[k] != first[k]]
        if differ:
            raise ConfigError(f"{run_dir}: timelines of ranks {first['rank']} and {t['rank']} "
                              f"differ in {differ}: they come from different runs or steps; "
                              "delete the stale timeline_rank*.json and train again")
    return timelines


def formula_bubble(t: Timeline) -> float:
    """The schedule's ideal bubble fraction for this timeline's p, m (and v)."""
    return bubble_fraction(t["pp"], t["microbatches"], v=t["virtual_stages"],
                           schedule=t["schedule"])


def step_span(timelines: list[Timeline]) -> tuple[float, float]:
    """(first start of a forward or backward, last end of any action) over every rank."""
    actions = [a for t in timelines for a in t["actions"]]
    return (min(a["start"] for a in actions if a["op"] in COMPUTE),
            max(a["end"] for a in actions))


def measured_bubbles(timelines: list[Timeline]) -> dict[int, float]:
    """rank -> 1 - busy compute seconds / step span."""
    start, end = step_span(timelines)
    return {t["rank"]: 1.0 - busy_seconds(t) / (end - start) for t in timelines}


def mean_bubble(timelines: list[Timeline]) -> float:
    """The measured bubble averaged over the ranks."""
    measured = measured_bubbles(timelines)
    return sum(measured.values()) / len(measured)


def plot_timeline(timelines: list[Timeline], path: Path, *, title: str) -> None:
    """A Gantt chart of the step, written atomically to `path` (a PNG): one row per rank,
    forward boxes blue and backward boxes orange (darker for later model chunks), each
    labelled by its micro-batch; communication as thin grey bars under the boxes."""
    plt = pyplot()
    from matplotlib.patches import Patch

    start, end = step_span(timelines)
    chunks = max(t["virtual_stages"] for t in timelines)
    palettes = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges"),
                "W": plt.get_cmap("Greens")}

    def colour(op: str, chunk: int) -> Any:  # chunk 0 mid-tone, later chunks darker
        return palettes[op](0.45 + 0.4 * chunk / max(1, chunks - 1))

    longest = max(len(t["actions"]) for t in timelines)
    fig, ax = plt.subplots(figsize=(min(24, 6 + 0.15 * longest), 1.5 + 0.5 * len(timelines)))
    for row, t in enumerate(timelines):
        for a in t["actions"]:
            x, w = a["start"] - start, a["end"] - a["start"]
            if a["op"] in COMPUTE:
                ax.barh(row, w, left=x, height=0.7, color=colour(a["op"], a.get("chunk", 0)),
                        edgecolor="black", linewidth=0.4)
                ax.text(x + w / 2, row, str(a["mb"]), ha="center", va="center", fontsize=6)
            else:
                ax.barh(row + 0.42, w, left=x, height=0.1, color="grey")
    ax.set(yticks=range(len(timelines)), xlim=(0, end - start), xlabel="seconds from step start",
           yticklabels=[f"rank {t['rank']} / stage {t['stage']}" for t in timelines],
           title=title)
    ax.invert_yaxis()
    darker = " (darker: later chunks)" if chunks > 1 else ""
    ax.legend(handles=[Patch(color=colour("F", 0), label="forward" + darker),
                       Patch(color=colour("B", 0), label="backward" + darker),
                       Patch(color="grey", label="send / recv")],
              loc="upper center", bbox_to_anchor=(0.5, -0.6 / len(timelines) - 0.12),
              ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    save_png(fig, path)


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records ([] without the file)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_summary(records: list[dict[str, Any]]) -> str | None:
    """One line from metrics.jsonl's records: steps, final loss, mean tokens/s after the
    first step (which pays for warm-up)."""
    if not records:
        return None
    timed = records[1:] or records
    tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
    return (f"metrics: {records[-1]['step']} steps, final loss {records[-1]['loss']:.4f}, "
            f"{tokens_per_s:.0f} tokens/s (mean of {len(timed)} steps)")


def report(run_dir: Path, out: TextIO | None = None) -> Path | None:
    """Print the bubble table (and the metrics line) to `out` (stdout) and draw the chart;
    returns its path. A run without a pipeline (parallel.pp = 1) has no schedule to draw
    nor bubble to measure (its one stage is busy the whole step): only the metrics line
    and the per-rank table, and None."""
    out = out or sys.stdout
    groups = sorted(run_dir.glob("replica_*/"))  # fault.mode=replicas: one dir per group
    if groups and not (run_dir / "metrics.jsonl").exists():
        for group in groups:
            print(f"== {group.name}", file=out)
            report(group, out)
        return None
    timelines = load_timelines(run_dir)
    first = timelines[0]
    if first["pp"] == 1:
        print(f"no pipeline (parallel.pp=1, {len(timelines)} rank(s)): no schedule or bubble "
              "to draw; train with parallel.pp > 1 to see one", file=out)
        _print_metrics(run_dir, out)
        return None
    measured = measured_bubbles(timelines)
    mean = mean_bubble(timelines)
    start, end = step_span(timelines)
    formula = formula_bubble(first)
    v = f", v={first['virtual_stages']}" if first["virtual_stages"] > 1 else ""
    layout = (f"{first['schedule']} schedule, p={first['pp']}, m={first['microbatches']}{v}, "
              f"step {first['step']}")
    print(f"{layout}: span {end - start:.4f} s", file=out)
    print(f"{'rank':>5} {'stage':>5} {'busy s':>9} {'bubble':>8}", file=out)
    for t in timelines:
        print(f"{t['rank']:>5} {t['stage']:>5} {busy_seconds(t):>9.4f} "
              f"{measured[t['rank']]:>8.1%}", file=out)
    # the simulator's (plan/schedule_terms.py), which is this form for the first three
    form = {"interleaved": "(p-1)/(v m+p-1)", "gpipe": "(p-1)/(m+p-1)",
            "1f1b": "(p-1)/(m+p-1)"}.get(first["schedule"], "simulated at F=1 B=2 W=1")
    print(f"bubble fraction: measured {mean:.1%} (mean over ranks), formula {form} = "
          f"{formula:.1%}", file=out)
    for line in simulated_lines(timelines):
        print(line, file=out)
    _print_metrics(run_dir, out)
    png = run_dir / "timeline.png"
    plot_timeline(timelines, png, title=f"{layout}: bubble {mean:.1%} measured, "
                                        f"{formula:.1%} formula")
    print(f"timeline: {png}", file=out)
    return png


def _print_metrics(run_dir: Path, out: TextIO) -> None:
    records = load_metrics(run_dir / "metrics.jsonl")
    summary = metrics_summary(records)
    if summary:
        print(summary, file=out)
    for line in pace_table(records):  # per-rank compute and wait, stragglers (pace.py)
        print(line, file=out)
    for line in moe_lines(records):  # mixture of experts: the balance per layer
        print(line, file=out)
    if plot_moe_balance(records, run_dir / "moe_balance.png"):
        print(f"expert balance: {run_dir / 'moe_balance.png'}", file=out)
    for line in replica_lines(records):  # replica groups: quorum changes (replica_chart.py)
        print(line, file=out)
    if plot_replica_loss(records, run_dir / "replica_loss.png"):
        print(f"loss and replica events: {run_dir / 'replica_loss.png'}", file=out)
