"""ZeRO-Offload (cpu) and ZeRO-Infinity's NVMe tier: the host optimizer equals torch.optim
bit for bit, its files are written atomically and removed, stages 1-3 with either offload
reproduce the single-process run on 2 ranks and resume bitwise from a checkpoint, ZeRO-2
and 3 keep no gradient shard on the device (it is reduced into a host buffer, where the
step reads it), ZeRO-3 keeps no parameter shard on the device (ledger and planner agree to the byte, and the run
equals the on-device ZeRO-3 one bitwise), the folder of a killed attempt is removed by the
next, and a bad offload dir is refused before launch. One-process checks of the parameter
offload: test_zero_infinity.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from parity import assert_parity, make_mesh, tiny, train_layout, train_layouts
from shardtrain import config
from shardtrain.train.start.prepare import prepare_run
from shardtrain.config import ConfigError, OptimConfig
from shardtrain.parallel.zero.offload import HostOptimizer
from shardtrain.plan.layout import config_layout
from shardtrain.plan.rank_states import rank0_states
from shardtrain.train.trainer import Trainer

SHAPES = [(5, 7), (7,), (3, 4), (11,)]  # matrices are decayed, vectors not
CUT = 20  # two shards: elements [0, 20) and [20, 65) of the flat parameters


def _decay_runs() -> list[list[tuple[int, int]]]:
    """Where the matrices fall in the two shards (the flat layout is SHAPES in order)."""
    return [[(0, 20)], [(0, 15), (22, 34)]]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("name,momentum", [("adamw", 0.0), ("sgd", 0.9), ("sgd", 0.0),
                                           ("rmsprop", 0.0), ("adagrad", 0.0)])
def test_host_optimizer_equals_torch_optim(tmp_path, offload, name, momentum):
    torch.manual_seed(0)
    optim = OptimConfig(name=name, momentum=momentum, weight_decay=0.1, rms_alpha=0.9,
                        adagrad_lr_decay=0.05)
    init = [torch.randn(s) for s in SHAPES]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    groups = [{"params": [p for p in ref if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref if p.ndim < 2], "weight_decay": 0.0}]
    torch_opt = {  # torch's own, with this config's hyperparameters
        "adamw": lambda: torch.optim.AdamW(groups, lr=1e-2, betas=(optim.beta1, optim.beta2),
                                           eps=optim.eps),
        "sgd": lambda: torch.optim.SGD(groups, lr=1e-2, momentum=momentum),
        "rmsprop": lambda: torch.optim.RMSprop(groups, lr=1e-2, alpha=0.9, eps=optim.eps),
        "adagrad": lambda: torch.optim.Adagrad(groups, lr=1e-2, lr_decay=0.05, eps=optim.eps),
    }[name]()
    flat = torch.cat([t.reshape(-1) for t in init])
    # Windows of 7 elements: the nvme step streams each shard in pieces.
    make = lambda **kw: HostOptimizer([flat[:CUT], flat[CUT:]], _decay_runs(),  # noqa: E731
                                      optim, offload=offload, directory=str(tmp_path),
                                      stream_numel=7, **kw)
    # offloaded: ZeRO-3's, no device parameters to write, its gradients in host buffers
    host, offloaded = make(), make(grads=True)
    params = [flat[:CUT].clone(), flat[CUT:].clone()]
    if offload == "nvme":  # one folder per optimizer, named by this host and process
        folders = list(tmp_path.glob(f"shardtrain-{socket.gethostname()}-pid{os.getpid()}"
                                     "-rank0-*"))
        assert len(folders) == 2 and len(list(tmp_path.iterdir())) == 2
        files = sorted(p.name for p in folders[0].iterdir())
        assert files == ["unit0000.fp32", "unit0001.fp32"]  # no temporary names left
    for _ in range(5):
        grads = [torch.randn(s) for s in SHAPES]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        torch_opt.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        host.step([flat_grad[:CUT], flat_grad[CUT:]], params, lr=1e-2)
        homes = [offloaded.grad_buffer(0), offloaded.grad_buffer(1)]  # the reducer's copies
        homes[0].copy_(flat_grad[:CUT])
        homes[1].copy_(flat_grad[CUT:])
        offloaded.step(homes, None, lr=1e-2)
    want = torch.cat([p.detach().reshape(-1) for p in ref])
    assert torch.equal(torch.cat(params), want)
    assert torch.equal(torch.cat([host.master(0), host.master(1)]), want)
    # The parameters a ZeRO-3 gather stages (fetch) are the updated masters, exactly.
    staged = [torch.full((CUT,), float("nan")), torch.full((flat.numel() - CUT,), float("nan"))]
    for k, out in enumerate(staged):
        offloaded.fetch(k, out)
    assert torch.equal(torch.cat(staged), want)
    offloaded.close()
    # master + seed 002's states: Adam 2, SGD with momentum 1, vanilla 0, RMSProp 1, AdaGrad 1
    n_states = 1 + {"adamw": 2, "sgd": int(momentum > 0), "rmsprop": 1, "adagrad": 1}[name]
    assert host.memory() == {"master_bytes": 0, "optimizer_bytes": 0,
                             "offloaded_bytes": 4 * n_states * flat.numel()}
    assert offloaded.memory()["offloaded_bytes"] == 4 * (n_states + 1) * flat.numel()
    with pytest.raises(ValueError, match="grads=False"):
        host.grad_buffer(0)
    # The state round-trips through state_dict (checkpoints) into a fresh optimizer.
    state = host.state_dict()
    again = HostOptimizer([torch.zeros(CUT), torch.zeros(flat.numel() - CUT)], _decay_runs(),
                          optim, offload=offload, directory=str(tmp_path), stream_numel=7)
    again.load_state_dict(state)
    assert again.steps == 5 and torch.equal(again.master(1), host.master(1))
    host.close()
    again.close()
    assert list(tmp_path.iterdir()) == []  # the state files are gone


# ---------------------------------------------------------------- parity on 2 ranks

STEPS = "6"
ACCUMULATE = ["--train.global_batch", "8", "--train.micro_batch", "2"]  # 2 micro-batches/rank
Row = namedtuple("Row", "label overrides")


def _rows(offload_dir: str) -> list[Row]:
    rows = []
    for stage in (1, 2, 3):
        rows.append(Row(f"zero{stage} cpu offload", ["--parallel.zero", str(stage),
                                                     "--parallel.offload", "cpu"]))
        rows.append(Row(f"zero{stage} nvme offload", ["--parallel.zero", str(stage),
                                                      "--parallel.offload", "nvme",
                                                      "--parallel.offload_dir", offload_dir]))
    rows.append(Row("zero2 nvme offload sgd", ["--parallel.zero", "2", "--parallel.offload",
                                               "nvme", "--parallel.offload_dir", offload_dir,
                                               "--optim.name", "sgd"]))
    rows.append(Row("zero3", ["--parallel.zero", "3"]))  # on the device: the offload rows' twin
    return rows


def _ledger(trainer: Trainer) -> dict:
    """Worker: the ledger after the run, the planner's exact figures for this rank (adamw),
    and the device storage each ZeRO-3 unit's parameter shard holds (staging: none at rest)."""
    cfg, update = trainer.cfg, trainer.parallel.update
    out = {"ledger": trainer.memory_ledger(), "planned": None, "shard_storage": None,
           "grads_at_home": None}
    if cfg.optim.name == "adamw":
        out["planned"] = rank0_states(cfg.model, config_layout(cfg, dist.get_world_size()))
    if cfg.parallel.zero == 3:
        out["shard_storage"] = [u.shard.untyped_storage().nbytes() for u in update.units]
    if cfg.parallel.zero >= 2 and cfg.parallel.offload != "none":  # the last step's shards
        out["grads_at_home"] = [u.grad_shard is update.optimizer.grad_buffer(k)
                                for k, u in enumerate(update.units)]
    return out


