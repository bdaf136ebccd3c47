"""What multi-token prediction (model.mtp_depth, model/mtp.py) asks of a layout, checked
before any process starts; the planner proposes nothing it refuses (plan/layout.py
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
    if p.tp > 1 and (2 * m.dim) % p.tp:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.tp={p.tp}: the "
                          f"projection's 2 x model.dim={2 * m.dim} input features split "
                          "evenly over tp; choose a tp dividing them")
