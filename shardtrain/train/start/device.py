"""What follows from the device a rank runs on: which GPU it takes, the config checks that
need the device, and the defaults that differ on a GPU (docs/precision.md, "Defaults")."""

from __future__ import annotations

import torch

from shardtrain.config import Config, ConfigError


def gpu_ordinal(local_rank: int, local_ranks: int, visible: int, *, shared: bool) -> int:
    """This rank's GPU among the `visible` ones: its local rank's where every rank sees the
    node's GPUs; the only one where a scheduler bound each task to its own GPU (Slurm's
    --gpus-per-task=1: one CUDA_VISIBLE_DEVICES per rank). `shared`: the node's ranks share
    one environment (an elastic agent's workers: torchrun, --nproc), so one GPU visible to
    several of them is one GPU for all, which NCCL refuses."""
    if visible >= local_ranks:
        return local_rank
    if visible == 1 and not shared:
        return 0
    if shared:
        raise ConfigError(f"--nproc {local_ranks} starts {local_ranks} ranks on this node but "
                          f"it has {visible} GPU(s) visible; use --nproc {visible} or fewer "
                          "(one GPU per rank), or --train.device cpu")
    raise ConfigError(f"this node runs {local_ranks} ranks (LOCAL_WORLD_SIZE) and this one "
                      f"sees {visible} GPUs (CUDA_VISIBLE_DEVICES): bind one GPU per task "
                      "(Slurm: --gpus-per-task=1) or let every rank see all the node's GPUs")


def check_device(cfg: Config, device: torch.device) -> None:
    """The config checks that need the device: our point-to-point collective algorithms run
    on CPU tensors over Gloo, so a CUDA run (NCCL) takes comm.algorithm=native only."""
    if device.type == "cuda" and cfg.comm.algorithm != "native":
        raise ConfigError(f"comm.algorithm={cfg.comm.algorithm} runs shardtrain's own "
                          "point-to-point algorithms, which run on CPU (Gloo) only; this run "
                          f"is on CUDA (train.device={cfg.train.device}): set "
                          "--comm.algorithm native, or --train.device cpu")


def device_defaults(cfg: Config, device_type: str) -> None:
    """The defaults that depend on the device, in place (idempotent): train.precision=auto
    becomes bf16 on a GPU that computes in it natively (Ampere and later; an emulated bf16
    is slower than fp32), else fp32; on a GPU, fp32 matmuls run in TF32 unless
    train.tf32=false. The CPU run keeps fp32 and its numbers: nothing changes there."""
    cuda = device_type == "cuda"
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    cfg.train.resolve_precision(cuda=cuda, bf16=bf16)
    if cuda:  # the legacy flag: train/observe/metrics.py reads it (the two APIs cannot mix)
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
