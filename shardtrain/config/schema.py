"""The configuration's schema: one keyword-only dataclass per component, each validating
its own fields, and `Config.validate(world_size)` for the checks across sections."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from shardtrain.config.data import DataConfig
from shardtrain.config.errors import ConfigError, positive
from shardtrain.config.faults import check_faults
from shardtrain.config.families import check_window, moe_family
from shardtrain.config.fp8 import check_fp8
from shardtrain.config.mtp import check_mtp
from shardtrain.config.layout import (check_compile, check_context_parallel,
                                      check_expert_parallel, check_pipeline,
                                      check_tensor_parallel)
from shardtrain.config.lora import LoRAConfig, check_finetune_layout
from shardtrain.config.model import ModelConfig
from shardtrain.config.observe import check_observability
from shardtrain.config.parallel import CommConfig, ParallelConfig
from shardtrain.config.precision import check_true_precision
from shardtrain.config.ps import check_parameter_server, check_slow_ranks
from shardtrain.config.ranges import check_ranges
from shardtrain.config.replicas import FaultConfig, check_replicas


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule (linear warmup, cosine decay)."""

    # adamw8bit: train/adam8bit.py. rmsprop, adagrad: torch.optim.RMSprop / Adagrad
    # (one fp32 state each: square_avg, sum; weight decay as L2, like sgd; eps is theirs
    # too: torch's Adagrad default is 1e-10)
    name: Literal["adamw", "adamw8bit", "sgd", "rmsprop", "adagrad"] = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9  # sgd only (0: vanilla SGD, no state)
    rms_alpha: float = 0.99  # rmsprop: the squared gradients' running-average decay
    adagrad_lr_decay: float = 0.0  # adagrad: lr / (1 + (step - 1) lr_decay)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # How a bf16-true update is written into the bf16 weight (parallel/true16.py): nearest
    # rounding; stochastic (unbiased, seeded alike on every replica); kahan (a bf16
    # compensation buffer per parameter, +2 bytes each). Valid with train.precision=bf16-true.
    bf16_update: Literal["nearest", "stochastic", "kahan"] = "nearest"

    def validate(self) -> None:
        if self.warmup_steps < 0 or self.grad_clip < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0 and "
                              "optim.min_lr_ratio in [0, 1]")


