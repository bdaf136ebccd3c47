"""Part 5 of the GPU check (its first half): `shardtrain train --dry-run-world 8` of Llama 3
8B at a short sequence on the GPU, its allocator's figures against the planner's.

    python benchmarks/gpu/dryrun.py --device cuda --rows ROWS.jsonl [--cache DIR]

Rank 0 of an 8-rank ZeRO-3 bf16 job (docs/planner.md, train/start/dryrun.py) is built and
stepped alone over torch's fake process group, through the CLI as a user runs it, so the
launch-time fits check (train/start/fits.py) runs first and refuses what the planner says
cannot fit. The row: the CUDA allocator's peak allocated and reserved, the last step's peak,
the planner's estimate and the exact model-state count, and the fits check's verdict (the
estimate against the card's memory). On a CPU (`--device cpu`) the tiny preset is the twin.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from harness import part_main
from shardtrain.cli import main as cli
from shardtrain.train.start.fits import rank_capacity

GIB = 2**30
PRESETS = {"cuda": "llama3-8b", "cpu": "tiny"}
LAYOUT = ("--parallel.zero", "3", "--train.precision", "bf16", "--train.seq_len", "1024",
          "--train.global_batch", "8", "--train.micro_batch", "1", "--train.steps", "2",
          "--data.max_bytes", "2000000")


def dry_run(device, run_dir: Path, cache: str | None) -> dict:
    argv = ["train", "--dry-run-world", "8", "--config", PRESETS[device.type],
            "--train.run_dir", str(run_dir), "--train.device", device.type, *LAYOUT,
            *(["--data.cache_dir", cache] if cache else [])]
    if device.type == "cpu":
        argv += ["--train.seq_len", "32", "--train.peak_flops", "1e12"]
    code = cli(argv)
    assert code == 0, f"shardtrain train --dry-run-world 8 exited {code} (the log says why)"
    report = json.loads((run_dir / "dry_run.json").read_text())
    m, e = report["measured"], report["planned_estimate"]
    capacity, _ = rank_capacity(device.type, 1)
    gib = {k: None if v is None else v / GIB for k, v in (
        ("peak_alloc_gib", m["peak_mem"]), ("peak_reserved_gib", m["peak_reserved"]),
        ("step_peak_gib", m["step_peak"]), ("planned_gib", e["total"]),
        ("capacity_gib", capacity))}
    return {"preset": PRESETS[device.type], **gib, "states_match_plan": report["match"],
            "fits": e["total"] <= capacity, "skipped_steps": report["skipped_steps"]}


def main() -> None:
    device, rows, args = part_main(__doc__, "dryrun", cache=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows.guarded(f"{PRESETS[device.type]} dry-run-world 8 zero3 bf16",
                     lambda: dry_run(device, Path(tmp) / "run", args.cache))


if __name__ == "__main__":
    main()
