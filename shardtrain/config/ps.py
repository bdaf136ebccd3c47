"""Checks of the parameter-server fields (parallel.ps_*) and of the straggler knob
(train.slow_ranks), run by `Config.validate` before any process starts. (That the servers
do not outnumber the model's parameters needs the parameter count: parallel/ps/layout.py
`check_servers`, run by the CLI's pre-launch checks.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.config.errors import ConfigError

if TYPE_CHECKING:
    from shardtrain.config.schema import Config

# Layouts a parameter server cannot serve: its workers hold whole replicas of the model
# and its servers the optimizer (so no ZeRO), and its point-to-point traffic is planned for
# one model replica per worker rank.
_EXCLUSIVE = (("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1), ("zero", 0))
_PS_ONLY = (("ps_mode", "sync"), ("ps_staleness", 0), ("ps_priority", "layer"))


def check_parameter_server(cfg: Config, world_size: int) -> None:
    p = cfg.parallel
    if p.ps_servers < 0:
        raise ConfigError(f"parallel.ps_servers={p.ps_servers} must be >= 0 (0: no parameter "
                          "server; data parallelism all-reduces)")
    if p.ps_servers == 0:
        for name, default in _PS_ONLY:
            if getattr(p, name) != default:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} applies to a parameter "
                                  "server: set parallel.ps_servers > 0, or drop it")
        return
    if p.ps_servers >= world_size:
        raise ConfigError(f"parallel.ps_servers={p.ps_servers} leaves no workers in a world of "
                          f"{world_size} processes: the servers are taken from the world, the "
                          "rest train; raise --nproc or lower parallel.ps_servers")
    for name, plain in _EXCLUSIVE:
        if getattr(p, name) != plain:
            raise ConfigError(f"parallel.ps_servers={p.ps_servers} with parallel.{name}="
                              f"{getattr(p, name)}: a parameter server's workers each hold a "
                              f"whole model replica and its servers the optimizer; set "
                              f"parallel.{name}={plain} or parallel.ps_servers=0")
    if cfg.train.precision == "fp16":
        raise ConfigError(f"parallel.ps_servers={p.ps_servers} with train.precision=fp16: "
                          "workers push each gradient as backward produces it, before a loss "
                          "scale could be checked for overflow on every worker; use "
                          "train.precision=bf16 or fp32")
    if p.ps_staleness < 0 or (p.ps_staleness and p.ps_mode != "ssp"):
        raise ConfigError(f"parallel.ps_staleness={p.ps_staleness} must be >= 0 and applies to "
                          f"parallel.ps_mode=ssp only (this run: {p.ps_mode})")
    if p.ps_partition_mb <= 0 or p.ps_credit < 1:
        raise ConfigError(f"parallel.ps_partition_mb={p.ps_partition_mb} must be positive and "
                          f"parallel.ps_credit={p.ps_credit} at least 1")


def parse_slow_ranks(text: str) -> dict[int, float]:
    """"1:1.5,3:2" -> {1: 1.5, 3: 2.0}."""
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        rank, _, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise ConfigError(f"train.slow_ranks={text!r}: {item!r} is not RANK:FACTOR "
                              "(e.g. \"1:1.5\" makes rank 1's compute take 1.5x)") from None
    return out


def check_slow_ranks(text: str, world_size: int) -> None:
    for rank, factor in parse_slow_ranks(text).items():
        if not 0 <= rank < world_size or factor < 1:
            raise ConfigError(f"train.slow_ranks={text!r}: rank {rank} must lie in 0.."
                              f"{world_size - 1} and its factor {factor:g} be >= 1")
