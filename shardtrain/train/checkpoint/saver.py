"""Writing the trainer's checkpoints: synchronously, or in a background thread.

Every rank plans its part of the save with the others (ckpt/dcp.py: the chunks several
ranks hold are written once, spread over their holders), then writes its chunks plus any
state that is its own (top-k's, a parameter server's) into the step's staging directory;
the main rank commits the checkpoint once all have (train/checkpoint/checkpoint.py). Nothing is
gathered: a rank holds its own state plus one piece-sized buffer while it writes.

Synchronously (the default), the ranks meet at a barrier once their files are staged and
again once the main rank has committed. With `checkpoint.async_save` the planning (a
collective) and a copy of what the rank writes into host memory (pinned, on a GPU) happen
on the training thread -- the one extra copy an asynchronous save needs: the step loop
goes on changing the live tensors -- and a thread writes them; the main rank's thread
commits once every rank's write results are in the staging directory. One save is in
flight at a time: the next save, and the end of the run, wait for it (`wait`).

What a killed attempt left half-written is cleared when the next one starts, by the main
rank: stale write results there would make an asynchronous commit take a file being
rewritten. No rank can save before then, as no step completes without the main rank.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

from shardtrain.ckpt.dcp import plan_save, wait_for_results
from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.pieces import gather_plans, model_key
from shardtrain.parallel.strategy import Strategy
from shardtrain.model.transformer import tied_names
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.diskspace import SpaceGuard, state_bytes


class Saver:
    def __init__(self, cfg: Config, mesh: ParallelMesh):
        self.cfg, self.mesh = cfg, mesh
        self.is_main = mesh.rank == 0
        if self.is_main:
            ckpt.clear_staging(cfg)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        root = ckpt.checkpoint_root(cfg.train.run_dir)
        self.space = SpaceGuard(root, rank=mesh.rank, world_size=mesh.world_size,
                                keep=cfg.checkpoint.keep,
                                last_good=lambda: (ckpt.list_checkpoints(root) or [None])[-1])

    def save(self, step: int, parallel: Strategy, *, sampler_state: dict[str, Any],
             layout: dict[str, int], tokenizer_file: Path | None) -> None:
        """Checkpoint `step` (a collective: every rank calls it)."""
        self.wait()  # the previous asynchronous save first
        pieces, extra = parallel.state_pieces()
        staged = ckpt.staging_dir(self.cfg, step, create=False)  # made by stage_files
        comms = [self.mesh.comm(d) for d in ("dp", "cp", "tp", "pp")]
        planned = plan_save(staged, self.mesh.rank, pieces, partial(
            gather_plans, comms=comms, rank=self.mesh.rank, world_size=self.mesh.world_size))
        # The model's ties, not this rank's: under pp the main rank's first stage holds no
        # head, and a checkpoint read whole (generate, export) needs the alias.
        aliases = {model_key(k): model_key(v) for k, v in tied_names(self.cfg.model).items()}
        files = parallel.optimizer_files(self.is_main)
        # A full disk: refused before writing, or every rank stops if a write fails
        # (train/checkpoint/diskspace.py); the main rank then removes the staging directory.
        copied = tokenizer_file.stat().st_size if tokenizer_file and self.is_main else 0
        self.space.check(step, copied + state_bytes([planned.nbytes], files), self.barrier)
        error = None
        try:
            ckpt.stage_files(self.cfg, step, files)
        except OSError as e:
            error = e
        commit = partial(ckpt.save_checkpoint, self.cfg, step=step, staged=staged,
                         world_size=self.mesh.world_size, metadata=planned.metadata,
                         aliases=aliases, extra=extra, sampler_state=sampler_state,
                         layout=layout, tokenizer_file=tokenizer_file)
        clean_up = partial(ckpt.clear_staging, self.cfg)
        if not self.cfg.checkpoint.async_save:
            try:
                if error is None:
                    planned.write()
            except OSError as e:
                error = e
            self.space.agree(step, "write", error, self.barrier, clean_up)  # all staged
            try:
                if self.is_main:
                    commit()
            except OSError as e:
                error = e
            self.space.agree(step, "commit", error, self.barrier, clean_up)  # committed
            return
        self.space.agree(step, "stage", error, self.barrier, clean_up)
        planned.snapshot()

        def write() -> None:
            try:
                planned.write()
                if self.is_main:
                    wait_for_results(staged, self.mesh.world_size, self.cfg.comm.timeout_s)
                    commit()
            except BaseException as e:  # raised by `wait`, on the training thread
                self._error = e

        self._thread = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def barrier(self) -> None:
        """All ranks: a dp, a cp, a tp, then a pp barrier (pp x dp x cp x tp is the
        world): a rank passes the last only once every rank has entered the first."""
        for dim in ("dp", "cp", "tp", "pp"):
            self.mesh.comm(dim).barrier()

    def wait(self) -> None:
        """Until the asynchronous save in flight (if any) is written (and, on the main
        rank, committed); its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the asynchronous checkpoint save failed: {error}") from error
