"""Watching a run: trackers (a W&B offline run directory and a TensorBoard event file with
every metrics.jsonl field and the resolved config, written by rank 0 alone) and the
profiler (a Chrome trace per rank with the chosen steps; the CUDA memory snapshot skipped
on a CPU with its reason); bad fields refused, naming them."""

from __future__ import annotations

import json

import pytest
import torch

from dist import run_distributed
from parity import tiny, train_layouts
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.train.observe.profile import StepProfiler
from shardtrain.train.observe.tracking import scalars_of

pytest.importorskip("wandb", reason="the wandb package (shardtrain[test]) is not installed")
pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")


def read_wandb_run(path) -> tuple[list[tuple[int, dict]], set[str]]:
    """(step, {key: value}) of each history record and the config's top-level keys, read
    from a .wandb file: a 7-byte W&B header, then LevelDB log chunks (7-byte header: crc,
    length, type FULL=1 / FIRST / MIDDLE / LAST=4) in 32 KiB blocks, each record a
    protobuf `Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, buf = path.read_bytes(), 7, b""
    history, config_keys = [], set()
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind not in (1, 4):
            continue
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(buf)
        buf = b""
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append((rec.history.step.num, {i.key or ".".join(i.nested_key):
                                                   json.loads(i.value_json)
                                                   for i in rec.history.item}))
        elif kind in ("run", "config"):
            update = rec.run.config.update if kind == "run" else rec.config.update
            config_keys |= {i.key or i.nested_key[0] for i in update}
    return history, config_keys


def test_trackers_and_trace_of_a_two_rank_run(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny(tmp_path, "run", "--train.steps", "4", "--train.tracker", "wandb,tensorboard",
               "--train.wandb_mode", "offline", "--train.profile_steps", "2:3",
               "--train.memory_snapshot", "true")
    cfg.validate(2)
    run_distributed(train_layouts, 2, [config.to_toml(cfg)])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    fields = set().union(*(scalars_of(r) for r in records))
    assert {"loss", "lr", "grad_norm", "tokens", "comm_bytes", "eval_loss",
            "rank_compute_s/0", "rank_compute_s/1"} <= fields
    # TensorBoard: one event file (rank 0's), every numeric field at every step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert fields <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in records])
    assert "config/text_summary" in acc.Tags()["tensors"]
    # W&B: one offline run (rank 0's) holding the metrics and the resolved config.
    (offline,) = (run / "wandb").glob("offline-run-*")
    (history,) = offline.glob("*.wandb")
    assert history.stat().st_size > 0
    logged, config_keys = read_wandb_run(history)
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    logged = [items for _, items in logged]
    assert fields <= set().union(*logged)
    assert logged[-1]["loss"] == pytest.approx(records[-1]["loss"])
    assert {"model", "train", "parallel", "lora"} <= config_keys
    # The profiler: a Chrome trace per rank, with a range for each of steps 2 and 3 only.
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"step 2", "step 3"} <= names and not {"step 1", "step 4"} & names
        assert len(trace["traceEvents"]) > 100  # the steps' operators too
    assert not list((run / "profile").glob("memory_snapshot*"))  # skipped on a CPU ...
    capsys.readouterr()
    StepProfiler(cfg.train, 0, torch.device("cpu")).close()  # ... saying why, in one line
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("train.memory_snapshot: skipped on cpu")


@pytest.mark.parametrize("overrides, message", [
    (["--train.tracker", "mlflow"], r"'mlflow' is not a tracker; choose none or .*tensorboard, "
                                    r"wandb, trackio"),
    (["--train.tracker", "none,wandb"], r"'none' cannot be listed"),
    (["--train.profile_steps", "3"], r"train.profile_steps='3' must be \"A:B\""),
    (["--train.profile_steps", "5:30"], r"ends after the run's last step \(train.steps=20\)"),
])
def test_bad_fields_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, "bad", *overrides).validate(1)


def test_trackio_receives_every_record_and_the_config(tmp_path):
    trackio = pytest.importorskip("trackio", reason="the trackio package is not installed")
    import sqlite3

    from shardtrain.train.observe.metrics import MetricsWriter
    from shardtrain.train.observe.tracking import open_trackers

    project = f"shardtrain-test-{tmp_path.name}"
    cfg = tiny(tmp_path, "run", "--train.tracker", "trackio", "--train.tracker_project", project)
    records = [{"step": 1, "loss": 5.5, "lr": 1e-3, "mfu": None, "bad_step": False},
               {"step": 2, "loss": 5.25, "lr": 2e-3, "mfu": 0.01, "bad_step": True}]
    writer = MetricsWriter(cfg.train.run_dir, enabled=True, resume=False,
                           trackers=open_trackers(cfg))
    for record in records:
        writer.write(record)
    writer.close()
    db = trackio.utils.TRACKIO_DIR / f"{project}.db"
    try:
        with sqlite3.connect(db) as con:
            rows = con.execute("select step, metrics from metrics order by step").fetchall()
            (saved,) = con.execute("select config from configs").fetchone()
    finally:
        for file in db.parent.glob(f"{project}.*"):
            file.unlink()
    assert [(s, json.loads(m)) for s, m in rows] == [
        (1, {"loss": 5.5, "lr": 1e-3, "bad_step": 0.0}),
        (2, {"loss": 5.25, "lr": 2e-3, "mfu": 0.01, "bad_step": 1.0})]
    assert json.loads(saved)["train"]["tracker"] == "trackio"
