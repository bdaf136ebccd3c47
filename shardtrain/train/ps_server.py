"""A parameter server's rank: what it runs instead of the trainer (launch.run_worker splits
the roles; parallel/ps/ has the server loop and docs/ps.md the user's view).

The server builds the model's shapes only (meta device), takes its shard's starting
weights from worker 0 -- or, resuming, its weights and optimizer state from the
checkpoint's ps_server*.pt files (any server count and partition size) -- and serves until
every worker has pushed its steps and worker 0 has collected its state for each
checkpoint. Its tensors live in host memory (parallel/ps/groups.py: the traffic is
Gloo's). It applies the trainer's learning-rate schedule to the clock of each update and
writes <run_dir>/ps_server{S}.json: every applied push (worker, clock, version computed
on, applied at, staleness) and the bytes it received.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.model.transformer import build_model
from shardtrain.parallel.ps.groups import ps_comms
from shardtrain.parallel.ps.server import ParameterServer
from shardtrain.parallel.ps.update import ps_layout, push_codec
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.agree import Agreement
from shardtrain.train.optim import lr_at


def run_server(cfg: Config, mesh: ParallelMesh) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    world, servers = ps_comms(rank, world_size, p.ps_servers, mesh.ledger,
                              timeout_s=cfg.comm.timeout_s)
    shapes = [q for q in build_model(cfg.model, seed=None).parameters() if q.requires_grad]
    layout = ps_layout(cfg, shapes, world_size)
    index = rank - layout.workers
    # With the workers, every server checks its share of the checkpoint's bytes.
    job = Agreement("resume", rank, world_size)
    start, resume = 0, ckpt.resolve_resume(cfg, main=False, agreement=job)
    if resume is not None:
        start = ckpt.read_meta(resume)["step"]
    every = cfg.checkpoint.every
    saves = sum(1 for k in range(start + 1, t.steps + 1) if (every and k % every == 0)
                or k == t.steps)
    server = ParameterServer(
        world, servers, layout, index, None, o, codec=push_codec(cfg, layout),
        mode=p.ps_mode, staleness=p.ps_staleness, priority=p.ps_priority,
        steps=t.steps - start, state_requests=saves, device=torch.device("cpu"),
        lr_of=lambda clock: lr_at(start + clock, base_lr=t.lr, warmup=o.warmup_steps,
                                  total=t.steps, min_ratio=o.min_lr_ratio),
        max_norm=o.grad_clip or float("inf"))
    if resume is None:
        server.receive_weights(src=0)
    else:
        server.load_state([ckpt.load_state(resume, f.name)
                           for f in sorted(resume.glob("ps_server*.pt"))])
    server.run()
    pushed = [r for r in mesh.ledger.records if r.op == "recv" and r.tag.startswith("ps:g")]
    summary = {"server": index, "servers": layout.servers, "workers": layout.workers,
               "steps": t.steps - start, "shard_bytes": layout.server_bytes(index),
               "push_recv_bytes": sum(r.recv_bytes for r in pushed),
               "records": server.records}
    path = Path(t.run_dir) / f"ps_server{index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary))
    return summary
