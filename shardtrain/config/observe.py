"""Checks of the train fields that watch a run: experiment trackers (train/observe/tracking.py) and
the profiler (train/observe/profile.py). A tracker's package is looked up, not imported."""

from __future__ import annotations

import importlib.util

from shardtrain.config.errors import ConfigError

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}  # -> package


def tracker_list(tracker: str, tensorboard: bool = False) -> list[str]:
    """train.tracker as a list ("none": empty); train.tensorboard = true adds tensorboard."""
    names = [n.strip() for n in tracker.split(",") if n.strip() and n.strip() != "none"]
    return names + ["tensorboard"] if tensorboard and "tensorboard" not in names else names


def profile_range(spec: str) -> tuple[int, int] | None:
    """train.profile_steps "A:B" -> (A, B), steps A to B inclusive ("": None)."""
    if not spec:
        return None
    first, sep, last = spec.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or not 1 <= a <= b:
        raise ConfigError(f"train.profile_steps={spec!r} must be \"A:B\" with 1 <= A <= B "
                          "(steps A to B inclusive, e.g. \"3:5\"), or \"\" for no trace")
    return a, b


def check_observability(train) -> None:
    """train: TrainConfig (not imported: schema.py imports this module)."""
    names = tracker_list(train.tracker, train.tensorboard)
    if train.tracker.strip() != "none" and "none" in train.tracker:
        raise ConfigError(f"train.tracker={train.tracker!r}: 'none' cannot be listed with "
                          "trackers")
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.tracker={train.tracker!r}: {name!r} is not a tracker; "
                              f"choose none or a comma-separated list among {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            field = "train.tracker includes" if name in train.tracker else "train.tensorboard=true:"
            raise ConfigError(f"{field} {name}, but the {TRACKERS[name]} package is not "
                              f"installed: pip install 'shardtrain[{name}]'")
    if train.wandb_mode not in ("auto", "online", "offline"):
        raise ConfigError(f"train.wandb_mode={train.wandb_mode!r} is not one of auto, online, "
                          "offline")
    steps = profile_range(train.profile_steps)
    if steps is not None and steps[1] > train.steps:
        raise ConfigError(f"train.profile_steps={train.profile_steps!r} ends after the run's "
                          f"last step (train.steps={train.steps}); end it at or before that")
