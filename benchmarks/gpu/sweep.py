"""Part 2 of the GPU check: every feature of a one-GPU run, in one process, on the tiny preset.

    python benchmarks/gpu/sweep.py --device cuda --rows ROWS.jsonl [--cache DIR] [--only NAME]

Each row is one configuration (ROWS) and three trainers of it:

1. A trains 8 steps, saving at steps 4 and 8 asynchronously, then evaluates and samples;
2. B resumes A's step-4 checkpoint and trains to step 8, saving synchronously: its step 5
   (a forward of the restored weights on the restored sampler's batch) equals A's, and its
   eval loss A's within 1% (a GPU's backward kernels with atomics are not bitwise
   deterministic; on a CPU they agree exactly);
3. C loads B's step-8 checkpoint and evaluates: B's eval loss, exactly.

The row: ok, or the exception in one line; A's last loss, eval loss, median ms per step,
MFU, peak memory allocated and reserved. On a CPU (`--device cpu`) the same rows are the
twin of the GPU's (compile through harness.COMPILE_BACKEND).
"""

from __future__ import annotations

import gc
import math
import tempfile
from pathlib import Path

from harness import compile_backend, figures, one_process, part_main, run_config

BF16 = ("--train.precision", "bf16")
ROWS: dict[str, tuple[str, ...]] = {
    "ddp fp32": ("--train.precision", "fp32"),
    "ddp bf16": BF16,
    "ddp fp16": ("--train.precision", "fp16"),
    "zero1 bf16": (*BF16, "--parallel.zero", "1"),
    "zero2 bf16": (*BF16, "--parallel.zero", "2"),
    "zero3 bf16": (*BF16, "--parallel.zero", "3"),
    "zero3 cpu offload": (*BF16, "--parallel.zero", "3", "--parallel.offload", "cpu"),
    "zero3 nvme offload": (*BF16, "--parallel.zero", "3", "--parallel.offload", "nvme"),
    "full recompute": (*BF16, "--train.activation_checkpointing", "full"),
    "selective recompute": (*BF16, "--train.activation_checkpointing", "selective"),
    "document mask": (*BF16, "--data.document_mask", "true"),
    "moe grouped": (*BF16, "--model.n_experts", "4", "--model.moe_impl", "grouped"),
    "moe looped": (*BF16, "--model.n_experts", "4", "--model.moe_impl", "loop"),
    "lora": (*BF16, "--lora.rank", "8"),
    "qlora": (*BF16, "--lora.rank", "8", "--lora.quantize_base", "nf4"),
    "8-bit adam": (*BF16, "--optim.name", "adamw8bit"),
    "compile": (*BF16, "--train.compile", "true"),  # last: the slowest to start
}
STEPS, SAVE_EVERY = 8, 4


def _config(device, run_dir: Path, overrides: tuple[str, ...], cache: str | None, *more: str):
    nvme = []
    if "nvme" in overrides:  # the offload files' directory must exist (config/offload_files.py)
        (run_dir / "nvme").mkdir(parents=True, exist_ok=True)
        nvme = ["--parallel.offload_dir", str(run_dir / "nvme")]
    return run_config("tiny", run_dir, device, "--train.steps", str(STEPS),
                      "--checkpoint.every", str(SAVE_EVERY), "--train.eval_every", "0",
                      "--train.sample_tokens", "16", "--train.log_every", "100",
                      *overrides, *nvme, *more, cache_dir=cache)


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel)


def row(device, overrides: tuple[str, ...], tmp: Path, cache: str | None) -> dict:
    """One row's three trainers (module docstring); its figures, or an AssertionError
    saying which property failed."""
    a = one_process(_config(device, tmp / "a", overrides, cache, "--checkpoint.async_save",
                            "true"), device)
    first = a.run()
    del a
    gc.collect()
    bad = [r["step"] for r in first.history if not r["skipped"] and not math.isfinite(r["loss"])]
    assert not bad, f"non-finite losses at steps {bad}"
    assert first.sample, "no sample"
    step4 = tmp / "a" / "checkpoints" / f"step_{SAVE_EVERY:08d}"
    b = one_process(_config(device, tmp / "b", overrides, cache, "--checkpoint.resume",
                            str(step4)), device)
    resumed = b.run()
    del b
    gc.collect()
    got, want = resumed.history[0]["loss"], first.history[SAVE_EVERY]["loss"]
    assert _close(got, want, 1e-5), f"resumed step {SAVE_EVERY + 1}: loss {got} vs {want}"
    assert _close(resumed.eval_loss, first.eval_loss, 1e-2), \
        f"resumed eval loss {resumed.eval_loss} vs {first.eval_loss}"
    step8 = tmp / "b" / "checkpoints" / f"step_{STEPS:08d}"
    loaded = one_process(_config(device, tmp / "c", overrides, cache, "--checkpoint.resume",
                                 str(step8)), device).evaluate()
    assert _close(loaded, resumed.eval_loss, 1e-5), \
        f"eval of the synchronous checkpoint {loaded} vs {resumed.eval_loss}"
    return {**figures(first.history), "eval_loss": first.eval_loss}


def main() -> None:
    device, rows, args = part_main(__doc__, "sweep", cache=True, more=lambda p: p.add_argument(
        "--only", action="append", choices=list(ROWS), help="run these rows only"))
    with tempfile.TemporaryDirectory() as tmp, compile_backend(device):
        for i, name in enumerate(args.only or ROWS):
            rows.guarded(name, lambda: row(device, ROWS[name], Path(tmp) / str(i), args.cache))


if __name__ == "__main__":
    main()
