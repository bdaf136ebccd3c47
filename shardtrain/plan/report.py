"""Human-readable planner output: aligned plain-text tables."""

from __future__ import annotations

from typing import Any

from shardtrain.plan.evaluate import Plan, model_summary
from shardtrain.plan.search import SearchResult

GB = 1e9


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [headers] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) or row[i] == "" for row in rows)
               for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w)
                         for c, w, n in zip(row, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])]
                     + [line(r) for r in cells[1:]])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def header(plan: Plan) -> str:
    summary = model_summary(plan.cfg, plan.seq_len, plan.name, plan.layout.recompute)
    closed = summary["params_closed_form"]
    closed_text = f"; closed form {closed:,.0f}" if closed else ""
    return (f"model {plan.name or '(file)'} ({plan.cfg.style}): {summary['params']:,} params "
            f"({summary['params_non_embedding']:,} non-embedding{closed_text}); "
            f"{summary['flops_per_token']:.4g} FLOP/token (6N: "
            f"{summary['flops_per_token_6n']:.4g})\n"
            f"cluster {plan.layout.gpus} x {plan.hw.name} ({plan.hw.node_size(plan.layout.gpus)}"
            f" per node); global batch {plan.global_batch} x {plan.seq_len} tokens = "
            f"{plan.tokens:,} tokens per step")


def details(plan: Plan, *, tokens: float | None = None,
            measured_step_s: float | None = None) -> str:
    doc = plan.to_dict(tokens=tokens, measured_step_s=measured_step_s)
    mem = doc["memory_per_gpu_bytes"]
    names = ["params", "grads", "optimizer", "master", "activations", "buffers", "total"]
    parts = [f"layout {plan.layout.describe()} ({plan.layout.precision})", "",
             "memory per GPU (GB)",
             table(names + ["usable", "offloaded"],
                   [[mem[n] / GB for n in names] + [mem["usable"] / GB, mem["offloaded"] / GB]]),
             "", "communication per step (one rank)",
             table(["group", "op", "ranks", "algorithm", "calls", "MB/call", "GB sent", "time s",
                    "overlap"],
                   [[o.group, o.op + (f" {o.what}" if o.what else ""), o.ranks, o.algorithm,
                     o.calls, o.message_bytes / 1e6,
                     o.bytes_sent / GB, o.time_s, o.overlap] for o in plan.ops]
                   or [["-", "none", 1, "-", 0, 0.0, 0.0, 0.0, "-"]]),
             "", roofline(plan), "", "time per step"]
    t = plan.time
    rows = [["predicted", t.step_s, t.compute_s, t.exposed_comm_s, t.bubble_fraction,
             t.tokens_per_s, t.mfu, t.hfu]]
    if measured_step_s is not None:
        m = doc["measured"]
        rows.append(["measured", m["step_s"], None, None, None, m["tokens_per_s"], m["mfu"],
                     m["hfu"]])
    parts.append(table(["", "step s", "compute s", "exposed comm s", "bubble", "tokens/s",
                        "MFU", "HFU"], [[c if c is not None else "" for c in r] for r in rows]))
    if tokens is not None:
        parts.append(f"\n{tokens:,.0f} tokens take {doc['training_days']:,.3g} days at the "
                     "predicted rate"
                     + (f", {doc['measured']['training_days']:,.3g} at the measured one"
                        if measured_step_s is not None else ""))
    return "\n".join(parts)


def roofline(plan: Plan) -> str:
    """One rank's ops at max(FLOPs / achievable rate, bytes / memory bandwidth), and the
    step's compute-bound and memory-bound seconds."""
    hw, t = plan.hw, plan.time
    ridge = hw.flops(plan.layout.precision) * hw.efficiency / hw.memory_bw
    rows = [[o.name, o.flops / GB, o.bytes / GB, o.intensity, o.time_s, o.bound]
            for o in plan.roof]
    share = t.memory_bound_s / (t.compute_bound_s + t.memory_bound_s)
    return "\n".join([
        f"roofline per step (one rank; ridge {ridge:,.3g} FLOP/byte = peak x efficiency / "
        "memory bandwidth)",
        table(["op", "GFLOP", "GB moved", "FLOP/byte", "time s", "bound"], rows),
        f"compute-bound {t.compute_bound_s:,.4g} s, memory-bound {t.memory_bound_s:,.4g} s "
        f"({share:.1%} of compute + optimizer)"])


def ranking(result: SearchResult) -> str:
    rows = [[i + 1, p.layout.describe(), p.time.step_s, p.time.tokens_per_s, p.time.mfu,
             p.memory.total / GB] for i, p in enumerate(result.ranked)]
    text = [f"ranked layouts ({result.considered:,} considered, {result.rejected_total:,} do "
            f"not fit, {result.refused:,} refused by the trainer's config validation)", table(["#", "layout", "step s", "tokens/s", "MFU", "GB/GPU"], rows)]
    if result.rejected:
        text += ["", "closest rejected",
                 table(["layout", "why"], [[r.layout.describe(), r.reason]
                                          for r in result.rejected])]
    return "\n".join(text)