@dataclass(kw_only=True)
class TrainConfig:
    """The loop: batch geometry, precision, schedule of eval, logging and samples."""

    run_dir: str = "runs/default"
    # A run into a run dir that holds another run's checkpoints is refused (they would mix:
    # train/checkpoint/rundir.py); true moves that run aside to <run_dir>.old-N first.
    overwrite: bool = False
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 256
    seed: int = 1234
    # parallel/precision.py. auto: fp32 on a CPU; on a GPU bf16 where it computes in bf16
    # natively, else fp32 (docs/precision.md, "Defaults"), resolved from the device before
    # the run (train/start/device.py); config.toml holds the resolved value.
    # bf16-true, fp16-true: parameters and gradients held in 16 bits, fp32 optimizer
    # moments, no master copy, no autocast (docs/precision.md, "16-bit training").
    precision: Literal["fp32", "bf16", "fp16", "auto", "bf16-true", "fp16-true"] = "auto"
    # fp32 matmuls on a GPU through TF32 tensor cores (10-bit mantissa, as cuBLAS rounds them;
    # about 7x an H100's fp32 peak); false: IEEE fp32. No effect on a CPU.
    tf32: bool = True
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # gradients on the wire; bf16 halves
    lr: float = 3e-3
    # none; selective: recompute the attention core (QK^T, softmax, over V) in backward
    # (Korthikanti et al. 2022); full: keep only each block's input (Chen et al. 2016).
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # cpu: what each block saves for backward goes to host memory during forward and comes
    # back one block ahead in backward (parallel/offload_activations.py, docs/recompute.md)
    activation_offload: Literal["none", "cpu"] = "none"
    # torch.compile each transformer block for the training step (parallel/compile.py);
    # the layouts it composes with: docs/configuration.md, "Compiled blocks".
    compile: bool = False
    eval_every: int = 100  # steps between evals (0: only at the end)
    eval_batches: int = 4
    log_every: int = 10
    peak_flops: float = 0.0  # per device, for MFU; 0: from the device (measured on CPU)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    tensorboard: bool = False  # the same as listing tensorboard in train.tracker
    # Experiment trackers, rank 0 only (train/observe/tracking.py): none, or a comma-separated list
    # among tensorboard, wandb, trackio; W&B's mode: auto is offline when W&B is unreachable.
    tracker: str = "none"
    tracker_project: str = "shardtrain"
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    # "A:B": a torch.profiler trace of steps A..B, one file per rank (train/observe/profile.py);
    # memory_snapshot: CUDA allocator history, dumped at the end and on out-of-memory.
    profile_steps: str = ""
    memory_snapshot: bool = False
    sample_tokens: int = 200  # generated after training; 0 disables
    # The end-of-run sample runs through the parallel model; where that needs one rank to
    # hold the whole model (tp, pp, cp, ep), only up to this many parameters (train/finetune/sample.py).
    sample_max_params: int = 2_000_000_000
    memory_check: bool = True  # refuse a layout whose planned memory exceeds the device (fits.py)
    sample_prompt: str = "def "
    slow_ranks: str = ""  # "1:1.5,3:2": those ranks' compute takes 1.5x, 2x (straggler studies)
    straggler_factor: float = 1.5  # > 1: compute over this x its peers' median (0: off; pace.py)
    straggler_patience: int = 3  # ... on this many logged steps in a row names a straggler
    export_hf: str = ""  # a directory: the final model (LoRA merged) as a Hugging Face dir
    # A step whose loss or gradient norm is not finite is skipped on every rank (no weight or
    # optimizer change; fp16 overflows that loss scaling explains do not count); after
    # max_bad_steps such steps in a row the next stops the run (0: stop at the first, as
    # Megatron's NaN check does). docs/faults.md. Test hooks: "RANK:STEP:SECONDS" makes
    # that rank sleep at the start of that step; "RANK:STEP" multiplies its loss by NaN.
    max_bad_steps: int = 0
    inject_hang: str = ""
    inject_nan: str = ""
    inject_kill: str = ""  # "RANK:STEP": SIGKILL after that step, first attempt (restart tests)
    # The blocks' linear layers in float8 through torchao (quant/float8.py, the fp8 extra):
    # tensorwise or rowwise scales; with bf16 (torchao's recipe) or fp32 precision.
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"

    def validate(self, dp: int, model: ModelConfig) -> None:
        positive("train", self, "steps", "global_batch", "micro_batch", "seq_len", "lr",
                 "eval_batches", "log_every", "straggler_patience")
        if self.global_batch % (self.micro_batch * dp):
            raise ConfigError(
                f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                f"{self.micro_batch} x dp={dp}; choose a global batch that is a multiple of "
                f"{self.micro_batch * dp}")
        if self.seq_len > model.max_seq_len:
            raise ConfigError(f"train.seq_len={self.seq_len} exceeds model.max_seq_len="
                              f"{model.max_seq_len}; lower it or raise model.max_seq_len")
        check_window(self.seq_len, model)
        check_observability(self)
        # a model no Hugging Face family holds is refused here, not after the training
        if self.export_hf and (model.n_experts or model.attention == "mla"):
            try:
                moe_family(model)
            except ConfigError as e:
                raise ConfigError(f"train.export_hf={self.export_hf!r}: {e}; drop "
                                  "train.export_hf (the final checkpoint holds the model: "
                                  "shardtrain generate --checkpoint reads it)") from None

    def accumulation_steps(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)

    def resolve_precision(self, *, cuda: bool, bf16: bool) -> None:
        """precision=auto becomes the device's default (see the field), in place; `bf16`:
        the GPU computes in bf16 natively. Any other value stays."""
        if self.precision == "auto":
            self.precision = "bf16" if cuda and bf16 else "fp32"


