"""Experiment trackers: every field of a metrics.jsonl record, and the resolved config, sent
to TensorBoard, Weights & Biases or trackio (`train.tracker`, a list). Rank 0 only: the
trainer opens them where it writes metrics.jsonl.

- tensorboard: an event file under <run_dir>/tensorboard (scalars; the config as text).
- wandb: a run under <run_dir>/wandb. `train.wandb_mode = auto` runs online only when
  W&B's server answers (a 2 s TCP probe), else offline, so a run on a machine without a
  network still records everything; `wandb sync <run_dir>/wandb/offline-run-*` uploads it
  later (docs/finetuning.md).
- trackio: a local-first tracker (Hugging Face's), stored in its own directory
  (TRACKIO_DIR, default ~/.cache/huggingface/trackio); `trackio show` opens the dashboard.

A record's numeric fields (bools as 0/1) are logged as scalars at the record's step, a list
of numbers (rank_compute_s, one per rank) as key/0, key/1, ...; a field that is None (mfu
with no peak FLOPs) is left out of that step.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any, Protocol

from shardtrain import config as config_mod
from shardtrain.config import Config
from shardtrain.config.observe import tracker_list

WANDB_HOST = ("api.wandb.ai", 443)


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The loggable fields of a metrics record: numbers (bools as 0/1), step excluded, and
    lists of numbers (per-rank figures: rank_compute_s) as key/0, key/1, ..."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and key != "step":
            out[key] = float(value)
        elif isinstance(value, list):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value)
                        if isinstance(v, (int, float))})
    return out


class TensorBoardTracker:
    def __init__(self, run_dir: Path, cfg: Config):
        from torch.utils.tensorboard import SummaryWriter  # optional extra: tensorboard

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        # Markdown: a code block keeps the TOML's lines.
        self.writer.add_text("config", "```\n" + config_mod.to_toml(cfg) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def wandb_reachable(timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection(WANDB_HOST, timeout=timeout_s):
            return True
    except OSError:
        return False


class WandbTracker:
    def __init__(self, run_dir: Path, cfg: Config):
        import wandb  # optional extra: wandb

        mode = cfg.train.wandb_mode
        if mode == "auto":
            mode = "online" if wandb_reachable() else "offline"
        init = dict(project=cfg.train.tracker_project, name=run_dir.name, dir=str(run_dir),
                    config=cfg.to_dict(), reinit="create_new")
        try:
            self.run = wandb.init(mode=mode, **init)
        except wandb.errors.Error as e:  # online without a login: auto keeps the run offline
            if cfg.train.wandb_mode != "auto" or mode == "offline":
                raise
            print(f"train.wandb_mode=auto: W&B online failed ({e}); logging offline",
                  file=sys.stderr)
            mode = "offline"
            self.run = wandb.init(mode=mode, **init)
        self.mode = mode

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, run_dir: Path, cfg: Config):
        import trackio  # optional extra: trackio

        self.trackio = trackio
        self.run = trackio.init(project=cfg.train.tracker_project, name=run_dir.name,
                                config=cfg.to_dict(), embed=False, auto_log_cpu=False,
                                auto_log_gpu=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.trackio.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


def open_trackers(cfg: Config) -> list[Tracker]:
    """The trackers train.tracker (and train.tensorboard) name, opened (call on rank 0)."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return [KINDS[name](run_dir, cfg) for name in tracker_list(cfg.train.tracker,
                                                               cfg.train.tensorboard)]
