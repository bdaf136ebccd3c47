"""Hang diagnosis (comm/flight.py, comm/watchdog.py): the flight recorder's ring and sequence
numbers, the missing-rank rule, and a 4-process run in which rank 2 sleeps inside a step:
every rank exits non-zero within comm.timeout_s + 30 s, each naming the op, the group, its
sequence number and rank 2."""

from __future__ import annotations

import pytest

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from dist import free_port
from parity import tiny, tiny_data
from shardtrain.comm.flight import FlightRecorder, group_key, missing_ranks
from shardtrain.comm.watchdog import PREFIX, Watchdog
from shardtrain.data import load_dataset

TIMEOUT_S = 10
MARGIN_S = 30


def _comm(name: str, ranks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(name=name, ranks=ranks)


def test_ring_keeps_the_last_calls_and_numbers_each_group():
    rec = FlightRecorder(capacity=4)
    dp, tp = _comm("dp", [1, 3]), _comm("tp", [0, 1])
    entries = [rec.issue(dp, "all_reduce", tag="grad", numel=10, nbytes=40) for _ in range(3)]
    entries.append(rec.issue(tp, "all_gather"))
    entries.append(rec.issue(dp, "send", peers=[1]))  # point-to-point: no number, a peer
    assert [e.seq for e in entries] == [1, 2, 3, 1, 0]
    assert rec.seqs == {"dp@1": 3, "tp@0": 1} and entries[0].key == group_key("dp", [1, 3])
    assert entries[-1].peers == (3,)
    for e in entries[:4]:
        rec.complete(e)
    ring = rec.snapshot()
    assert len(ring) == 4 and [r["seq"] for r in ring] == [2, 3, 1, 0]  # the oldest dropped
    assert [r["state"] for r in ring] == ["completed"] * 3 + ["issued"]
    assert rec.poll() is entries[-1]  # the one still pending
    assert json.loads(rec.published(entries[-1])) == {
        "seqs": {"dp@1": 3, "tp@0": 1}, "waiting": entries[-1].describe()}


def test_missing_ranks_are_those_below_the_hung_number():
    rec = FlightRecorder()
    comm = _comm("dp", [0, 1, 2, 3])
    for _ in range(5):
        entry = rec.issue(comm, "all_reduce")
    seqs = {0: {"dp@0": 5}, 1: {"dp@0": 6}, 2: {"dp@0": 4}, 3: None}  # 3 never published
    assert missing_ranks(entry, seqs) == [2, 3]
    p2p = rec.issue(comm, "recv", peers=[1])
    assert missing_ranks(p2p, seqs) == [1]


def test_watchdog_diagnoses_from_the_store_and_writes_the_dump(tmp_path):
    """Four ranks' recorders over one in-memory store: rank 0's diagnosis of its pending
    all_reduce names rank 2, whose published number is one behind."""
    store = dist.HashStore()
    comm = _comm("dp", [0, 1, 2, 3])
    dogs = []
    for rank in range(4):
        rec = FlightRecorder()
        for _ in range(3 if rank == 2 else 4):
            last = rec.issue(comm, "all_reduce", tag="grad")
        for e in list(rec.pending.values()):
            if e is not last or rank == 2:
                rec.complete(e)
        if rank == 2:  # stuck for 5 s in a tp collective: its peers' diagnosis says so
            stuck = rec.issue(_comm("tp", [2, 3]), "all_gather")
            stuck.start -= 5.0
        dog = Watchdog(rec, store, rank=rank, world_size=4, timeout_s=10.0, run_dir=tmp_path)
        dog.publish(rec.poll())
        dogs.append(dog)
    oldest = dogs[0].recorder.poll()
    assert (oldest.op, oldest.seq) == ("all_reduce", 4)
    text = dogs[0].diagnose(oldest, "test")
    assert "all_reduce #4 on group dp" in text and "did not arrive: [2]" in text
    assert "rank 2: #3, waiting in all_gather #1 on group tp" in text
    assert json.loads(store.get(f"{PREFIX}0/seq/2"))["seqs"] == {"dp@0": 3, "tp@2": 1}
    dogs[0]._dump([text])
    dump = json.loads((tmp_path / "flight" / "rank0.json").read_text())
    assert dump["diagnosis"] == [text] and dump["entries"][-1]["state"] == "issued"


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_a_rank_that_sleeps_in_a_step_ends_every_rank_with_a_diagnosis(tmp_path):
    cfg = tiny(tmp_path, "hang")
    load_dataset(cfg.data, seq_len=cfg.train.seq_len)  # the token cache, built once here
    run_dir = tmp_path / "hang"
    args = [sys.executable, "-m", "shardtrain", "train", "--config", "tiny",
            "--train.run_dir", str(run_dir), *tiny_data(tmp_path),
            "--train.steps", "6", "--comm.timeout_s", str(TIMEOUT_S),
            "--train.inject_hang", "2:3:600"]
    port = free_port()
    procs, logs = [], []
    for rank in range(4):  # as torchrun starts them (without its agent, which would kill
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),  # the rest
                   RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),  # at the first exit)
                   LOCAL_WORLD_SIZE="4", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        logs.append(open(tmp_path / f"rank{rank}.log", "w+"))
        procs.append(subprocess.Popen(args, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    deadline = time.time() + 400
    while len(ended) < 4 and time.time() < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert len(ended) == 4, "ranks still running:\n" + "\n".join(texts)
    for rank, p in enumerate(procs):
        assert p.returncode != 0, f"rank {rank} exited 0:\n{texts[rank]}"
    dumps = [json.loads((run_dir / "flight" / f"rank{r}.json").read_text()) for r in range(4)]
    # The hung collective: the oldest entry still pending on the ranks that entered it.
    hung = next(e for e in dumps[0]["entries"] if e["state"] == "issued")
    assert hung["group"] == "dp" and hung["op"] == "all_reduce"
    name = f"{hung['op']} #{hung['seq']} on group {hung['group']}"
    for rank in range(4):
        said = " ".join(line for line in texts[rank].splitlines() if "[shardtrain flight]" in line)
        assert name in said and re.search(r"did not arrive: \[2\]", said), \
            f"rank {rank}:\n{texts[rank]}"
        assert dumps[rank]["diagnosis"], rank
        # Within the timeout plus the margin of the moment the collective began.
        took = ended[rank] - hung["start"]
        assert took <= TIMEOUT_S + MARGIN_S, (rank, took)
    assert dumps[2]["seqs"][hung["key"]] == hung["seq"] - 1  # rank 2 never entered it
