"""The step record as the console prints it."""

from __future__ import annotations

from typing import Any


def format_record(r: dict[str, Any]) -> str:
    line = (f"step {r['step']:>6}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
            f"grad_norm {r['grad_norm']:.3f}  tok/s {r['tokens_per_s']:.0f}  mfu "
            + ("n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"))
    if r.get("committed") is False:  # parallel.replicas: torchft's commit refused it
        line += "  not applied (a replica group failed inside the step)"
    elif r.get("bad_step"):
        line += "  skipped (loss or gradients not finite)"
    elif r.get("skipped"):
        line += f"  skipped (gradients not finite at loss scale {r['loss_scale']:g})"
    if "eval_loss" in r:
        line += f"  eval_loss {r['eval_loss']:.4f}"
        if "eval_perplexity" in r:
            line += f"  eval_ppl {r['eval_perplexity']:.2f}"
    return line
