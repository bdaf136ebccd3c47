"""Writing the trainer's checkpoints: synchronously, or in a background thread.

Every rank plans its part of the save with the others (ckpt/dcp.py: the chunks several
ranks hold are written once, spread over their holders), then writes its chunks plus any
state that is its own (top-k's, a parameter server's) into the step's staging directory;
the main rank commits the checkpoint once all have (train/checkpoint/checkpoint.py). Nothing is
gathered: a rank holds its own state plus `checkpoint.staging_mb` of staging buffers while
it writes.

The ranks agree on the outcome after the write (every rank's) and after the commit (the
main rank's), through the job's store (train/checkpoint/diskspace.py, agree.py): if any
rank failed, every rank raises the same error, naming the failing rank and the cause, and
none is left waiting. Synchronously (the default) that happens on the training thread.
Either way a rank's chunks go to its files through `checkpoint.staging_mb` of reused host
buffers (pinned, on a GPU: ckpt/stream.py). With `checkpoint.async_save` the planning (a
collective) and the staging happen on the training thread -- the copy an asynchronous
save needs: the step loop goes on changing the live tensors -- which goes back to training
once the last chunk is staged (all but the last `staging_mb` already written: a share
larger than the buffers is partly written before training resumes), and a thread waits
for the writes, agrees, and on the main rank commits; its error, the same on every
rank, is raised by `wait`, which the next save and the end of the run call: every rank
stops at that same point. One save is in flight at a time.

`committed` is the checkpoint this run committed last (or resumed from, before its first
save): what the end-of-run sample and export read and the fault messages name, never
"the newest in the directory".

What a killed attempt left half-written is cleared when the next one starts, by the main
rank: stale write results there would make a commit take a file being rewritten. No rank
can save before then, as no step completes without the main rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from shardtrain.ckpt.dcp import SavePlanned, plan_save
from shardtrain.ckpt.saveplan import PlanCache
from shardtrain.comm.threads import device_thread
from shardtrain.config import Config
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.pieces import gather_plans, model_key
from shardtrain.parallel.strategy import Strategy
from shardtrain.model.transformer import tied_names
from shardtrain.train.checkpoint import checkpoint as ckpt
from shardtrain.train.checkpoint.agree import SaveFailed
from shardtrain.train.checkpoint.diskspace import SpaceGuard, state_bytes


class Saver:
    def __init__(self, cfg: Config, mesh: ParallelMesh, *, resumed: Path | None = None):
        """`resumed`: the checkpoint the run resumed from, its last good one until it saves."""
        self.cfg, self.mesh = cfg, mesh
        self.is_main = mesh.rank == 0
        if self.is_main:
            ckpt.clear_staging(cfg)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._removing: threading.Thread | None = None  # old checkpoints being deleted
        self.plans = PlanCache()  # the save plan, reused while the layout holds
        self.space = SpaceGuard(ckpt.checkpoint_root(cfg.train.run_dir), rank=mesh.rank,
                                world_size=mesh.world_size, keep=cfg.checkpoint.keep,
                                last_good=resumed)

    @property
    def committed(self) -> Path | None:
        """The run's last good checkpoint: committed by it, or resumed from (module doc)."""
        return self.space.last_good

    def save(self, step: int, parallel: Strategy, *, sampler_state: dict[str, Any],
             layout: dict[str, int], tokenizer_file: Path | None) -> None:
        """Checkpoint `step` (a collective: every rank calls it)."""
        self.wait()  # the previous asynchronous save first
        pieces, extra = parallel.state_pieces()
        staged = ckpt.staging_dir(self.cfg, step, create=False)  # made by stage_files
        comms = [self.mesh.comm(d) for d in ("dp", "cp", "tp", "pp", "rep")]
        planned = plan_save(staged, self.mesh.rank, pieces, partial(
            gather_plans, comms=comms, rank=self.mesh.rank, world_size=self.mesh.world_size),
            device=self.mesh.device, staging_bytes=self.cfg.checkpoint.staging_mb << 20,
            cache=self.plans)
        # The model's ties, not this rank's: under pp the main rank's first stage holds no
        # head, and a checkpoint read whole (generate, export) needs the alias.
        aliases = {model_key(k): model_key(v) for k, v in tied_names(self.cfg.model).items()}
        files = parallel.optimizer_files(self.is_main)
        # A full disk is refused before writing, on every rank (train/checkpoint/diskspace.py).
        copied = tokenizer_file.stat().st_size if tokenizer_file and self.is_main else 0
        self.space.check(step, copied + state_bytes([planned.nbytes], files))
        error, sums = None, {}
        try:
            sums = ckpt.stage_files(self.cfg, step, files)
        except Exception as e:  # agreed with the write's outcome: every rank raises
            error = e
        commit = partial(ckpt.save_checkpoint, self.cfg, step=step, staged=staged,
                         world_size=self.mesh.world_size, metadata=planned.metadata,
                         aliases=aliases, extra=extra, sampler_state=sampler_state,
                         layout=layout, tokenizer_file=tokenizer_file,
                         remove=self._remove)
        finish = partial(self._write_and_commit, step, planned, sums, error, commit)
        if not self.cfg.checkpoint.async_save:
            finish()
            return
        if error is None:
            try:
                planned.start()  # staged: the live tensors may change from here
            except Exception as e:  # agreed in the background: every rank raises
                error = e
                finish = partial(self._write_and_commit, step, planned, sums, error, commit)

        def in_background() -> None:
            try:
                finish()
            except BaseException as e:  # raised by `wait`, on the training thread
                self._error = e

        # DCP's writer takes the current stream: the rank's device's (comm/threads.py).
        self._thread = device_thread(in_background, name=f"checkpoint-{step}",
                                     device=self.mesh.device)
        self._thread.start()

    def _write_and_commit(self, step: int, planned: SavePlanned, sums: dict[str, str],
                          error: BaseException | None, commit: Callable[[], Path]) -> None:
        """Every rank: write its part (unless staging its own files failed: `error`), agree;
        the main rank commits, agree; `committed` is the new checkpoint. A failure anywhere
        raises the same SaveFailed on every rank, the staging directory removed."""
        clean_up = partial(ckpt.clear_staging, self.cfg)
        try:
            if error is None:
                planned.write(sums)
        except Exception as e:
            error = e
        self.space.agree(step, "write", error, clean_up)  # every rank's part staged
        final = None
        try:
            if self.is_main:
                final = commit()
        except Exception as e:
            error = e
        self.space.agree(step, "commit", error, clean_up)  # committed
        self.space.last_good = final or ckpt.checkpoint_root(self.cfg.train.run_dir) / \
            ckpt.step_name(step)

    def _remove(self, paths: list[Path]) -> None:
        """Delete the checkpoints the last commit retired, in the background (`wait` joins)."""
        if self._removing is not None:
            self._removing.join()
        self._removing = threading.Thread(target=ckpt.remove_dirs, args=(paths,),
                                          name="checkpoint-remove", daemon=True)
        self._removing.start()

    def wait(self) -> None:
        """Until the asynchronous save in flight (if any) is written and committed and the
        checkpoints it retired are deleted; its error, the same on every rank, if it
        failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._removing is not None:
            self._removing.join()
            self._removing = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, SaveFailed):
                raise error
            raise RuntimeError(f"the asynchronous checkpoint save failed: {error}") from error
