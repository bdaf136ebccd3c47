"""Parameter-server training against one process (the parity harness): sync with one and
with two servers, and ssp with s = 0, each with layer priority and without, reproduce the
single-process losses and weights (fp32, rtol 1e-5 / 1e-4); checkpoints carry the servers'
optimizer state and resume to the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout

from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.plan.layout_text import parse_layout
from shardtrain.plan.ps import ps_summary
from shardtrain.train.checkpoint.checkpoint import check_layout
from shardtrain.train.ps_server import run_server

STEPS = "6"
BASE = ["--train.steps", STEPS, "--train.global_batch", "8", "--train.micro_batch", "2",
        "--parallel.ps_partition_mb", "0.02"]  # ~5 KiB partitions: several per layer


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ps")


def _run(rank: int, world_size: int, texts: list[str]) -> list[dict]:
    """Each config on this rank: the trainer on a worker, the server loop on a server."""
    out = []
    for text in texts:
        cfg = config.loads(text)
        mesh = make_mesh(cfg, rank, world_size)
        if mesh.member:
            out.append(train_layout(rank, world_size, text, mesh=mesh))
        else:
            out.append(run_server(cfg, mesh))
    return out


def test_sync_and_ssp0_match_one_process(tmp):
    rows = [("sync S=1 layer", ["--parallel.ps_servers", "1"]),
            ("sync S=1 none", ["--parallel.ps_servers", "1", "--parallel.ps_priority", "none",
                               "--parallel.ps_credit", "1"]),
            ("ssp s=0 S=1", ["--parallel.ps_servers", "1", "--parallel.ps_mode", "ssp"])]
    texts = [config.to_toml(tiny(tmp, f"w3-{i}", *BASE, *o)) for i, (_, o) in enumerate(rows)]
    per_rank = run_distributed(_run, 3, texts)
    reference = train_layout(0, 1, config.to_toml(tiny(tmp, "ref", *BASE)))
    for i, (label, _) in enumerate(rows):
        # ssp reports each worker's own loss (no all-reduce that would synchronise them):
        # their mean is the step's loss.
        mean = [sum(x) / 2 for x in zip(per_rank[0][i]["losses"], per_rank[1][i]["losses"])]
        for rank in (0, 1):
            assert_parity(reference, {**per_rank[rank][i], "losses": mean},
                          f"{label} worker {rank}")
        if label.startswith("sync"):
            assert per_rank[rank][i]["losses"] == mean  # sync averages them itself
        server = per_rank[2][i]
        assert [r["staleness"] for r in server["records"]] == [0] * (2 * int(STEPS))


def test_two_servers_match_one_process_and_resume(tmp):
    rows = [("sync S=2 layer", ["--parallel.ps_servers", "2"]),
            ("sync S=2 first half", ["--parallel.ps_servers", "2", "--train.steps", "3",
                                     "--checkpoint.every", "3"])]
    texts = [config.to_toml(tiny(tmp, f"w4-{i}", *BASE, *o)) for i, (_, o) in enumerate(rows)]
    # The second half resumes the first half's checkpoint (servers' state included).
    resumed = tiny(tmp, "w4-1", *BASE, "--parallel.ps_servers", "2", "--checkpoint.resume",
                   "latest")
    per_rank = run_distributed(_run, 4, texts)
    second = run_distributed(_run, 4, [config.to_toml(resumed)])
    reference = train_layout(0, 1, config.to_toml(tiny(tmp, "ref2", *BASE)))
    for rank in (0, 1):
        assert_parity(reference, per_rank[rank][0], f"sync S=2 worker {rank}")
        joined = {**second[rank][0], "losses": per_rank[rank][1]["losses"]
                  + second[rank][0]["losses"]}
        assert_parity(reference, joined, f"resumed S=2 worker {rank}")
    files = sorted(p.name for p in (Path(tmp) / "w4-1" / "checkpoints").glob("*/ps_server*.pt"))
    assert files == ["ps_server0.pt"] * 2 + ["ps_server1.pt"] * 2  # steps 3 and 6
    # Incast: each server received N x its shard per step, the planner's prediction.
    cfg = tiny(tmp, "w4-0", *BASE, "--parallel.ps_servers", "2")
    layout = parse_layout("ps_servers=2", gpus=4, global_batch=8, precision="fp32")
    predicted = ps_summary(cfg.model, layout)["server_recv_bytes_per_step"]
    for s in (0, 1):
        summary = json.loads((Path(tmp) / "w4-0" / f"ps_server{s}.json").read_text())
        assert summary["push_recv_bytes"] == int(STEPS) * 2 * summary["shard_bytes"]
        assert summary["push_recv_bytes"] == int(STEPS) * predicted  # tiny: an even split
    # A parameter server's checkpoint resumes only with servers (and the reverse).
    checkpoint = sorted((Path(tmp) / "w4-1" / "checkpoints").glob("step_*"))[-1]
    with pytest.raises(ConfigError, match="parallel.ps_servers=2 and this run has "
                                          "parallel.ps_servers=0"):
        check_layout(checkpoint, tiny(tmp, "w4-1", *BASE), 2)
