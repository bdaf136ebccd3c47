"""Checkpoints: directories <run_dir>/checkpoints/step_NNNNNNNN, the last K kept.

Sharded and layout-independent, in PyTorch's distributed checkpoint format (ckpt/dcp.py):
every rank writes what it holds (its model and optimizer shards; chunks several ranks hold
are written once, spread over them) into a hidden staging directory; the main rank writes
DCP's `.metadata` and our side files and renames the directory into place. Beside the
tensors: shardtrain.json (the format, tied aliases, small state: the loss scaler, the
optimizer's step count), meta.json (the step, the data sampler's position -- a count of
global batches, the same for any dp size -- and the layout that wrote it), the resolved
config (whose [model] section is checked on resume) and, for a BPE run, a copy of the
tokenizer, so `shardtrain generate` needs nothing but the checkpoint.

Durable: every data and side file is fsynced as it is written (the side files from
threads, their fsyncs together), the staging directory before its rename, the
checkpoints directory after it; only then are older checkpoints removed (never the one
just committed), so a power or node loss leaves the previous checkpoint at worst. A run dir holds one run's checkpoints only
(train/checkpoint/rundir.py). `resume = latest` takes the newest checkpoint that validates
(ckpt/files.py `validate`) and whose bytes match their CRC-32s (`verify`, split over the
ranks), moving any newer bad one aside (`bad-step_*`) with one line saying why.

Any checkpoint resumes in any layout (parallel/pieces.py), except state that is one rank's
own: top-k update compression's optimizer state and residual (comm.compress=topk) and a
parameter server's (ps_server*.pt): their files (`stage_files`) resume only in the layout
that wrote them (`check_layout`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from shardtrain import config as config_mod
from shardtrain.ckpt.dcp import finish, fsync_dir, write_file
from shardtrain.ckpt.files import FORMAT, SIDE, validate, verify
from shardtrain.ckpt.saveplan import MetadataFile
from shardtrain.config import Config, ConfigError
from shardtrain.train.checkpoint.agree import Agreement

_PREFIX = "step_"
_ASIDE = "bad-"
_REMOVED = ".tmp-removed-"  # an old checkpoint being deleted (`clear_staging` takes its rest)
TOKENIZER_FILE = "tokenizer.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint."""
    return f"{_PREFIX}{step:08d}"


def staging_dir(cfg: Config, step: int, *, create: bool = True) -> Path:
    """Where every rank writes its part of the step's checkpoint before it is committed."""
    staged = checkpoint_root(cfg.train.run_dir) / f".staged-{step_name(step)}"
    if create:
        staged.mkdir(parents=True, exist_ok=True)
    return staged


