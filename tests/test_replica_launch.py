"""fault.mode = replicas without a process: each group's config from the launcher
(launch_replicas.py), the env contract's refusals, and the report's replica events
(train/observe/replica_chart.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardtrain.config import Config, ConfigError
from shardtrain.launch_replicas import check_groups, group_config
from shardtrain.config.replicas import REPLICA_ENV
from shardtrain.parallel.replica.torchft_group import replica_from_env
from shardtrain.train.observe.replica_chart import plot_replica_loss, replica_lines


def _cfg() -> Config:
    cfg = Config()
    cfg.parallel.replicas, cfg.fault.mode = 2, "replicas"
    cfg.train.run_dir, cfg.train.inject_kill = "runs/x", "3:5"
    return cfg


def test_group_configs_and_env(monkeypatch):
    cfg = _cfg()
    g0, g1 = group_config(cfg, 0, 4), group_config(cfg, 1, 4)
    assert (Path(g0.train.run_dir), Path(g1.train.run_dir)) == (Path("runs/x/replica_0"),
                                                                Path("runs/x/replica_1"))
    # global rank 3 = group 1's local rank 1; group 0 is not killed
    assert (g0.train.inject_kill, g1.train.inject_kill) == ("", "1:5")
    assert cfg.train.run_dir == "runs/x"  # the job's config is left as it was
    with pytest.raises(ConfigError, match="multiple of parallel.replicas=2"):
        check_groups(cfg, 3)
    monkeypatch.setenv(REPLICA_ENV, "1")
    assert replica_from_env(cfg) == 1
    for bad in ("2", "", "x"):
        monkeypatch.setenv(REPLICA_ENV, bad)
        with pytest.raises(ConfigError, match=f"set {REPLICA_ENV} to this group's index, 0..1"):
            replica_from_env(cfg)


def test_report_marks_loss_and_rejoin(tmp_path):
    base = {"loss": 5.0, "committed": True}
    records = [{**base, "step": 5, "quorum": 2, "groups": [0, 1]},
               {**base, "step": 5, "quorum": 2, "groups": [0, 1], "committed": False},
               {**base, "step": 6, "quorum": 1, "groups": [0], "lost": [1]},
               {**base, "step": 7, "quorum": 2, "groups": [0, 1], "rejoined": [1],
                "sent_bytes": 2**20}]
    lines = replica_lines(records)
    assert lines[0] == "replica groups: quorum sizes [1, 2], 3 event(s)"
    assert lines[1:] == ["  step 5: not applied (a group failed inside it; taken again)",
                         "  step 6: lost group(s) [1], quorum 1 [0]",
                         "  step 7: group(s) [1] rejoined (1.00 MiB sent), quorum 2 [0, 1]"]
    assert plot_replica_loss(records, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
    plain = [{**base, "step": 1}]  # a run without replica groups: nothing said or drawn
    assert replica_lines(plain) == [] and not plot_replica_loss(plain, tmp_path / "no.png")
