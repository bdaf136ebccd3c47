"""The non-finite step guard (train/guard.py over parallel/precision.py's skip rule): a NaN
loss injected on one rank of a 2-process dp run skips that step on every rank (no weight or
optimizer change), is logged in metrics.jsonl, and past train.max_bad_steps stops the run
naming the step and the last good checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from parity import checkpoint_tensors, make_mesh, tiny
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.train.guard import BadStepGuard, NonFiniteError
from shardtrain.train.trainer import Trainer


def _train(rank: int, world_size: int, text: str) -> dict:
    cfg = config.loads(text)
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    try:
        result = trainer.run()
    except NonFiniteError as e:
        return {"error": str(e), "step": trainer.step}
    return {"records": [{k: r[k] for k in ("step", "loss", "skipped", "bad_step")}
                        for r in result.history],
            "weights": {k: v.clone() for k, v in trainer.parallel.module.state_dict().items()}}


def _states(run_dir: Path, step: int) -> tuple[dict, dict]:
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    return checkpoint_tensors(ckpt, "model/"), checkpoint_tensors(ckpt, "optim/")


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_nan_on_one_rank_skips_the_step_everywhere_then_stops_the_run(tmp_path):
    common = ["--train.steps", "5", "--optim.warmup_steps", "1", "--checkpoint.keep", "9"]
    ride = tiny(tmp_path, "ride", *common, "--checkpoint.every", "1",
                "--train.inject_nan", "1:3", "--train.max_bad_steps", "1")
    stop = tiny(tmp_path, "stop", *common, "--checkpoint.every", "2",
                "--train.inject_nan", "0:3")
    assert stop.train.max_bad_steps == 0  # the default: stop at the first bad step
    out = run_distributed(_train, 2, config.to_toml(ride), timeout_s=600)
    # A run that rides it out: step 3 skipped on both ranks, the others applied.
    for r in out:
        assert [(x["skipped"], x["bad_step"]) for x in r["records"]] == \
            [(False, False)] * 2 + [(True, True)] + [(False, False)] * 2
    assert _equal(out[0]["weights"], out[1]["weights"])  # the replicas never diverged
    run_dir = Path(ride.train.run_dir)
    (m2, o2), (m3, o3), (m4, o4) = (_states(run_dir, s) for s in (2, 3, 4))
    assert _equal(m2, m3) and _equal(o2, o3)  # step 3 changed no weight, no optimizer state
    assert not _equal(m3, m4) and not _equal(o3, o4)  # step 4 did
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["bad_step"] for x in logged] == [False, False, True, False, False]
    # The default limit: the run stops at step 3 on both ranks, naming the checkpoint.
    out = run_distributed(_train, 2, config.to_toml(stop), timeout_s=600)
    last = Path(stop.train.run_dir) / "checkpoints" / "step_00000002"
    for r in out:
        assert r["step"] == 3 and r["error"].startswith("step 3: loss nan"), r
        assert f"last good checkpoint is {last}" in r["error"]
        assert "train.max_bad_steps=0" in r["error"]
    logged = (Path(stop.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    assert json.loads(logged[-1])["step"] == 3 and json.loads(logged[-1])["bad_step"]


def test_the_guard_counts_bad_steps_in_a_row(tmp_path):
    guard = BadStepGuard(1, "bf16", last_good=lambda: None)
    record = lambda step, bad: {"step": step, "loss": float("nan") if bad else 1.0,  # noqa
                                "grad_norm": 1.0, "bad_step": bad}
    for step, bad in enumerate([True, False, True, False], 1):
        guard.check(record(step, bad))  # one at a time is ridden out
    guard.check(record(5, True))
    with pytest.raises(NonFiniteError, match=r"step 6: .*2 non-finite step\(s\) in a row.*"
                                             r"no checkpoint yet"):
        guard.check(record(6, True))
    assert guard.total == 4


@pytest.mark.parametrize("field, value, match", [
    ("max_bad_steps", "-1", "train.max_bad_steps=-1 must be >= 0"),
    ("inject_nan", "1", "is not RANK:STEP"),
    ("inject_hang", "1:2", "is not RANK:STEP:SECONDS"),
    ("inject_nan", "4:2", "the rank must lie in 0..1"),
])
def test_fault_fields_are_validated(tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=match):
        tiny(tmp_path, "bad", f"--train.{field}", value).validate(2)
