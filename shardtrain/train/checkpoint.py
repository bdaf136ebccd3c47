"""Checkpoints: directories <run_dir>/checkpoints/step_NNNNNNNN, the last K kept.

Sharded and layout-independent: every rank writes what it holds (its model and optimizer
shards, as ckpt/files.py describes) into a hidden staging directory, the main rank merges
their indexes into manifest.json and renames the directory into place, so a crash never
leaves a half-written checkpoint where resume would find it (a directory without a
manifest is not a checkpoint). Beside the shards: meta.json (the step, the data sampler's
position -- a count of global batches, the same for any dp size -- and the layout that
wrote it), the resolved config (whose [model] section is checked on resume) and, for a
BPE run, a copy of the tokenizer, so `shardtrain generate` needs nothing but the checkpoint.

Any checkpoint resumes in any layout (parallel/pieces.py), except state that is one rank's
own: top-k update compression's optimizer state and residual (comm.compress=topk) and a
parameter server's (ps_server*.pt): their files (`stage_files`) resume only in the layout
that wrote them (`check_layout`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shardtrain import config as config_mod
from shardtrain.ckpt.files import MANIFEST, commit_manifest
from shardtrain.config import Config, ConfigError

_PREFIX = "step_"
TOKENIZER_FILE = "tokenizer.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(cfg: Config, step: int) -> Path:
    """Where every rank writes its part of the step's checkpoint before it is committed."""
    staged = checkpoint_root(cfg.train.run_dir) / f".staged-{_PREFIX}{step:08d}"
    staged.mkdir(parents=True, exist_ok=True)
    return staged


def clear_staging(cfg: Config) -> None:
    """Remove the staging and temporary directories a killed run left behind."""
    root = checkpoint_root(cfg.train.run_dir)
    for stale in [*root.glob(".staged-*"), *root.glob(".tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def stage_files(cfg: Config, step: int, files: dict[str, Any]) -> Path:
    """Write this rank's own state files ({file name: state}) into the staging directory."""
    staged = staging_dir(cfg, step)
    for name, state in files.items():
        torch.save(state, staged / name)
    return staged


def save_checkpoint(cfg: Config, *, step: int, staged: Path, world_size: int,
                    layout: dict[str, int], sampler_state: dict[str, Any],
                    tokenizer_file: Path | None = None) -> Path:
    """On the main rank, once every rank has staged its pieces and files: commit the
    manifest, then move the directory into place. `layout`: the layout that wrote it."""
    root = checkpoint_root(cfg.train.run_dir)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.replace(staged, tmp)
    (tmp / "meta.json").write_text(json.dumps({"step": step, "sampler": sampler_state,
                                               "layout": layout}, indent=1))
    (tmp / "config.toml").write_text(config_mod.to_toml(cfg))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
    commit_manifest(tmp, world_size)  # last: only now is the directory a checkpoint
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-cfg.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint directory `checkpoint.resume` names, or None; errors name the field."""
    spec = cfg.checkpoint.resume
    if not spec:
        return None
    if spec == "latest":
        found = list_checkpoints(checkpoint_root(cfg.train.run_dir))
        if not found:
            raise ConfigError(f"checkpoint.resume=latest: no checkpoint under "
                              f"{checkpoint_root(cfg.train.run_dir)}; train without resume first")
        return found[-1]
    path = Path(spec)
    if not (path / MANIFEST).is_file() or not (path / "meta.json").is_file():
        raise ConfigError(f"checkpoint.resume={spec!r} is not a checkpoint directory (it must "
                          f"hold {MANIFEST} and meta.json); give a step_* directory or 'latest'")
    return path


def check_files(path: Path) -> None:
    """Every shard file the manifest lists is there at its recorded size: a truncated
    checkpoint (a crash, a full disk) is refused before launch. Checksums are checked
    when the shards are read (ckpt/files.py Reader)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / MANIFEST}: not a readable checkpoint manifest ({e}); "
                          "resume from another checkpoint") from None
    for name, want in files.items():
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size != want["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise ConfigError(f"{file}: {found}, the manifest says {want['bytes']}; the "
                              "checkpoint is truncated: resume from another one")


