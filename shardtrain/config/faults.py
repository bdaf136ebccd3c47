"""The fault-handling fields of [train] (docs/faults.md): the non-finite step limit, and the
fault-injection hooks the tests use to make a rank hang, its loss NaN, or the rank die."""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.config.errors import ConfigError


@dataclass(frozen=True)
class Injection:
    """One injected fault: on `rank`, at optimizer step `step` (1-based, as metrics.jsonl
    counts), for `seconds` (a hang; 0 for a NaN)."""

    rank: int
    step: int
    seconds: float = 0.0


def parse_injection(field: str, text: str) -> Injection | None:
    """"RANK:STEP" (train.inject_nan, inject_kill) or "RANK:STEP:SECONDS" (train.inject_hang);
    "" is None."""
    if not text:
        return None
    parts = text.split(":")
    hang = field == "inject_hang"
    form = "RANK:STEP:SECONDS, e.g. \"2:3:60\"" if hang else "RANK:STEP, e.g. \"1:3\""
    try:
        if len(parts) != (3 if hang else 2):
            raise ValueError
        out = Injection(int(parts[0]), int(parts[1]), float(parts[2]) if hang else 0.0)
    except ValueError:
        raise ConfigError(f"train.{field}={text!r} is not {form}") from None
    return out


def check_faults(train, world_size: int) -> None:
    """train.max_bad_steps >= 0; each injection names an existing rank, a step >= 1 and,
    for a hang, a positive time; train.straggler_factor > 1 or 0."""
    if train.straggler_factor != 0 and not train.straggler_factor > 1:  # NaN fails too
        raise ConfigError(f"train.straggler_factor={train.straggler_factor:g} must be > 1 "
                          "(how many times its peers' median compute), or 0 to name none")
    if train.max_bad_steps < 0:
        raise ConfigError(f"train.max_bad_steps={train.max_bad_steps} must be >= 0 (0: stop "
                          "at the first non-finite step)")
    for field in ("inject_hang", "inject_nan", "inject_kill"):
        fault = parse_injection(field, getattr(train, field))
        if fault is None:
            continue
        if not 0 <= fault.rank < world_size or fault.step < 1 or fault.seconds < 0:
            raise ConfigError(f"train.{field}={getattr(train, field)!r}: the rank must lie in "
                              f"0..{world_size - 1}, the step be >= 1 and the time >= 0")
