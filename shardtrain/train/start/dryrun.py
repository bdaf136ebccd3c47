"""`shardtrain train --dry-run-world N`: rank 0 of an N-rank job, alone on this machine.

One process joins a fake process group of N ranks (torch's `fake` backend: every
collective returns at once and moves nothing), builds the real mesh and the real Trainer
for rank 0 of the configured layout, and runs a few training steps. What rank 0 allocates
is then real: its parameter, gradient, optimizer and master-weight shards
(`Trainer.memory_ledger`), its peak memory while built and while stepping (CUDA: the
allocator's peak; CPU: the process's resident high-water mark, reset at each, the Python
and torch runtime included), the last step's peak (the model states held plus the most
bytes allocated at once above the step's start, meters.py: on CPU malloc's count, so no
runtime and no cache in it) and the bytes autograd saved for backward during one step
(meters.py's LiveSavedActivations). Beside them it puts the planner's prediction for the
same layout: the exact model-state bytes the runtime's padding implies
(plan/rank_states.py) and the estimate of plan/memory.py, whose total the step peak is
compared with (tests/test_dryrun_matrix.py, per model family).

What it cannot show: communication (nothing is sent, so no time and no traffic), step time,
the other ranks (the last pipeline stage holds the head; their imbalance is not seen),
and real losses: what other ranks would send reads as zeros (ZeroFilledCommunicator), so
the numbers it trains on are meaningless. A parameter-server layout is refused: its
servers run a different program (train/ps_server.py), not rank 0's.

The report goes to stdout and, written atomically, to <run_dir>/dry_run.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardtrain.comm import CommFactory, Communicator
from shardtrain.config import Config, ConfigError
from shardtrain.plan.layout import PlanError, config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.partition import layers_per_stage
from shardtrain.plan.rank_states import rank0_states
from shardtrain.train.start.meters import LiveSavedActivations, StepGrowth

STATES = ("params", "grads", "master", "optimizer")
NOT_SHOWN = ["communication volume and time (collectives move nothing)", "step time",
             "other ranks' memory (e.g. the last pipeline stage's head) and imbalance",
             "real losses (what other ranks would send reads as zeros)"]


class ZeroFilledCommunicator(Communicator):
    """A communicator over the fake group where every other rank contributes zeros: what
    this rank would receive reads zeros, its own part is its own. The fake collectives
    leave receive buffers as allocated (torch.empty: whatever the memory held), so a
    gradient could come out non-finite, the update skip its step, a lazily built optimizer
    state (torch's AdamW) never appear, and the ledger change from run to run."""

    def all_gather(self, output, input, **kw):
        if output.is_contiguous():  # [size * m]: zeros around this rank's own [m]
            out, m = output.view(-1), input.numel()
            out[:self.rank * m].zero_()
            out[(self.rank + 1) * m:].zero_()
            out[self.rank * m:(self.rank + 1) * m].copy_(input.reshape(-1))
        else:
            output.zero_()
        return super().all_gather(output, input, **kw)

    def reduce_scatter(self, output, input, op="sum", **kw):
        n = output.numel()  # the sum is this rank's own chunk (avg: divided after the call)
        output.copy_(input.reshape(-1)[self.rank * n:(self.rank + 1) * n].view_as(output))
        return super().reduce_scatter(output, input, op, **kw)

    def all_to_all(self, output, input, **kw):
        output.zero_()
        return super().all_to_all(output, input, **kw)

    def gather(self, output, input, dst=0, **kw):
        if output is not None:
            output.zero_()
        return super().gather(output, input, dst, **kw)

    def scatter(self, output, input, src=0, **kw):
        output.zero_()
        return super().scatter(output, input, src, **kw)

    def recv(self, tensor, src, **kw):
        tensor.zero_()
        return super().recv(tensor, src, **kw)

    def exchange(self, sends, recvs):
        for _, tensor, _ in recvs:
            tensor.zero_()
        return super().exchange(sends, recvs)


def check_dry_run(cfg: Config, world_size: int) -> None:
    """What the dry run cannot do, refused before anything is built."""
    if world_size < 2:
        raise ConfigError(f"--dry-run-world {world_size} must be >= 2 (for one rank, train "
                          "normally: shardtrain train)")
    if cfg.comm.algorithm != "native":
        raise ConfigError(f"--dry-run-world with comm.algorithm={cfg.comm.algorithm}: the dry run "
                          "fakes the backend's collectives, and shardtrain's own algorithms "
                          "would compute on messages that never come; set --comm.algorithm "
                          "native")
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


@contextmanager
def rank0_trainer(cfg: Config, world_size: int, device: torch.device) -> Iterator[Any]:
    """Rank 0's Trainer (built: its ledger holds the build's peak) in a fake world of
    `world_size`, for the duration of the `with` block."""
    from shardtrain.mesh import ParallelMesh, shape_for
    from shardtrain.train.trainer import Trainer

    p = cfg.parallel
    shape = shape_for(cfg, world_size)
    if device.type == "cpu":
        from shardtrain.train.observe.metrics import fixed_mmap_threshold

        fixed_mmap_threshold()
    fake_world(world_size)
    try:
        mesh = ParallelMesh(shape, rank=0, node_size=p.node_size or world_size,
                            timeout_s=cfg.comm.timeout_s, device=device,
                            communicator=CommFactory(timeout_s=cfg.comm.timeout_s,
                                                     kind=ZeroFilledCommunicator))
        yield Trainer(cfg, mesh, device)
    finally:
        dist.destroy_process_group()


def dry_run(cfg: Config, world_size: int, device: torch.device, *, steps: int = 2,
            runtime_bytes: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Build rank 0's Trainer on `device` (launch.pick_device's choice for a single local
    rank) in a fake world of `world_size`, run `steps` steps (at most train.steps), and
    return (and write; print unless `quiet`) the report. `runtime_bytes`: the runtime base
    the predicted peaks add (the CLI: on CPU this machine's stored one, calibrate.py
    `runtime_base`; 0 on a GPU); None: not known, the predicted peaks are the planner's
    tensor bytes alone."""
    from shardtrain.train.observe.metrics import reset_peak_memory
    from shardtrain.train.trainer import write_atomic

    check_dry_run(cfg, world_size)
    with rank0_trainer(cfg, world_size, device) as trainer:
        reset_peak_memory(device)  # so that the steps' peak is their own
        saved, skipped, n = 0, 0, max(1, min(steps, cfg.train.steps))
        for i in range(n):  # the last step's allocations measured (meters.py)
            held = sum(trainer.memory_ledger()[f"{k}_bytes"] for k in STATES)
            with LiveSavedActivations(exclude=trainer.parallel.module) as meter, \
                    StepGrowth(device, enabled=i == n - 1) as growth:
                skipped += bool(trainer.train_step()["skipped"])
            saved = max(saved, meter.peak)
        ledger = trainer.memory_ledger()
        layers = stage_layers(trainer.parallel.module)
    ledger["step_peak_bytes"] = None if growth.bytes is None else held + growth.bytes
    ledger["peak_mem_bytes"] = max(ledger["peak_mem_bytes"], growth.earlier_peak)
    report = build_report(cfg, world_size, ledger, saved=saved, layers=layers,
                          steps=trainer.step, device=device)
    report["skipped_steps"] = skipped  # non-finite gradients: the optimizer state not built
    report.update(planned_peaks(report, runtime_bytes, tp=cfg.parallel.tp))
    write_atomic(Path(cfg.train.run_dir) / "dry_run.json", json.dumps(report, indent=1))
    if not quiet:
        print(format_report(report), flush=True)
    return report


def planned_peaks(report: dict[str, Any], runtime_bytes: int | None, *, tp: int = 1
                  ) -> dict[str, Any]:
    """The peaks the planner predicts for what `peak while built` and `peak` measure: the
    runtime base (CPU; 0 on a GPU) plus, while built, the parameters and the one full
    tensor the build draws at a time (parallel/build.py), beside its tensor-parallel block
    (a copy, 1/tp of it) under tp, and while stepping the planner's total (model states,
    activations and the largest transient moment: plan/memory.py)."""
    e, base, full = report["planned_estimate"], runtime_bytes or 0, report["largest_tensor"]
    drawn = full * (1 + 1 / tp) if tp > 1 else full
    return {"runtime_bytes": runtime_bytes,
            "planned_build_peak": int(base + e["params"] + drawn),
            "planned_peak": int(base + e["total"])}


def build_report(cfg: Config, world_size: int, ledger: dict[str, Any], *, saved: int,
                 layers: int, steps: int, device: torch.device) -> dict[str, Any]:
    layout = config_layout(cfg, world_size)
    measured = {k: int(ledger[f"{k}_bytes"]) for k in STATES}
    estimate = memory_per_gpu(cfg.model, layout, seq_len=cfg.train.seq_len,
                              bucket_bytes=cfg.comm.bucket_mb * 2**20,
                              node_size=cfg.parallel.node_size or world_size).to_dict()
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
        "note": ("collectives moved nothing (other ranks read as zeros): losses are not "
                 "real; bytes and peaks are rank 0's"),
        "measured": {**measured, "model_states": sum(measured.values()),
                     "offloaded": int(ledger.get("offloaded_bytes") or 0),
                     "peak_mem": ledger["peak_mem_bytes"],
                     "step_peak": ledger["step_peak_bytes"],
                     "build_peak_mem": ledger["build_peak_bytes"],
                     "build_growth": ledger["build_peak_bytes"] - ledger["build_base_bytes"],
                     "peak_reserved": ledger["peak_reserved_bytes"],
                     "saved_activations": saved},
        "largest_tensor": largest_tensor_bytes(cfg),
        "planned_exact": None if exact is None else {**exact, "model_states": sum(exact.values())},
        "planned_exact_unavailable": why,
        "match": exact is not None and exact == measured,
        "planned_estimate": estimate,
        "stage_layers": {"runtime": layers,
                         "planner": layers_per_stage(cfg.model, layout)},
        "peak_meaning": ("CUDA allocator peak of allocated bytes" if device.type == "cuda"
                         else "process peak RSS, the Python and torch runtime included"),
        "not_shown": NOT_SHOWN,
    }


def largest_tensor_bytes(cfg: Config) -> int:
    """The largest full fp32 parameter of the single-process model: the most a sharded build
    holds beyond the rank's share while it draws or reads one tensor (parallel/build.py)."""
    from shardtrain.model.transformer import build_model

    return 4 * max(p.numel() for p in build_model(cfg.model, seed=None).parameters())


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
    step = "n/a" if m["step_peak"] is None else f"{m['step_peak']:,}"
    lines.append(f"{'step peak':<18}{step:>16}{'':>16}{e['total']:>18,.0f}"
                 "   (model states held + the last step's allocated growth)")
    lines.append(f"{'peak':<18}{m['peak_mem']:>16,}{'':>16}{'':>18}   ({r['peak_meaning']})")
    lines.append(f"{'peak while built':<18}{m['build_peak_mem']:>16,}   (of which the build "
                 f"added {m['build_growth']:,}; the largest tensor is {r['largest_tensor']:,})")
    base = "not known: tensors alone" if r["runtime_bytes"] is None else \
        f"the runtime's {r['runtime_bytes']:,} included"
    lines.append(f"{'predicted peaks':<18}{'measured':>16}{'predicted':>16}{'off':>9}"
                 f"   ({base})")
    for label, got, want in (("while built", m["build_peak_mem"], r["planned_build_peak"]),
                             ("step", m["peak_mem"], r["planned_peak"])):
        lines.append(f"{label:<18}{got:>16,}{want:>16,}{(want - got) / max(got, 1):>+9.1%}")
    if x is None:
        lines.append(f"exact count unavailable: {r['planned_exact_unavailable']}")
    else:
        lines.append("model states: measured " + ("==" if r["match"] else "!=") +
                     " planned exact")
    lines.append("not shown: " + "; ".join(r["not_shown"]))
    return "\n".join(lines)
