"""What `parallel.schedule = pipedream-2bw` composes with (parallel/pipeline/pipedream.py,
docs/pipeline.md): the asynchronous schedule keeps a second version of each stage's
parameters as whole module tensors, which is proven (tests/test_pipedream_2bw.py) with plain
data parallelism -- not with what shards, offloads or steps parameters elsewhere, nor
with the other model splits. Each refusal names the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.config.errors import ConfigError

if TYPE_CHECKING:
    from shardtrain.config.schema import Config


def check_pipedream(cfg: Config) -> None:
    p = cfg.parallel
    if p.schedule != "pipedream-2bw":
        return
    fix = "use parallel.schedule=1f1b"
    if p.pp < 2:
        raise ConfigError(f"parallel.schedule=pipedream-2bw is a pipeline schedule and this run "
                          f"has parallel.pp={p.pp}: set pp >= 2 or {fix}")
    if p.microbatches < p.pp:
        raise ConfigError(f"parallel.schedule=pipedream-2bw needs at least pp micro-batches per "
                          f"step (Narayanan et al. 2021: m >= pipeline depth, so one version's "
                          f"delay covers the pipeline); got parallel.microbatches="
                          f"{p.microbatches} with parallel.pp={p.pp}: raise "
                          "parallel.microbatches (or lower train.micro_batch)")
    # field, value if it is not supported, why
    unsupported = [
        ("parallel.zero", p.zero, "ZeRO shards the parameters and steps master copies: "
                                  "the stashed version would not be the one computed with"),
        ("parallel.tp", p.tp if p.tp > 1 else 0, "not proven with tensor parallelism"),
        ("parallel.cp", p.cp if p.cp > 1 else 0, "not proven with context parallelism"),
        ("parallel.ep", p.ep if p.ep > 1 else 0, "not proven with expert parallelism"),
        ("parallel.ps_servers", p.ps_servers, "the parameter servers own the weights"),
        ("comm.compress", cfg.comm.compress if cfg.comm.compress == "topk" else 0,
         "top-k steps each rank's own optimizer"),
    ]
    for name, value, why in unsupported:
        if value:
            raise ConfigError(f"parallel.schedule=pipedream-2bw with {name}={value}: {why}; "
                              f"{fix}, or drop {name}")