@dataclass(kw_only=True)
class LossScaleConfig:
    """fp16's dynamic loss scaling (parallel/precision.py LossScaler); unused otherwise."""

    initial: float = 2.0**16
    growth_interval: int = 2000  # steps without overflow before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_scale: float = 1.0  # an overflow at this scale is a bad step (max_bad_steps)

    def validate(self) -> None:
        positive("loss_scale", self, "initial", "growth_interval", "hysteresis", "min_scale")
        if self.min_scale > self.initial:
            raise ConfigError(f"loss_scale.min_scale={self.min_scale:g} exceeds "
                              f"loss_scale.initial={self.initial:g}; lower the minimum")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Atomic checkpoints under <run_dir>/checkpoints, keeping the last `keep`."""

    every: int = 0  # steps between checkpoints (0: only the final one)
    keep: int = 2
    resume: str = ""  # "", "latest" (newest in this run dir) or a checkpoint directory
    async_save: bool = False  # copy each rank's state to host, write it while training goes on
    # Host buffers a rank stages its chunks through on their way to the files (MiB): an
    # asynchronous save returns to training once all but this much is written (ckpt/stream.py);
    # 32: four 8 MiB buffers keep both writer threads fed, and a save of a 1.1 GiB state grows
    # resident memory by 85 MiB (tests/test_checkpoint.py bounds it by a tenth of the state)
    staging_mb: int = 32

    def validate(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
        if self.staging_mb < 1:
            raise ConfigError(f"checkpoint.staging_mb={self.staging_mb} must be >= 1 (MiB of "
                              "host buffers a save stages its chunks through); give "
                              "--checkpoint.staging_mb 1 or more")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def validate(self, world_size: int) -> None:
        """Every check that needs no data or process group; raises ConfigError."""
        check_ranges(self)  # first: a NaN passes every comparison below
        self.model.validate()
        self.data.validate()
        check_parameter_server(self, world_size)  # first: it says why dp does not fill the world
        self.parallel.validate(world_size)
        self.comm.validate()
        self.comm.check_layout(self.parallel, world_size)
        self.optim.validate()
        self.resolve_microbatches(self.parallel.resolved_dp(world_size))
        self.train.validate(self.parallel.resolved_dp(world_size), self.model)
        self.checkpoint.validate()
        self.loss_scale.validate()
        if self.train.grad_reduce_dtype != "fp32" and self.comm.compress != "none":
            raise ConfigError(f"train.grad_reduce_dtype={self.train.grad_reduce_dtype} sets the "
                              f"dtype gradients travel in, but comm.compress="
                              f"{self.comm.compress} already decides what travels: set one of "
                              "them (train.grad_reduce_dtype=fp32 or comm.compress=none)")
        self.lora.validate()
        check_finetune_layout(self)
        check_tensor_parallel(self)
        check_context_parallel(self)
        check_expert_parallel(self)
        check_mtp(self)
        check_pipeline(self, world_size)
        check_compile(self)
        check_fp8(self)
        check_true_precision(self)
        check_slow_ranks(self.train.slow_ranks, world_size)
        check_faults(self.train, world_size)
        check_replicas(self, world_size)
        if self.parallel.zero and self.comm.compress != "none":
            raise ConfigError(f"comm.compress={self.comm.compress} compresses data-parallel "
                              f"all-reduces; parallel.zero={self.parallel.zero} reduce-scatters "
                              "gradients instead: set comm.compress=none (ZeRO++ quantized "
                              "gradients: parallel.zero_quantized_gradients)")
        if self.data.tokenizer == "byte" and self.model.vocab_size < 256:
            raise ConfigError(f"model.vocab_size={self.model.vocab_size} is below 256, the "
                              "byte tokenizer's vocabulary; raise it to at least 256")

    def resolve_microbatches(self, dp: int) -> None:
        """The one place that decides the step's batch geometry, in place: a set
        parallel.microbatches m derives train.micro_batch = global_batch / (dp x m); m = 0
        becomes global_batch / (dp x train.micro_batch), the accumulation steps. The sampler,
        the trainer, the pipeline schedule and the written config.toml then agree."""
        p, t = self.parallel, self.train
        if p.microbatches:
            if t.global_batch % (dp * p.microbatches):
                raise ConfigError(
                    f"parallel.microbatches={p.microbatches} does not divide this data-parallel "
                    f"rank's share of train.global_batch={t.global_batch} (dp={dp}): each rank "
                    f"gets "
                    f"{t.global_batch / dp:g} sequences per step; choose a divisor of that, or "
                    "0 to derive it from train.micro_batch")
            t.micro_batch = t.global_batch // (dp * p.microbatches)
        elif t.global_batch % (t.micro_batch * dp) == 0:  # else train.validate says why not
            p.microbatches = t.global_batch // (t.micro_batch * dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
