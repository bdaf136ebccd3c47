"""`shardtrain train | generate | plan | bench | report | schedule`.

Everything that can be checked before a process starts is checked here, in the launching
process: the config, the data source, the run dir, the checkpoint to resume from. A bad
input ends with a message naming the field or file and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardtrain import config as config_mod
from shardtrain.config import Config, ConfigError
from shardtrain.train.start.prepare import prepare_run

USAGE = """shardtrain train [--config FILE.toml|PRESET] [--nproc N] [--section.field VALUE ...]
shardtrain train --dry-run-world N [...]           (rank 0 of an N-rank job, alone: its memory)
shardtrain generate --checkpoint DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
                                                   (DIR: a checkpoint or a Hugging Face directory)
shardtrain export --checkpoint DIR --out DIR [--adapters-only]   (a Hugging Face directory)
shardtrain plan --model PRESET|FILE.toml [...]     (shardtrain plan --help)
shardtrain bench comm [--nproc N] [...]            (time every collective and algorithm)
shardtrain bench calibrate                         (measure this machine for the cpu preset)
shardtrain report RUN_DIR                          (pipeline timeline chart and bubble fraction)
shardtrain schedule --schedule S --pp P --microbatches M [--virtual V] [--costs F,B,W] [--json]
                                                   (a pipeline schedule drawn, its bubble)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    commands = {"train": cmd_train, "generate": cmd_generate, "plan": cmd_plan, "bench": cmd_bench,
                "report": cmd_report, "export": cmd_export, "schedule": cmd_schedule}
    if command not in commands:
        print(f"shardtrain: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except ConfigError as e:
        print(f"shardtrain {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before training started (or outside `train`)
        print(f"shardtrain {command}: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------- train


def cmd_train(argv: list[str]) -> int:
    presets = ", ".join(config_mod.preset_names())
    parser = argparse.ArgumentParser(
        prog="shardtrain train", epilog="config fields:\n" + "\n".join(config_mod.field_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default",
                        help=f"a TOML file or a preset: {presets} (default: default)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to launch (default: 1, or the launcher's world)")
    parser.add_argument("--dry-run-world", type=int, default=0, metavar="N",
                        help="run rank 0 of an N-rank job alone over a fake process group "
                             "and print its memory next to the planner's (docs/planner.md)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the job up to K times after a worker dies, resuming "
                             "from the newest checkpoint (under torchrun: its --max-restarts)")
    args, overrides = parser.parse_known_args(argv)
    cfg = config_mod.load(args.config, overrides)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be >= 1 (the local processes to start); "
                          "leave it out for one")
    if args.dry_run_world:
        return dry_run(cfg, args.dry_run_world, nproc=args.nproc)

    from shardtrain.launch import ProcessInfo, launch_local, run_worker, under_launcher

    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
    replicas = cfg.fault.mode == "replicas"  # a restarted group heals from a peer, not disk
    if args.max_restarts and cfg.checkpoint.keep < 2 and not replicas:
        raise ConfigError(f"--max-restarts {args.max_restarts} needs checkpoint.keep >= 2 (it "
                          f"is {cfg.checkpoint.keep}): a restart falls back past a checkpoint "
                          "the crash left unusable only if an older one is kept")
    if under_launcher():
        if args.max_restarts:
            raise ConfigError("--max-restarts under torchrun: the launcher restarts the job; "
                              "give torchrun --max-restarts instead")
        info = ProcessInfo.from_env()
        if args.nproc and args.nproc != info.local_world_size:
            raise ConfigError(f"--nproc {args.nproc} conflicts with the launcher's "
                              f"{info.local_world_size} processes per node; drop --nproc")
        from shardtrain.config.replicas import total_world
        from shardtrain.train.checkpoint.checkpoint import resume_after_restart
        from shardtrain.train.guard import restart_count

        # torchrun runs this command again for each restart: it resumes this job's run.
        if not replicas:  # fault.mode=replicas: a restarted group heals from a live peer
            cfg = resume_after_restart(cfg, restart_count())
        else:  # one torchrun per group: this group's run dir and inject_kill
            from shardtrain.launch_replicas import group_config
            from shardtrain.parallel.replica.torchft_group import replica_from_env

            cfg = group_config(cfg, replica_from_env(cfg), total_world(cfg, info.world_size))
        prepare_run(cfg, total_world(cfg, info.world_size), prepare_data=info.local_rank == 0,
                    local_ranks=info.local_world_size, main=info.rank == 0)
        return _exit_status(run_worker(config_mod.to_toml(cfg)))
    nproc = args.nproc or 1
    run_dir = Path(cfg.train.run_dir)
    fresh = not run_dir.exists()
    if replicas:  # R groups of nproc / R, each its own launch, and a lighthouse
        from shardtrain.launch_replicas import launch_groups

        return launch_groups(cfg, nproc, max_restarts=args.max_restarts)
    prepare_run(cfg, nproc, prepare_data=True, local_ranks=nproc)
    if nproc == 1 and not args.max_restarts:  # in this process; restarts need a launcher
        try:
            return _exit_status(run_worker(config_mod.to_toml(cfg)))
        except ConfigError:  # found at start (a corrupt shard's checksum): leave nothing
            if fresh and run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
            raise
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardtrain.train.checkpoint.agree import EXIT_CODE as SAVE_FAILED_EXIT
    from shardtrain.train.checkpoint.interrupt import EXIT_CODES, exit_code

    try:
        results = launch_local(nproc, run_worker, config_mod.to_toml(cfg),
                               max_restarts=args.max_restarts,
                               shutdown_timeout_s=max(30.0, cfg.comm.timeout_s))
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if len(codes) == 1 and codes <= {*EXIT_CODES, SAVE_FAILED_EXIT}:
            return codes.pop()  # a signal (they saved) or a failed save: rank 0 said so
        print(f"shardtrain train: a worker failed:\n{e}", file=sys.stderr)
        return 1
    except SignalException as e:  # the workers saved and said where (train/checkpoint/interrupt.py)
        return exit_code(e.sigval)
    return _exit_status(results.get(0, {}))


def _exit_status(result: dict) -> int:
    """0; 130 / 143 when a SIGINT / SIGTERM stopped the run (train/checkpoint/interrupt.py);
    74 when a checkpoint could not be written (train/checkpoint/agree.py)."""
    from shardtrain.train.checkpoint.interrupt import exit_code

    if result.get("interrupted"):
        return exit_code(result["interrupted"])
    return result.get("exit_code", 0)


def dry_run(cfg: Config, world_size: int, *, nproc: int) -> int:
    """`--dry-run-world N`: one process, rank 0's share of the N-rank layout (train/start/dryrun.py)."""
    from shardtrain.launch import ProcessInfo, check_device, pick_device, under_launcher
    from shardtrain.train.start.dryrun import check_dry_run, dry_run as run_dry

    if nproc or under_launcher():
        raise ConfigError("--dry-run-world runs one process standing for rank 0 of N: drop "
                          "--nproc and run it outside torchrun")
    check_dry_run(cfg, world_size)
    prepare_run(cfg, world_size, prepare_data=True, local_ranks=1, claim=False)
    device = pick_device(cfg.train.device, ProcessInfo(world_size=world_size))
    check_device(cfg, device)
    runtime = 0  # a GPU's allocator counts tensors alone; a CPU's resident set the runtime too
    if device.type == "cpu":
        from shardtrain.train.start.calibrate import runtime_base

        runtime = runtime_base().bytes  # measured once per machine and torch, then stored
    run_dry(cfg, world_size, device, runtime_bytes=runtime)
    return 0


# ---------------------------------------------------------------------------- generate


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain generate")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint step_* directory or a Hugging Face directory")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from shardtrain.data import load_tokenizer
    from shardtrain.data.tokenizer import BPETokenizer, prompt_ids
    from shardtrain.model.generate import generate

    path = Path(args.checkpoint)
    if (path / "config.json").is_file():  # a Hugging Face directory (shardtrain export's)
        from shardtrain.data.tokenizer import ByteTokenizer
        from shardtrain.model.hf import hf_tokenizer, load_hf

        model = load_hf(path)
        tok_file = hf_tokenizer(path)
        tokenizer = BPETokenizer(tok_file) if tok_file else ByteTokenizer()
    else:
        from shardtrain.train.finetune.export import checkpoint_tokenizer, load_checkpoint_model

        model, cfg = load_checkpoint_model(path)
        tokenizer = checkpoint_tokenizer(path, cfg) or load_tokenizer(cfg.data)
    out = generate(model, prompt_ids(tokenizer, args.prompt), args.tokens,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(tokenizer.decode(out[len(tokenizer.head):]))
    return 0


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardtrain export", description="Write a checkpoint as a Hugging Face directory "
        "(LoRA merged, NF4 dequantized; streamed, one module at a time), or its LoRA "
        "adapters alone.")
    parser.add_argument("--checkpoint", required=True, help="a <run_dir>/checkpoints/step_* dir")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--max-shard-mb", type=float, default=2048.0,
                        help="largest safetensors file; a bigger model is split, with an index")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--adapters-only", action="store_true",
                        help="write adapters.safetensors + adapter_config.json only")
    args = parser.parse_args(argv)
    import torch

    from shardtrain.train.finetune.export import export_checkpoint, load_checkpoint_model
    from shardtrain.train.finetune.finetune import save_adapters

    path = Path(args.checkpoint)
    if args.max_shard_mb <= 0:
        raise ConfigError(f"--max-shard-mb {args.max_shard_mb}: must be > 0")
    if args.adapters_only:
        model, cfg = load_checkpoint_model(path)
        if not cfg.lora.enabled:
            raise ConfigError(f"--adapters-only: {path} was trained without LoRA (lora.rank=0)")
        print(save_adapters(model, cfg, args.out))
        return 0
    print(export_checkpoint(path, args.out, dtype=getattr(torch, args.dtype),
                            max_shard_bytes=int(args.max_shard_mb * 2**20)))
    return 0


# ---------------------------------------------------------------------------- plan, bench


def cmd_plan(argv: list[str]) -> int:
    from shardtrain.plan.cli import main as plan_main

    return plan_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from shardtrain.bench import main as bench_main

    return bench_main(argv)


def cmd_schedule(argv: list[str]) -> int:
    from shardtrain.parallel.pipeline.show import main as schedule_main

    return schedule_main(argv)


def cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardtrain report",
        description="Draw a pipeline run's schedule (<run_dir>/timeline.png) and print its "
                    "measured bubble fraction next to the formula; for any run, its metrics "
                    "summary and each rank's compute and wait seconds.")
    parser.add_argument("run_dir", help="the train.run_dir of a run with parallel.pp > 1")
    args = parser.parse_args(argv)
    from shardtrain.train.observe.report import report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run dir {str(run_dir)!r} does not exist; pass a train.run_dir")
    report(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