def clear_staging(cfg: Config) -> None:
    """Remove the staging and temporary directories a killed run left behind."""
    root = checkpoint_root(cfg.train.run_dir)
    for stale in [*root.glob(".staged-*"), *root.glob(".tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def stage_files(cfg: Config, step: int, files: dict[str, Any]) -> dict[str, str]:
    """Write this rank's own state files ({file name: state}) into the staging directory;
    their CRC-32s ({file name: hex}, from the bytes written: ckpt/dcp.py `write`)."""
    staged = staging_dir(cfg, step)
    sums = {}
    for name, state in files.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_file(staged / name, buffer.getvalue())
        sums[name] = f"{zlib.crc32(buffer.getbuffer()):08x}"
    return sums


def save_checkpoint(cfg: Config, *, step: int, staged: Path, world_size: int,
                    metadata: MetadataFile, aliases: dict[str, str], extra: dict[str, Any],
                    layout: dict[str, int], sampler_state: dict[str, Any],
                    tokenizer_file: Path | None = None,
                    remove: Callable[[list[Path]], None] | None = None) -> Path:
    """On the main rank, once every rank has written its part: DCP's metadata and our side
    files, each fsynced (ckpt/dcp.py `finish`: from threads), then the directory renamed
    into place and made durable; then the checkpoints beyond `checkpoint.keep` go, never
    this one (newest by name is not always newest written): renamed out of the listing
    (`.tmp-removed-*`, cleared with the staging directories if a crash leaves one), then
    deleted by `remove` (default: at once; the Saver's: in a background thread, as
    deleting a GiB of files takes ~0.3 s). `layout`: the layout that wrote it."""
    root = checkpoint_root(cfg.train.run_dir)
    final = root / step_name(step)
    side = {"meta.json": json.dumps({"step": step, "sampler": sampler_state,
                                     "layout": layout}, indent=1).encode(),
            "config.toml": config_mod.to_toml(cfg).encode(),
            SIDE: json.dumps({"format": FORMAT, "aliases": aliases, "extra": extra}).encode()}
    if tokenizer_file is not None:
        side[TOKENIZER_FILE] = tokenizer_file.read_bytes()
    finish(staged, metadata, world_size, side)
    fsync_dir(staged)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    fsync_dir(root)  # the rename itself durable before anything older is removed
    older = [p for p in list_checkpoints(root) if p != final]
    retired = []
    for old in older[:max(0, len(older) - (cfg.checkpoint.keep - 1))]:
        retired.append(root / f"{_REMOVED}{old.name}")
        os.replace(old, retired[-1])
    (remove or remove_dirs)(retired)
    return final


def remove_dirs(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def resolve_resume(cfg: Config, *, main: bool = True,
                   agreement: Agreement | None = None) -> Path | None:
    """The checkpoint directory `checkpoint.resume` names, or None; errors name the field.
    `latest`: the newest checkpoint that validates and, given the job's `agreement` (every
    rank of the job calls this with one), whose bytes match their checksums, each rank
    reading its share (ckpt/files.py `verify`); on the `main` process the newer bad ones
    are moved aside (`bad-step_*`, never deleted) with one line each saying why; with none
    usable, the newest one's error. Every process skips the same bad ones, so all resume
    from the same checkpoint (a bad checkpoint is moved only after the last agreement)."""
    spec = cfg.checkpoint.resume
    if not spec:
        return None
    if spec != "latest":
        path = Path(spec)
        check_checkpoint(path, f"checkpoint.resume={spec!r}", agreement)
        return path
    root = checkpoint_root(cfg.train.run_dir)
    found, bad = list_checkpoints(root), []
    for path in reversed(found):
        try:
            check_checkpoint(path, agreement=agreement)
        except ConfigError as e:
            bad.append((path, e))
            continue
        for newer, why in bad if main else ():  # a fallback: the bad ones go aside
            aside = _move_aside(newer)
            print(f"checkpoint.resume=latest: {newer.name} is not usable ({why}); moved to "
                  f"{aside.name}, resuming from {path.name}", flush=True)
        return path
    if bad:  # nothing to fall back to: left as they are
        raise ConfigError(f"checkpoint.resume=latest: {bad[0][1]}")
    raise ConfigError(f"checkpoint.resume=latest: no checkpoint under {root}; train without "
                      "resume first")


def check_checkpoint(path: Path, field: str = "", agreement: Agreement | None = None) -> None:
    """`path` is a whole checkpoint (ckpt/files.py `validate`, and our side files) and,
    given an `agreement` (every rank calls this with it), its bytes match their checksums:
    each rank verifies its share, and all raise the error of one that found a mismatch.
    An error names `field` first when given."""
    try:
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory; give a step_* directory or 'latest'")
        validate(path)
        for name in ("meta.json", "config.toml"):
            if not (path / name).is_file():
                raise ConfigError(f"{path / name}: missing; {path} is not a whole checkpoint: "
                                  "give a step_* directory or 'latest'")
        if agreement is not None:
            error = ""
            try:
                verify(path, agreement.rank, agreement.size)
            except ConfigError as e:
                error = str(e)
            if corrupt := agreement.outcome(error):
                raise ConfigError(corrupt.error)
    except ConfigError as e:
        raise ConfigError(f"{field}: {e}" if field else str(e)) from None


def _move_aside(path: Path) -> Path:
    aside, n = path.with_name(_ASIDE + path.name), 1
    while aside.exists():
        aside, n = path.with_name(f"{_ASIDE}{path.name}.{n}"), n + 1
    os.replace(path, aside)
    return aside


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


# The [model] fields that define the saved tensors -- which there are, their shapes, and
# the function the weights compute -- compared on resume, the resolved value where a field
# has a default rule (ffn_dim 0, n_kv_heads 0, head_size 0). Every other model field is a
# choice of how to run or train them, free to change on resume: MODEL_FREE_FIELDS.
MODEL_STATE_FIELDS = {
    "style": "style", "vocab_size": "vocab_size", "dim": "dim", "n_layers": "n_layers",
    "n_heads": "n_heads", "n_kv_heads": "kv_heads", "ffn_dim": "ffn_hidden",
    "head_size": "head_dim", "max_seq_len": "max_seq_len", "tie_embeddings": "tie_embeddings",
    "norm_eps": "norm_eps", "rope_theta": "rope_theta", "n_experts": "n_experts",
    "moe_top_k": "moe_top_k", "qkv_bias": "qkv_bias", "qk_norm": "qk_norm",
    "rope_scaling": "rope_scaling", "rope_factor": "rope_factor",
    **{n: n for n in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len",
                      "rope_attention_factor", "sliding_window")},
    "moe_score": "moe_score", "moe_ffn_dim": "expert_hidden",  # (the router learnt its score)
    "moe_shared_experts": "moe_shared_experts", "moe_first_dense": "moe_first_dense",
    **{n: n for n in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                      "qk_rope_head_dim", "v_head_dim", "moe_route_scale", "mtp_depth")}}
MODEL_FREE_FIELDS = (
    "init_from",  # where the first weights came from: a path, moved or gone since
    "moe_impl",  # grouped matmul or a loop: the same function
    "moe_aux_loss_coef", "moe_z_loss_coef", "mtp_loss_coef",  # loss weights, as the lr is
    "moe_capacity_factor", "moe_drop_policy",  # routing under load in training
    "moe_balance", "moe_bias_rate", "moe_groups", "moe_max_groups",  # routing policies
)


def check_compatible(path: Path, cfg: Config, world_size: int) -> None:
    """Resume must not change the saved tensors (MODEL_STATE_FIELDS), nor the layout of a
    sharded optimizer state; say which fields differ."""
    check_layout(path, cfg, world_size)
    saved, wanted = checkpoint_config(path).model, cfg.model
    diff = [f"model.{k}: checkpoint {getattr(saved, v)!r} vs config {getattr(wanted, v)!r}"
            for k, v in MODEL_STATE_FIELDS.items() if getattr(saved, v) != getattr(wanted, v)]
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
    saved = {"zero": 0, "cp": 1, "ep": 1, "replicas": 1, **meta.get("layout", {}),
             "topk": checkpoint_config(path).comm.compress == "topk"}
    wanted = {"zero": p.zero, "pp": p.pp, "dp": p.resolved_dp(world_size), "tp": p.tp,
              "cp": p.cp, "ep": p.ep, "replicas": p.replicas, "topk": cfg.comm.compress == "topk"}
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
