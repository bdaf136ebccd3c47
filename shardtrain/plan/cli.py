"""`shardtrain plan`: predict memory, communication and step time for a model on a cluster.

With --layout, evaluate that layout; without, search and rank the layouts that fit.
Exit codes: 0 success; 2 bad input (unknown preset or field, a layout that cannot run or
does not fit, a model that fits nowhere), with the reason on stderr. A layout that does not
fit, or a model that fits nowhere, is still reported (the document with `fits: false`, an
empty `ranked`, the closest layout's counts, memory, traffic and time, and `reason`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from shardtrain.config import ConfigError, load, parse_overrides, read_toml, resolve_preset
from shardtrain.cost import hardware
from shardtrain.plan import report
from shardtrain.plan.evaluate import CONVENTIONS, Plan, evaluate
from shardtrain.plan.goodput import goodput_text, plan_goodput
from shardtrain.plan.layout import PlanError, check, planned_attention, trainer_refusal
from shardtrain.plan.layout_checks import PRECISIONS, SYNCS
from shardtrain.plan.layout_text import parse_layout
from shardtrain.plan.search import advice, search, shortfall

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PlanError(message)


def _count(text: str) -> float:
    """300e9, 300B, 2T, 1.5M."""
    scale = _SUFFIX.get(text[-1:].lower(), 1.0)
    try:
        return float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 300e9 or 300B") from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shardtrain plan", description=__doc__.split("\n")[0],
                epilog="Model fields: --model.FIELD VALUE; hardware figures: --hw.FIELD VALUE; "
                       "the data fields a layout depends on, e.g. --data.document_mask true.")
    p.add_argument("--model", required=True, help="preset name or FILE.toml")
    p.add_argument("--gpus", type=int, help="devices (default: one node)")
    p.add_argument("--gpu", default="a100", help=f"device kind: {', '.join(hardware.NAMES)}")
    p.add_argument("--gpus-per-node", type=int, help="override the preset's node size")
    p.add_argument("--global-batch", type=int,
                   help="sequences per step (default: the preset's train.global_batch, else "
                        "2^22 tokens / seq)")
    p.add_argument("--seq", type=int, help="sequence length (default: train.seq_len, else "
                                           "model.max_seq_len)")
    p.add_argument("--tokens", type=_count, help="token budget: report training days")
    p.add_argument("--step-time", type=float, help="a measured step time, for MFU / HFU")
    p.add_argument("--layout", help="dp=..,tp=..,pp=..,cp=..,ep=..,zero=..,recompute=..,sp=..,"
                                    "microbatches=..,schedule=..,v=..,offload=..,precision=..")
    p.add_argument("--precision", choices=PRECISIONS, help="default: the device's")
    p.add_argument("--top", type=int, default=5, help="layouts to show when searching")
    p.add_argument("--zeropp", action="store_true",
                   help="the search tries ZeRO++ too (qwz/hpz/qgz: int8 weights and gradients, "
                        "whose accuracy cost the planner does not price)")
    p.add_argument("--calibration", help="cpu calibration JSON (default ~/.cache/shardtrain/"
                                         "cpu_calibration.json)")
    p.add_argument("--replicas", type=int, help="replica groups dp splits into "
                   "(parallel.replicas; the search's layouts too)")
    p.add_argument("--sync", choices=SYNCS, help="what crosses the groups (parallel.sync)")
    p.add_argument("--sync-every", type=int, help="H, steps between syncs (parallel.sync_every)")
    p.add_argument("--sync-fragments", type=int, help="F (parallel.sync_fragments)")
    p.add_argument("--mtbf-hours", type=float, help="one process's mean time between failures: "
                   "report goodput under fault.mode restart and replicas")
    p.add_argument("--restart-s", type=float, default=60.0,
                   help="seconds from a failure to training again, before loading (default 60)")
    p.add_argument("--checkpoint-every", type=int, help="steps between saves under restart "
                   "(default: the preset's checkpoint.every, else Young's interval)")
    p.add_argument("--save-s", type=float, help="seconds a save blocks training (default: one "
                   "rank's state at the node's storage bandwidth)")
    p.add_argument("--load-s", type=float, help="seconds a resume's load takes (same default)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def main(argv: list[str]) -> int:
    try:
        return _run(argv)
    except ConfigError as e:
        print(f"shardtrain plan: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)


def _run(argv: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    model_overrides, hw_overrides = [], {}
    for key, value in parse_overrides(rest):
        section, _, field = key.partition(".")
        if section in ("model", "data"):
            model_overrides += [f"--{key}", value]
        elif section == "hw":
            hw_overrides[field] = value
        else:
            raise PlanError(f"unexpected option --{key}; the planner takes --model.FIELD, "
                            "--data.FIELD and --hw.FIELD overrides")
    full = load(args.model, model_overrides)
    cfg, data = full.model, full.data  # data: what the run asks of a layout (document_mask)
    cfg.validate()
    data.validate()
    if args.gpus_per_node is not None:
        hw_overrides["gpus_per_node"] = str(args.gpus_per_node)
    gpus = args.gpus or args.gpus_per_node or hardware.get(args.gpu).gpus_per_node or 1
    hw = hardware.get(args.gpu, hw_overrides, calibration_path=args.calibration, processes=gpus)
    train = read_toml(resolve_preset(args.model)).get("train", {})
    seq = args.seq or train.get("seq_len") or cfg.max_seq_len
    batch = args.global_batch or train.get("global_batch") or max(1, 2 ** 22 // seq)
    for name, value in (("--gpus", gpus), ("--seq", seq), ("--global-batch", batch),
                        ("--top", args.top)):
        if value < 1:
            raise PlanError(f"{name}={value} must be positive")
    if seq > cfg.max_seq_len:
        raise PlanError(f"--seq {seq} exceeds model.max_seq_len={cfg.max_seq_len}")
    precision = args.precision or hw.default_precision
    name = str(args.model)
    measured = args.step_time
    replica = {k: v for k, v in (("replicas", args.replicas), ("sync", args.sync),
                                 ("sync_every", args.sync_every),
                                 ("sync_fragments", args.sync_fragments)) if v is not None}
    if args.layout is not None:  # the layout text's own replica keys win over the flags
        layout = parse_layout(",".join(f"{k}={v}" for k, v in replica.items()) + "," + args.layout, gpus=gpus, global_batch=batch, precision=precision,
                              attention=planned_attention(cfg, precision))
        check(layout, cfg, gpus=gpus, node_size=hw.node_size(gpus), global_batch=batch,
              seq_len=seq)
        plan = evaluate(cfg, layout, hw, global_batch=batch, seq_len=seq, name=name)
        doc: dict[str, Any] = plan.to_dict(tokens=args.tokens, measured_step_s=measured)
        refusal = trainer_refusal(layout, cfg, seq_len=seq, data=data)
        reason = "" if plan.fits else (
            f"layout {layout.describe()} {shortfall(plan.memory, hw)}. "
            + advice(cfg, layout, hw, seq_len=seq, gpus=gpus, global_batch=batch,
                     memory=plan.memory, data=data))
        doc |= {"fits": plan.fits, "reason": reason, "trainer_refuses": refusal}
        text = report.header(plan) + "\n\n" + report.details(plan, tokens=args.tokens,
                                                             measured_step_s=measured)
        if refusal:
            text += f"\n\nthe trainer refuses this layout: {refusal}"
        doc, text = _with_goodput(args, plan, doc, text, full.checkpoint.every or None)
        _emit(args.json, doc, text)
        if not plan.fits:  # reported above; the exit code and stderr say it too
            raise PlanError(reason)
        return 0
    result = search(cfg, hw, gpus=gpus, global_batch=batch, seq_len=seq, name=name, top=args.top,
                    precision=precision, data=data, zeropp=args.zeropp, replica=replica)
    doc = {}
    if result.ranked or result.closest:
        best = result.ranked[0] if result.ranked else result.closest
        doc = best.to_dict(tokens=args.tokens, measured_step_s=measured)
    doc |= {"fits": bool(result.ranked), "reason": result.reason}
    doc["ranked"] = [p.to_dict(tokens=args.tokens, measured_step_s=measured)
                     for p in result.ranked]
    doc["rejected"] = [{"layout": r.layout.to_dict() | {"text": r.layout.describe()},
                        "reason": r.reason, "memory_per_gpu_bytes": r.memory.to_dict()}
                       for r in result.rejected]
    doc["search"] = {"considered": result.considered, "rejected_total": result.rejected_total,
                     "refused_by_config": result.refused}
    if result.ranked:
        text = "\n\n".join([report.header(best), report.ranking(result), "best: " +
                             report.details(best, tokens=args.tokens, measured_step_s=measured)])
    else:  # nothing fits: what was computed for the closest layout, then the reason
        text = "\n\n".join(filter(None, [
            report.header(best) if result.closest else "", report.ranking(result),
            "closest: " + report.details(best, tokens=args.tokens, measured_step_s=measured)
            if result.closest else "", "fits: no (why: below)"]))
    if result.ranked or result.closest:
        doc, text = _with_goodput(args, best, doc, text, full.checkpoint.every or None)
    _emit(args.json, doc, text)
    if not result.ranked:
        raise PlanError(result.reason)
    return 0


def _with_goodput(args: argparse.Namespace, plan: Plan, doc: dict[str, Any], text: str,
                  checkpoint_every: int | None) -> tuple[dict[str, Any], str]:
    """With --mtbf-hours: the layout's goodput under both fault modes (plan/goodput.py)."""
    if args.mtbf_hours is None:
        return doc, text
    for name in ("mtbf_hours", "restart_s", "save_s", "load_s", "checkpoint_every"):
        value = getattr(args, name)
        if value is not None and (value < 0 or name == "mtbf_hours" and value == 0):
            raise PlanError(f"--{name.replace('_', '-')}={value:g} must be "
                            f"{'positive' if name == 'mtbf_hours' else '>= 0'}")
    # the run's own interval, else (None) Young's
    every = args.checkpoint_every if args.checkpoint_every is not None else checkpoint_every
    good = plan_goodput(plan, mtbf_hours=args.mtbf_hours, restart_s=args.restart_s,
                        checkpoint_every=every, save_s=args.save_s, load_s=args.load_s)
    return doc | {"goodput": good}, text + "\n\n" + goodput_text(good)


def _emit(as_json: bool, doc: dict[str, Any], text: str) -> None:
    if as_json:
        print(json.dumps(doc | {"conventions": CONVENTIONS}, indent=1))
    else:
        print(text + "\n\nconventions: " + "; ".join(f"{k}: {v}" for k, v in CONVENTIONS.items()))
