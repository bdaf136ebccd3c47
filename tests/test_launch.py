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
