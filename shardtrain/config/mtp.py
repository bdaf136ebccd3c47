"""The layouts multi-token prediction (model.mtp_depth, model/mtp.py) runs under, checked
before any process starts (all but ZeRO-3 without a pipeline); the planner proposes none of the others (plan/layout.py
`trainer_refusal` runs this same validation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.config.errors import ConfigError

if TYPE_CHECKING:
    from shardtrain.config.schema import Config


def check_mtp(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if not m.mtp_depth:
        return
    if p.zero == 3 and p.pp == 1:
        # ZeRO-3's gather events without a pipeline (parallel/zero/events.py) end with the
        # head; the modules run after it and read the token table again. Under a pipeline
        # each unit stays gathered through the step (zero/gather.py StepGatherer): no event.
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.zero=3 and "
                          "parallel.pp=1: ZeRO-3's per-layer gather schedule has no event for "
                          "the modules after the head; use parallel.zero=1 or 2, a pipeline "
                          "(parallel.pp > 1), or model.mtp_depth=0")
    if p.tp > 1 and (2 * m.dim) % p.tp:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.tp={p.tp}: the "
                          f"projection's 2 x model.dim={2 * m.dim} input features split "
                          "evenly over tp; choose a tp dividing them")
