"""`shardtrain train --dry-run-world N`: rank 0 of an N-rank job, alone on this machine.

One process joins a fake process group of N ranks (torch's `fake` backend: every
collective returns at once and moves nothing), builds the real mesh and the real Trainer
for rank 0 of the configured layout, and runs a few training steps. What rank 0 allocates
is then real: its parameter, gradient, optimizer and master-weight shards
(`Trainer.memory_ledger`), its peak memory (CUDA: the allocator's peak; CPU: the process's
peak RSS, dominated by the Python and torch runtime itself) and the bytes autograd saved
for backward during one step (parallel/activation.py's SavedActivations). Beside them it
puts the planner's prediction for the same layout: the exact model-state bytes the
runtime's padding implies (plan/rank_states.py) and the estimate of plan/memory.py.

What it cannot show: communication (nothing is sent, so no time and no traffic), step time,
the other ranks (the last pipeline stage holds the head; their imbalance is not seen),
and real losses: received tensors are whatever the fake collective left in the buffers,
so the numbers it trains on are meaningless. A parameter-server layout is refused: its
servers run a different program (train/ps_server.py), not rank 0's.

The report goes to stdout and, written atomically, to <run_dir>/dry_run.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardtrain.config import Config, ConfigError
from shardtrain.plan.layout import PlanError, config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.partition import layers_per_stage
from shardtrain.plan.rank_states import rank0_states

STATES = ("params", "grads", "master", "optimizer")
NOT_SHOWN = ["communication volume and time (collectives move nothing)", "step time",
             "other ranks' memory (e.g. the last pipeline stage's head) and imbalance",
             "real losses (training runs on whatever the fake collectives left)"]


def check_dry_run(cfg: Config, world_size: int) -> None:
    """What the dry run cannot do, refused before anything is built."""
    if world_size < 2:
        raise ConfigError(f"--dry-run-world {world_size} must be >= 2 (for one rank, train "
                          "normally: shardtrain train)")
    if cfg.parallel.ps_servers:
        raise ConfigError(f"--dry-run-world with parallel.ps_servers={cfg.parallel.ps_servers}: "
                          "a parameter-server layout runs two programs (workers and servers) "
                          "and a dry run shows one rank's; set --parallel.ps_servers 0")
    cfg.validate(world_size)


def fake_world(world_size: int) -> None:
    """Join a fake process group of `world_size` ranks as rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def stage_layers(module: torch.nn.Module) -> int:
    """Transformer blocks this rank's module holds (every chunk's, interleaved)."""
    found = {m.group(1) for n, _ in module.named_parameters()
             if (m := re.match(r"(.*?layers\.\d+)\.", n))}
    return len(found)


def dry_run(cfg: Config, world_size: int, *, steps: int = 2) -> dict[str, Any]:
    """Build rank 0's Trainer in a fake world of `world_size`, run `steps` steps (at most
    train.steps), and return (and write) the report."""
    from shardtrain.comm import build_mesh
    from shardtrain.launch import ProcessInfo, check_device, pick_device
    from shardtrain.mesh import MeshShape
    from shardtrain.parallel.activation import SavedActivations
    from shardtrain.train.trainer import Trainer, write_atomic

    check_dry_run(cfg, world_size)
    device = pick_device(cfg.train.device, ProcessInfo(world_size=world_size))
    check_device(cfg, device)
    p, t = cfg.parallel, cfg.train
    shape = MeshShape(pp=p.pp, dp=p.resolved_dp(world_size), cp=p.cp, tp=p.tp, ep=p.ep)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fake_world(world_size)
    try:
        mesh = build_mesh(shape, rank=0, node_size=p.node_size or world_size,
                          algorithm=cfg.comm.algorithm, timeout_s=cfg.comm.timeout_s,
                          device=device)
        trainer = Trainer(cfg, mesh, device)
        saved = 0
        for _ in range(max(1, min(steps, t.steps))):
            with SavedActivations(exclude=trainer.parallel.module) as meter:
                trainer.train_step()
            saved = max(saved, meter.bytes)
        ledger = trainer.memory_ledger()
        layers = stage_layers(trainer.parallel.module)
    finally:
        dist.destroy_process_group()
    report = build_report(cfg, world_size, ledger, saved=saved, layers=layers,
                          steps=trainer.step, device=device)
    write_atomic(Path(t.run_dir) / "dry_run.json", json.dumps(report, indent=1))
    print(format_report(report), flush=True)
    return report


