"""A training step that logs nothing reads the device once: the skip decision
(train/syncs.py STEP_SYNCS). Its record's loss, gradient norm and times wait on the device
until a flush reads every waiting step at once (train/pending.py).

On CPU no read stalls anything, but each one is counted here where it is made: every
tensor-to-host read (item, tolist, bool, float, int, cpu, numpy) that shardtrain's own
code makes during `Trainer.advance`, named by the function that makes it."""

from __future__ import annotations

import math
import sys
from collections import Counter

import torch

from parity import make_mesh, tiny
from shardtrain.train.syncs import STEP_SYNCS
from shardtrain.train.trainer import Trainer

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
PACKAGE = str(Trainer.__module__.split(".")[0])


def _reader() -> tuple[str, str] | None:
    """(file under shardtrain/, function) of the read's caller, if shardtrain's own code
    (torch's own reads, such as its optimizers' host step counters, are torch's)."""
    frame = sys._getframe(2)
    while frame.f_code.co_name.startswith("<") and frame.f_back is not None:
        frame = frame.f_back  # a comprehension's reads are its function's
    path = frame.f_code.co_filename.replace("\\", "/")
    return (path.rsplit(f"/{PACKAGE}/", 1)[1], frame.f_code.co_name) \
        if f"/{PACKAGE}/" in path else None


def test_a_step_that_logs_nothing_reads_the_device_once(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "run", "--train.steps", "3", "--train.log_every", "3",
               "--train.eval_every", "0")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    reads: Counter = Counter()
    for name in READS:
        read = getattr(torch.Tensor, name)

        def counted(self, *args, _read=read, _name=name, **kwargs):
            if (where := _reader()) is not None:
                reads[(*where, _name)] += 1
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    records = []
    for _ in range(2):  # steps 1 and 2 log nothing
        reads.clear()
        records.append(trainer.advance())
        # the decision, and each micro-batch's counted targets (the sampler's host tensors)
        assert reads == {("parallel/precision.py", "read_flags", "tolist"): 1,
                         ("parallel/pipeline/runtime.py", "_weights", "__int__"):
                             cfg.train.accumulation_steps(1)}, reads
        assert {k[:2] for k in reads} <= {k[:2] for k in STEP_SYNCS}
        assert records[-1]["loss"] is None and records[-1]["step_time_s"] is None
    reads.clear()
    records.append(trainer.advance())
    flushed = trainer.pending.flush()  # step 3 logs: one read of the three steps' values
    assert flushed == records and [r["step"] for r in records] == [1, 2, 3]
    assert reads[("train/pending.py", "flush", "tolist")] == 1
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["wait_s"] >= 0