def resume_after_restart(cfg: Config, restarts: int) -> Config:
    """The config a restarted job runs (`restarts` > 0: the launcher's count): it resumes
    from the newest checkpoint in its run dir, written by an earlier attempt (a
    checkpoint is complete once renamed into place, so the newest is valid); with none
    yet, it starts as the first attempt did."""
    if restarts == 0 or not list_checkpoints(checkpoint_root(cfg.train.run_dir)):
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="latest"))


def checkpoint_config(path: Path) -> Config:
    return config_mod.load(path / "config.toml")


def check_compatible(path: Path, cfg: Config, world_size: int) -> None:
    """Resume must not change the model's shape, nor the layout of a sharded optimizer
    state; say which fields differ."""
    check_layout(path, cfg, world_size)
    saved = dataclasses.asdict(checkpoint_config(path).model)
    wanted = dataclasses.asdict(cfg.model)
    diff = [f"model.{k}: checkpoint {saved[k]!r} vs config {wanted[k]!r}"
            for k in saved if saved[k] != wanted[k]]
    if diff:
        raise ConfigError(f"cannot resume from {path}: the model shape differs ("
                          + "; ".join(diff) + "); use the checkpoint's model settings or "
                          "start a new run without checkpoint.resume")


def check_layout(path: Path, cfg: Config, world_size: int) -> None:
    """State that is one rank's own resumes only in the layout that wrote it: top-k's
    (comm.compress=topk: each dp rank's optimizer state and residual) needs the same
    layout, a parameter server's servers on both sides (their count may change). Every
    other checkpoint resumes in any layout."""
    meta = json.loads((path / "meta.json").read_text())
    p = cfg.parallel
    saved_ps = meta.get("layout", {}).pop("ps_servers", 0)
    if bool(saved_ps) != bool(p.ps_servers):
        raise ConfigError(
            f"cannot resume from {path}: it was written with parallel.ps_servers={saved_ps} "
            f"and this run has parallel.ps_servers={p.ps_servers}; a parameter server's "
            "optimizer state lives in its ps_server*.pt files, the other layouts' in the "
            "shards: resume with parallel.ps_servers > 0 if and only if the checkpoint had "
            "servers (their count may change)")
    saved = {"zero": 0, "cp": 1, "ep": 1, **meta.get("layout", {}),
             "topk": checkpoint_config(path).comm.compress == "topk"}
    wanted = {"zero": p.zero, "pp": p.pp, "dp": p.resolved_dp(world_size), "tp": p.tp,
              "cp": p.cp, "ep": p.ep, "topk": cfg.comm.compress == "topk"}
    if not saved["topk"] and not wanted["topk"] or saved == wanted:
        return
    saved_text, wanted_text = map(_describe, (saved, wanted))
    raise ConfigError(
        f"cannot resume from {path}: its optimizer state was written by {saved_text} and "
        f"this run has {wanted_text}; the per-rank optimizer state and residual of "
        "comm.compress=topk resume only in the layout that wrote them. Resume with the "
        "checkpoint's layout (the same parallel.zero, pp, dp, cp and tp, with --nproc to "
        "match, and comm.compress=topk), or start a new run without checkpoint.resume")


def _describe(layout: dict) -> str:
    dims = ", ".join(f"parallel.{k}={v}" for k, v in layout.items() if k != "topk")
    return dims + (", comm.compress=topk" if layout["topk"] else ", no comm.compress=topk")


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json: the step, the sampler position and the layout that wrote the checkpoint."""
    return json.loads((path / "meta.json").read_text())


def load_state(path: Path, name: str) -> dict[str, Any]:
    """One of a rank's own state files (top-k's optimizer file, a parameter server's)."""
    return torch.load(path / name, map_location="cpu", weights_only=True)
