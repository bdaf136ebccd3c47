"""Launch-time checks that need the device: our collective algorithms are refused on CUDA,
and more local ranks than GPUs is an error naming --nproc and the GPU count."""

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
    info = ProcessInfo(rank=3, world_size=4, local_rank=3, local_world_size=4)
    with pytest.raises(ConfigError, match="--nproc 4 starts 4 ranks .* has 2 GPU.*--nproc 2"):
        pick_device(kind, info)
    assert chosen == []  # refused before touching a GPU
    ok = ProcessInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert pick_device(kind, ok) == torch.device("cuda", 1) and chosen == [1]


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