def _cfg(tmp, name, overrides):
    return tiny(tmp, name, "--train.steps", STEPS, *ACCUMULATE, *overrides)


def _parity_and_resume(rank: int, world_size: int, texts: list[str], split_text: str,
                       resumed_text: str) -> tuple[list[dict], list[float]]:
    """Worker: every row; then 3 steps of the split config, a checkpoint, and a resume to the
    end (the offloaded optimizer state goes through the checkpoint)."""
    results = train_layouts(rank, world_size, texts, _ledger)
    split_cfg = config.loads(split_text)
    first = Trainer(split_cfg, make_mesh(split_cfg, rank, world_size), torch.device("cpu"))
    losses = [first.train_step()["loss"] for _ in range(3)]
    first.save()
    resumed_cfg = config.loads(resumed_text)
    resumed = Trainer(resumed_cfg, make_mesh(resumed_cfg, rank, world_size), torch.device("cpu"))
    return results, losses + resumed.run().losses


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_offload_parity_with_single_process_and_resume(tmp_path):
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    # A killed attempt's folder: the first optimizer of the next attempt removes it.
    stale = offload_dir / f"shardtrain-{socket.gethostname()}-pid{_dead_pid()}-rank1-x8k2"
    stale.mkdir()
    (stale / "unit0000.fp32").write_bytes(bytes(64))
    rows = _rows(str(offload_dir))
    texts = [config.to_toml(_cfg(tmp_path, f"row{i}", r.overrides)) for i, r in enumerate(rows)]
    split = rows[5]  # zero3 nvme offload
    assert split.label == "zero3 nvme offload"
    split_texts = [config.to_toml(_cfg(tmp_path, "split", split.overrides + more))
                   for more in ([], ["--checkpoint.resume", "latest"])]
    outputs = run_distributed(_parity_and_resume, 2, texts, *split_texts)
    per_rank = [results for results, _ in outputs]
    for rank, (results, split_losses) in enumerate(outputs):
        assert split_losses == results[5]["losses"], f"resume rank {rank}"
    references = {}
    for i, row in enumerate(rows):
        optim = ["--optim.name", "sgd"] if "sgd" in row.label else []
        key = tuple(optim)
        if key not in references:
            references[key] = train_layout(0, 1, config.to_toml(
                _cfg(tmp_path, "ref-" + "-".join(optim), optim)))
        for rank, results in enumerate(per_rank):
            assert_parity(references[key], results[i], f"{row.label} rank {rank}")
        print(f"{row.label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
    on_device = rows.index(Row("zero3", ["--parallel.zero", "3"]))
    for i, row in enumerate(rows):
        for rank, results in enumerate(per_rank):
            _check_ledger(row, results[i], results[on_device], f"{row.label} rank {rank}")
    # Every optimizer's files went with it, and the killed attempt's did too.
    assert not any(offload_dir.iterdir())


def _check_ledger(row: Row, got: dict, on_device: dict, label: str) -> None:
    """The planner's exact states are the ledger's, offloaded bytes included; offloaded
    ZeRO-2 and 3 hold their reduced gradient shards in the host optimizer's buffers, none
    on the device; offloaded ZeRO-3 holds no parameter bytes on the device and trains
    bitwise as on the device."""
    ledger = got["ledger"]
    if got["planned"] is not None:
        planned = {k: int(getattr(got["planned"], k)) for k in
                   ("params", "grads", "master", "optimizer", "offloaded")}
        held = {k: ledger[f"{k}_bytes"] for k in ("params", "grads", "master", "optimizer",
                                                  "offloaded")}
        assert held == planned, f"{label}: ledger {held} != planner {planned}"
    if "offload" in row.label and not row.label.startswith("zero1"):
        assert ledger["grads_bytes"] == 0 and set(got["grads_at_home"]) == {True}, label
    if row.label.startswith("zero3 ") and "offload" in row.label:
        assert ledger["params_bytes"] == 0 and set(got["shard_storage"]) == {0}, label
        # master (the parameter shard), two moments and the gradient shard, fp32 each
        assert ledger["offloaded_bytes"] == 4 * on_device["ledger"]["params_bytes"], label
        assert got["losses"] == on_device["losses"], f"{label}: losses differ from zero3"
        for name, w in on_device["weights"].items():
            assert torch.equal(got["weights"][name], w), f"{label}: {name} differs from zero3"
    if row.label == "zero3":  # on the device the shards are held, and counted
        assert ledger["params_bytes"] == sum(got["shard_storage"]) > 0, label


# ---------------------------------------------------------------- bad input, before launch


def _nvme(tmp_path, offload_dir):
    return tiny(tmp_path, "bad", "--parallel.zero", "3", "--parallel.offload", "nvme",
                "--parallel.offload_dir", str(offload_dir))


def test_bad_offload_dir_is_refused_before_launch(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"parallel.offload_dir=.*does not exist; create it"):
        prepare_run(_nvme(tmp_path, tmp_path / "missing"), 2, prepare_data=False)
    # /proc: a directory even root cannot create files in.
    with pytest.raises(ConfigError, match=r"parallel.offload_dir='/proc' is not writable"):
        prepare_run(_nvme(tmp_path, "/proc"), 2, prepare_data=False)
    # Out of space: the disk reports less free space than the state needs.
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(ConfigError, match=r"has 0.0 MiB free, but the offloaded optimizer "
                                          r"state needs [0-9.]+ MiB"):
        prepare_run(_nvme(tmp_path, tmp_path), 2, prepare_data=False)
    monkeypatch.undo()
    prepare_run(_nvme(tmp_path, tmp_path), 2, prepare_data=False)  # and a good one passes


@pytest.mark.parametrize("overrides,message", [
    (["--parallel.offload", "cpu"], "parallel.offload=cpu moves ZeRO's sharded optimizer"),
    (["--parallel.zero", "1", "--parallel.offload", "nvme"], "needs parallel.offload_dir"),
    (["--parallel.zero_quantized_weights", "true"], "set parallel.zero to 1, 2 or 3"),
    (["--parallel.zero", "2", "--parallel.zero_hpz", "true"], "has parallel.zero=2: set zero=3"),
])
def test_offload_and_zeropp_need_zero(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, "bad", *overrides).validate(2)
