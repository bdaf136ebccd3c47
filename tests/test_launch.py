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
