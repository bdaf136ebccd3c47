"""A training step that logs nothing reads the device once: the skip decision
(train/syncs.py STEP_SYNCS). Its record's loss, gradient norm and times wait on the device
until a flush reads every waiting step at once (train/pending.py).

On CPU no read stalls anything, but each one is counted here where it is made: every
tensor-to-host read (item, tolist, bool, float, int, cpu, numpy) that shardtrain's own
code makes during `Trainer.advance`, named by the function that makes it. The step's host
batches reach the device without a blocking copy: pinned, non_blocking, one micro-batch
ahead (parallel/pipeline/feed.py `Feed`)."""

from __future__ import annotations

import math
import sys
from collections import Counter

import torch
import torch.nn.functional as F

from parity import make_mesh, tiny
from shardtrain.comm import CommLedger, Communicator
from shardtrain.parallel.pipeline import schedules
from shardtrain.parallel.pipeline.executor import PipelineExecutor
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


def _to_log(monkeypatch, log: list, names: dict[int, str]) -> None:
    """Record each Tensor.to of a tensor in `names` (id -> name) as (name, non_blocking)."""
    to = torch.Tensor.to

    def logged(self, *args, **kwargs):
        if id(self) in names:
            log.append((names[id(self)], kwargs.get("non_blocking", False)))
        return to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", logged)


def test_micro_batches_are_copied_without_blocking_one_ahead(monkeypatch):
    """The executor's host batches reach the device with non_blocking=True, micro-batch
    i + 1's before micro-batch i's forward runs (a meta device stands in for the GPU: a
    real copy, no pinning, which is the CUDA path's alone: next test)."""
    m, meta = 3, torch.device("meta")
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11)).to(meta)
    comm = Communicator(None, name="pp", ranks=[0], ledger=CommLedger(), device=meta)
    ex = PipelineExecutor([model], comm, loss=lambda out, y: F.cross_entropy(
        out.flatten(0, 1), y.flatten()), act_shape=(1, 5, 4), act_dtype=torch.float32,
        device=meta)
    inputs = [torch.full((1, 5), i) for i in range(m)]
    targets = [torch.full((1, 5), i) for i in range(m)]
    log: list = []
    _to_log(monkeypatch, log, {id(t): f"{kind}{i}" for kind, ts in (("in", inputs),
            ("tg", targets)) for i, t in enumerate(ts)})
    model.register_forward_pre_hook(lambda *_: log.append(("F", None)))
    ex.run(schedules.build_forward_only(1, m)[0], inputs, targets, backward=False)
    assert [name for name, _ in log if name != "F"] == ["in0", "in1", "tg0", "tg1", "in2",
                                                        "tg2"]
    assert all(non_blocking for name, non_blocking in log if name != "F"), log
    forwards = [k for k, (name, _) in enumerate(log) if name == "F"]
    for i in range(m - 1):
        assert log.index((f"in{i + 1}", True)) < forwards[i], log


def test_on_a_gpu_a_micro_batch_is_pinned_then_copied_without_blocking(monkeypatch):
    """The CUDA path with torch's pinning and copy recorded, not run (no GPU here)."""
    from shardtrain.parallel.pipeline.feed import Feed

    log: list = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: log.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: log.append(
        (str(device), non_blocking)) or self)
    feed = Feed(torch.device("cuda", 1), inputs=[torch.zeros(2, dtype=torch.long)] * 2,
                 positions=None)
    feed.take("inputs", 0)
    assert log == ["pin", ("cuda:1", True)] * 2 and not feed.has("positions")
