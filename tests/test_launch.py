"""Launch-time checks that need the device: our collective algorithms are refused on CUDA,
more local ranks than GPUs is an error naming --nproc and the GPU count, a rank bound to its
own GPU takes it, local ranks share the cores; a worker leaves its groups in order; a
script launches a worker of its own."""

import os

import pytest
import torch

from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.launch import check_device


@pytest.mark.parametrize("algorithm", ["ring", "auto", "hierarchical"])
def test_our_algorithms_are_refused_on_cuda(algorithm):
    cfg = config.load("tiny", ["--comm.algorithm", algorithm])
    check_device(cfg, torch.device("cpu"))  # fine on CPU
    with pytest.raises(ConfigError, match=f"comm.algorithm={algorithm} .*--comm.algorithm native"):
        check_device(cfg, torch.device("cuda", 0))
    check_device(config.load("tiny"), torch.device("cuda", 0))  # native is fine on CUDA


@pytest.mark.parametrize("kind", ["cuda", "auto"])
def test_more_local_ranks_than_gpus_is_an_error_naming_nproc(kind, monkeypatch):
    from shardtrain.launch import ProcessInfo, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    info = ProcessInfo(rank=3, world_size=4, local_rank=3, local_world_size=4, agent=True)
    with pytest.raises(ConfigError, match="--nproc 4 starts 4 ranks .* has 2 GPU.*--nproc 2"):
        pick_device(kind, info)
    assert chosen == []  # refused before touching a GPU
    ok = ProcessInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, agent=True)
    assert pick_device(kind, ok) == torch.device("cuda", 1) and chosen == [1]


@pytest.mark.parametrize("visible, agent, want", [
    (8, False, 5), (8, True, 5),  # every rank sees the node's GPUs: its local rank's
    (1, False, 0),  # Slurm --gpus-per-task=1: the one GPU bound to this task
    (1, True, "--nproc 8 starts 8 ranks"),  # an agent's workers share one GPU: refused
    (2, False, "bind one GPU per task"),
])
def test_a_rank_takes_its_own_gpu_under_per_task_binding(visible, agent, want):
    from shardtrain.launch import gpu_ordinal

    if isinstance(want, int):
        assert gpu_ordinal(5, 8, visible, shared=agent) == want
    else:
        with pytest.raises(ConfigError, match=want):
            gpu_ordinal(5, 8, visible, shared=agent)


def test_local_ranks_share_the_cores_on_a_gpu_too():
    """ZeRO-Offload's host Adam and a parameter server's host work run in torch's threads:
    with no OMP_NUM_THREADS (--nproc sets none) each rank took every core."""
    import os

    from shardtrain.launch import ProcessInfo, init_distributed

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        init_distributed(ProcessInfo(local_world_size=4), torch.device("cuda", 0), 60.0)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 4)
    finally:
        torch.set_num_threads(before)


def test_the_process_info_knows_an_elastic_agent(monkeypatch):
    from shardtrain.launch import ProcessInfo

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not ProcessInfo.from_env().agent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert ProcessInfo.from_env().agent


def test_run_worker_frees_what_holds_a_group_before_it_leaves(tmp_path, monkeypatch):
    """The mesh (its communicators hold the groups), the watchdog and the trainer die before
    the barrier and destroy_process_group (benchmarks/teardown.py: a group's destructor run
    after destroy, from its last holder's, deadlocked against the group's own thread)."""
    import gc
    import weakref

    import torch.distributed as dist

    from shardtrain import launch
    from shardtrain.train import trainer as trainer_mod

    held: list[weakref.ref] = []

    class Holder:  # in a reference cycle: freed by the garbage collector only
        def __init__(self, *args):
            self.me, self.args = self, args
            held.append(weakref.ref(self))

        def run(self, interrupt):
            return trainer_mod.TrainResult(history=[{"step": 1, "loss": 1.0}], eval_loss=1.0)

        def stop(self):
            pass

    monkeypatch.setattr(trainer_mod, "Trainer", Holder)
    monkeypatch.setattr(launch, "start_watchdog", lambda mesh, cfg, info: Holder(mesh))
    seen = []
    barrier, destroy = dist.barrier, dist.destroy_process_group
    monkeypatch.setattr(dist, "barrier", lambda: (seen.append(
        ("barrier", [r() is None for r in held])), barrier()))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (seen.append(
        ("destroy", [r() is None for r in held])), destroy()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    text = config.to_toml(config.load("tiny", ["--train.run_dir", str(tmp_path / "run"),
                                               "--train.device", "cpu"]))
    gc.disable()  # only run_worker's own collection may free the cycles
    try:
        assert launch.run_worker(text) == {"losses": [1.0], "eval_loss": 1.0}
    finally:
        gc.enable()
        if dist.is_initialized():
            destroy()
    assert seen == [("barrier", [True, True]), ("destroy", [True, True])]


def test_the_fits_check_leaves_a_gpu_room_for_context_nccl_and_fragmentation(monkeypatch):
    """The planner's usable fraction of the card (cost/hardware.py), not the whole card."""
    from types import SimpleNamespace

    from shardtrain.train.start.fits import rank_capacity

    totals = [80 * 2**30, 79 * 2**30]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=totals[i]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    capacity, what = rank_capacity("cuda", 8)
    assert capacity == int(0.9 * 79 * 2**30) and "usable" in what


def test_a_script_launches_a_worker_it_defines(tmp_path):
    """The benchmarks' pattern: a script's own worker reaches the ranks (the launcher hides
    __main__ only from an entrypoint defined elsewhere; hidden, pickle could not find it)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "bench.py"
    script.write_text("from shardtrain.launch import launch_local\n\n"
                      "def worker(x):\n    return x * 2\n\n"
                      "if __name__ == '__main__':\n    print(launch_local(2, worker, 21))\n")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "{0: 42, 1: 42}"
