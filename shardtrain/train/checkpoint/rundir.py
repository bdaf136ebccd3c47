"""A run dir holds one run: the checkpoints under it are one line of saves, each newer than
the last, which `checkpoint.resume = latest`, a restart (`--max-restarts`), the end-of-run
sample and export, and the keep-newest rule can all rely on.

Before this (issue 39) a second run into a run dir that held another's checkpoints lost
its own: the keep-newest rule, by step number, removed each of its saves as soon as it was
committed (the other run's were numbered higher), and export and `latest` then took the
other run's weights. So, before anything is written (train/start/prepare.py), a run that
would add a second line of saves to a run dir is refused -- a fresh run into a dir that
holds checkpoints, or a resume from a checkpoint that is not that dir's newest -- naming
the choices: continue the dir's run (`--checkpoint.resume latest`), another
`train.run_dir`, or `--train.overwrite true`, which moves the earlier run aside to
`<run_dir>.old-N` (nothing is deleted) and starts the dir afresh.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardtrain.config import Config, ConfigError
from shardtrain.train.checkpoint.checkpoint import checkpoint_root, list_checkpoints


def run_dir_conflict(cfg: Config) -> str:
    """Why this run would mix with the checkpoints its run dir holds ("": it would not)."""
    run_dir, spec = Path(cfg.train.run_dir), cfg.checkpoint.resume
    found = list_checkpoints(checkpoint_root(run_dir))
    if spec == "latest" or not found:
        return ""
    held = f"{checkpoint_root(run_dir)} holds an earlier run's checkpoints ({_span(found)})"
    if not spec:
        return (f"train.run_dir={str(run_dir)!r}: {held}, and a new run's saves would mix "
                "with them. Continue that run with --checkpoint.resume latest, give another "
                "train.run_dir, or pass --train.overwrite true to move the earlier run to "
                f"{aside_name(run_dir)} (nothing is deleted)")
    resumed = Path(spec).absolute()
    if resumed.parent == checkpoint_root(run_dir).absolute():
        newer = [p for p in found if p.name > resumed.name]
        if not newer:
            return ""  # the dir's newest: its run goes on from there
        return (f"checkpoint.resume={spec!r} is older than that run dir's newest checkpoint "
                f"({newer[-1].name}), and this run's saves would mix with the newer ones: "
                "resume it into another train.run_dir (the checkpoint stays where it is), or "
                "continue the newest with --checkpoint.resume latest")
    return (f"train.run_dir={str(run_dir)!r}: {held}, and this run (resumed from {spec}) "
            "would mix its saves with them. Give another train.run_dir, continue that run "
            "with --checkpoint.resume latest, or pass --train.overwrite true to move the "
            f"earlier run to {aside_name(run_dir)} (nothing is deleted)")


def claim_run_dir(cfg: Config) -> bool:
    """Raise ConfigError if this run would mix with its run dir's checkpoints and
    `train.overwrite` does not allow moving them; True if they are to be moved aside
    (`move_run_aside`, once every other check has passed)."""
    conflict = run_dir_conflict(cfg)
    if not conflict:
        return False
    run_dir, spec = Path(cfg.train.run_dir).absolute(), cfg.checkpoint.resume
    moves_resumed = spec and Path(spec).absolute().is_relative_to(run_dir)
    if not cfg.train.overwrite or moves_resumed:
        if cfg.train.overwrite:  # it would move the checkpoint this run resumes from
            conflict += ("; train.overwrite would move the checkpoint this run resumes "
                         "from, so it does not apply here")
        raise ConfigError(conflict)
    return True


def aside_name(run_dir: Path) -> Path:
    """`<run_dir>.old-N`, the first N not taken."""
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    return aside


def move_run_aside(run_dir: str | Path) -> Path:
    """train.overwrite: the earlier run, moved whole to `<run_dir>.old-N`, with one line."""
    run_dir = Path(run_dir)
    aside = aside_name(run_dir)
    os.replace(run_dir, aside)
    print(f"train.overwrite: moved the earlier run in {run_dir} to {aside}", flush=True)
    return aside


def _span(found: list[Path]) -> str:
    return found[0].name if len(found) == 1 else f"{found[0].name} .. {found[-1].name}"
