"""The update half (parallel/strategy.py) of a parameter server's worker: gradients go to
the servers and weights come back from them (worker.py). The optimizer step happens on the
servers (server.py, run by train/ps_server.py on the server ranks); here `step` has nothing
left to do and `clip_grad_norm` reports this worker's gradient norm (the servers clip).

The step's loss: sync averages it over the workers like data parallelism; async and ssp
report each worker's own (`steps_together`: an all-reduce every step would make the
workers wait for each other). Checkpoints: worker 0 asks every server for its state
(weights, optimizer moments, update count) and writes one file per server
(ps_server{S}.pt); servers resume from those files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardtrain.ckpt.files import Piece, Reader
from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.pieces import local_model_state, module_pieces
from shardtrain.parallel.pipeline.state import StageShards
from shardtrain.parallel.ps.codec import PushCodec
from shardtrain.parallel.ps.groups import ps_comms
from shardtrain.parallel.ps.layout import HEAD, STATE, PSLayout
from shardtrain.parallel.ps.server import state_numel, unpack_state
from shardtrain.parallel.ps.worker import WIRE, PSWorker
from shardtrain.parallel.strategy import nbytes


def steps_together(cfg: Config) -> bool:
    """Whether every data-parallel replica takes each step together (all layouts but a
    parameter server's async and ssp workers)."""
    return not cfg.parallel.ps_servers or cfg.parallel.ps_mode == "sync"


def ps_layout(cfg: Config, params: list[torch.Tensor], world_size: int) -> PSLayout:
    p = cfg.parallel
    return PSLayout(params, workers=world_size - p.ps_servers, servers=p.ps_servers,
                    partition_bytes=p.ps_partition_mb * 2**20)


def push_codec(cfg: Config, layout: PSLayout) -> PushCodec:
    c = cfg.comm
    return PushCodec(c.compress, [p.numel for p in layout.parts], block=c.quant_block,
                     ratio=c.topk_ratio, error_feedback=c.error_feedback)


class PSUpdate:
    def __init__(self, module: torch.nn.Module, mesh: ParallelMesh, cfg: Config,
                 shards: StageShards):
        """A worker's side of the run (collective with the servers' `ps_comms` call). Worker
        0 gives the servers their starting weights, unless they resume from a checkpoint."""
        self.module, self.cfg, self.shards = module, cfg, shards
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        world, _ = ps_comms(mesh.rank, world_size, cfg.parallel.ps_servers, mesh.ledger,
                            timeout_s=cfg.comm.timeout_s)
        params = [p for p in module.parameters() if p.requires_grad]
        layout = ps_layout(cfg, params, world_size)
        self.worker = PSWorker(module, world, layout, codec=push_codec(cfg, layout),
                               priority=cfg.parallel.ps_priority, credit=cfg.parallel.ps_credit)
        self.no_sync, self.zero_grad = self.worker.no_sync, self.worker.zero_grad
        if mesh.rank == 0 and not cfg.checkpoint.resume:
            self.worker.send_weights()

    def finish(self) -> None:
        self.worker.finish()

    def clip_grad_norm(self, max_norm: float, unscale: float = 1.0) -> torch.Tensor:
        """The servers clip (the gradients left during backward, unscaled: fp16 is refused
        with a parameter server); this is the norm the last push reported."""
        return torch.tensor(self.worker.last_norm, device=WIRE)

    def step(self, lr: float) -> None:
        """The servers applied the update (with the same schedule's lr)."""

    def memory(self) -> dict[str, int]:
        """No optimizer state here: the servers hold it."""
        grads = [p.grad for p in self.worker.params if p.grad is not None]
        return {"params_bytes": nbytes(*self.worker.params), "grads_bytes": nbytes(*grads),
                "optimizer_bytes": 0, "master_bytes": 0}

    def local_state_dict(self) -> None:
        self.worker.settle()  # every pulled partition is in: the module holds the weights
        return None

    def state_pieces(self) -> list[Piece]:
        """The model (every pulled partition in); the servers' state is in their files."""
        self.worker.settle()
        return module_pieces(self.shards)

    def optim_steps(self) -> int:
        return 0  # the servers count their own

    def load_state(self, reader: Reader, steps: int) -> None:
        self.module.load_state_dict(local_model_state(self.shards, reader))

    def optimizer_files(self, is_main: bool) -> dict[str, dict]:
        """Worker 0: every server's state, asked for with a header of clock -1."""
        if not is_main:
            return {}
        w, layout, files = self.worker, self.worker.layout, {}
        w.settle()
        for s in range(layout.servers):
            ask = torch.tensor([-1.0, w.version, 0.0], dtype=torch.float64, device=WIRE)
            w.comm.isend(ask, layout.server_rank(s), tag=HEAD).wait()
            flat = torch.empty(state_numel(layout, s, self.cfg.optim), device=WIRE)
            w.comm.irecv(flat, layout.server_rank(s), tag=STATE).wait()
            files[f"ps_server{s}.pt"] = unpack_state(flat, layout, s, self.cfg.optim)
        return files

    def load_optimizer_files(self, load: Callable[[str], dict]) -> None:
        """Nothing here: the servers read their own files (train/ps_server.py)."""