def build_report(cfg: Config, world_size: int, ledger: dict[str, Any], *, saved: int,
                 layers: int, steps: int, device: torch.device) -> dict[str, Any]:
    layout = config_layout(cfg, world_size)
    measured = {k: int(ledger[f"{k}_bytes"]) for k in STATES}
    estimate = memory_per_gpu(cfg.model, layout, seq_len=cfg.train.seq_len).to_dict()
    try:
        states = rank0_states(cfg.model, layout, layers=layers,
                              bucket_mb=cfg.comm.bucket_mb, optimizer=cfg.optim.name)
        exact, why = {k: int(getattr(states, k)) for k in STATES}, None
    except PlanError as e:
        exact, why = None, str(e)
    if cfg.lora.enabled or cfg.parallel.zero_quantized_weights or cfg.parallel.zero_hpz:
        exact, why = None, "LoRA and ZeRO++ (qwZ, hpZ) change the held tensors; not counted"
    return {
        "world_size": world_size, "rank": 0, "layout": layout.describe(),
        "device": str(device), "steps": steps,
        "note": "collectives did nothing: losses are not real; bytes and peaks are rank 0's",
        "measured": {**measured, "model_states": sum(measured.values()),
                     "offloaded": int(ledger.get("offloaded_bytes") or 0),
                     "peak_mem": ledger["peak_mem_bytes"],
                     "peak_reserved": ledger["peak_reserved_bytes"],
                     "saved_activations": saved},
        "planned_exact": None if exact is None else {**exact, "model_states": sum(exact.values())},
        "planned_exact_unavailable": why,
        "match": exact is not None and exact == measured,
        "planned_estimate": estimate,
        "stage_layers": {"runtime": layers,
                         "planner": layers_per_stage(cfg.model, layout)},
        "peak_meaning": ("CUDA allocator peak of allocated bytes" if device.type == "cuda"
                         else "process peak RSS (mostly the Python and torch runtime)"),
        "not_shown": NOT_SHOWN,
    }


def format_report(r: dict[str, Any]) -> str:
    m, x, e = r["measured"], r["planned_exact"], r["planned_estimate"]
    lines = [f"dry run: rank 0 of {r['world_size']} ranks ({r['layout']}) on {r['device']}, "
             f"{r['steps']} steps; {r['note']}",
             f"{'bytes':<18}{'measured':>16}{'planned exact':>16}{'planner estimate':>18}"]
    for k in (*STATES, "model_states"):
        exact = "n/a" if x is None else f"{x[k]:,}"
        est = e["total"] - e["activations"] - e["buffers"] if k == "model_states" else e[k]
        lines.append(f"{k:<18}{m[k]:>16,}{exact:>16}{est:>18,.0f}")
    lines.append(f"{'saved activations':<18}{m['saved_activations']:>16,}{'':>16}"
                 f"{e['activations']:>18,.0f}")
    lines.append(f"{'buffers':<18}{'':>16}{'':>16}{e['buffers']:>18,.0f}")
    lines.append(f"{'peak':<18}{m['peak_mem']:>16,}{'':>16}{e['total']:>18,.0f}"
                 f"   ({r['peak_meaning']})")
    if x is None:
        lines.append(f"exact count unavailable: {r['planned_exact_unavailable']}")
    else:
        lines.append("model states: measured " + ("==" if r["match"] else "!=") +
                     " planned exact")
    lines.append("not shown: " + "; ".join(r["not_shown"]))
    return "\n".join(lines)
