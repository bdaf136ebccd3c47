"""ZeRO-Infinity's parameter offload in one process: shards staged as far ahead as the
gathers prefetch them, the dry run's exact count of offloaded ZeRO-3 states, and the
removal of a killed attempt's state folders (the 2-rank parity and ledger rows are in
test_zero_offload.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from parity import make_mesh, tiny, tiny_data
from shardtrain.cli import main
from shardtrain.parallel.zero import offload_files
from shardtrain.parallel.zero.offload import check_offload_dir
from shardtrain.plan.layout import config_layout
from shardtrain.plan.rank_states import rank0_states
from shardtrain.train.trainer import Trainer


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_shards_are_staged_as_far_ahead_as_the_gathers(tmp_path, prefetch):
    """One process, ZeRO-3 with cpu offload: when a block computes its forward, the units
    of exactly the next `parallel.zero_prefetch` blocks have been staged from the host
    too, and no staging storage is left once the step is done."""
    cfg = tiny(tmp_path, f"p{prefetch}", "--parallel.zero", "3", "--parallel.offload", "cpu",
               "--parallel.zero_prefetch", str(prefetch), "--model.n_layers", "4",
               "--train.steps", "1")
    trainer = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    update, model = trainer.parallel.update, trainer.parallel.module
    source, staged, seen = update.gatherer.source, [], []

    def recording(unit, out):
        staged.append(unit.key[:2])  # (kind, index): a split unit's halves alike
        source(unit, out)

    update.gatherer.source = recording
    for i, block in enumerate(model.layers):  # after the gatherer's own pre-hook
        block.register_forward_pre_hook(
            lambda module, args, i=i: seen.append((i, set(staged))) if torch.is_grad_enabled()
            else None)
    trainer.train_step()
    last = len(model.layers) - 1
    for i, before in seen[:len(model.layers)]:  # the step's first forward
        want = {(1, j) for j in range(i, min(i + prefetch, last) + 1)}
        assert want <= before and (1, i + prefetch + 1) not in before, (i, before)
    assert all(u.shard.untyped_storage().nbytes() == 0 for u in update.units)


def test_dry_run_counts_offloaded_parameters_exactly(tmp_path, capsys):
    """The dry run (rank 0 of 48, ZeRO-3 nvme, units padded to 48): the exact comparison
    covers offload; no parameter or gradient bytes on the device, the offloaded bytes the planner's
    (padding included), and the state files gone with the run."""
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    overrides = ["--model.style", "gpt2", "--model.n_kv_heads", "0", "--parallel.zero", "3",
                 "--train.global_batch", "96", "--parallel.offload", "nvme",
                 "--parallel.offload_dir", str(offload_dir)]
    assert main(["train", "--dry-run-world", "48", "--config", "tiny", "--train.run_dir",
                 str(tmp_path / "dry"), *tiny_data(tmp_path), *overrides]) == 0
    assert "measured == planned exact" in capsys.readouterr().out
    report = json.loads((tmp_path / "dry" / "dry_run.json").read_text())
    cfg = tiny(tmp_path, "dry", *overrides)
    planned = rank0_states(cfg.model, config_layout(cfg, 48))
    measured = report["measured"]
    assert report["match"] is True and measured["params"] == planned.params == 0
    # fp32 master (the parameter shard), two moments and the gradient shard: 16 B/element
    assert measured["grads"] == planned.grads == 0
    assert measured["offloaded"] == planned.offloaded > 0 and measured["offloaded"] % 16 == 0
    assert not any(offload_dir.iterdir())


def test_stale_folders_of_dead_processes_are_removed_before_the_space_check(tmp_path,
                                                                            monkeypatch):
    """Only this host's folders whose process is gone (exited, or a zombie not reaped yet)
    go, and before the free space is measured; live ones, other hosts' and anything else
    stay (several ranks and jobs share the directory)."""
    host = socket.gethostname()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    names = {"dead": f"shardtrain-{host}-pid{_dead_pid()}-rank0-a1b2",
             "zombie": f"shardtrain-{host}-pid{zombie.pid}-rank3-c3d4",
             "live": f"shardtrain-{host}-pid{os.getpid()}-rank0-e5f6",
             "other host": f"shardtrain-not{host}-pid{_dead_pid()}-rank0-g7h8",
             "unrelated": "shardtrain-rank0-abcd1234"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "unit0000.fp32").write_bytes(bytes(16))
    usage = shutil.disk_usage(tmp_path)

    def disk_usage(path):  # the space check runs after the stale folders are gone
        assert not (tmp_path / names["dead"]).exists(), "space measured before the clean-up"
        return usage

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    check_offload_dir(str(tmp_path), 1)
    zombie.wait()
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names[k] for k in ("live", "other host", "unrelated")}
    assert offload_files.remove_stale_folders(tmp_path) == []  # nothing more to remove
