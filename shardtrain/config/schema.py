"""The configuration's schema: one keyword-only dataclass per component, each validating
its own fields, and `Config.validate(world_size)` for the checks across sections."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from shardtrain.config.errors import ConfigError
from shardtrain.config.layout import check_pipeline, check_tensor_parallel


@dataclass(kw_only=True)
class ModelConfig:
    """Decoder-only transformer shape. `style` picks the block design."""

    style: Literal["llama", "gpt2"] = "llama"
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 means n_heads (plain multi-head attention)
    ffn_dim: int = 0  # 0 means 4 * dim (gpt2) or the Llama rule 2/3 * 4 * dim rounded to 64
    max_seq_len: int = 256
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 0  # 0: dense MLP; > 0: mixture of experts with top-k routing
    moe_top_k: int = 2

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.style == "gpt2":
            return 4 * self.dim
        return 64 * ((int(2 * 4 * self.dim / 3) + 63) // 64)

    def validate(self) -> None:
        _positive(self, "vocab_size", "dim", "n_layers", "n_heads", "max_seq_len")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                "pick a head count that divides the width")
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                f"{self.n_kv_heads}; grouped-query attention needs n_heads to be a multiple "
                "of n_kv_heads (0 means n_kv_heads = n_heads)")
        if self.style == "gpt2" and self.n_kv_heads not in (0, self.n_heads):
            raise ConfigError("model.n_kv_heads: the gpt2 style has no grouped-query attention; "
                              "set it to 0")
        if self.style == "llama" and self.head_dim % 2:
            raise ConfigError(f"model.dim / model.n_heads = {self.head_dim} must be even for RoPE")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.moe_top_k <= self.n_experts):
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} must lie in 1..model.n_experts="
                              f"{self.n_experts}")


@dataclass(kw_only=True)
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    source: str = "stdlib"  # "stdlib", a file, a directory, a glob, or a .jsonl file
    text_field: str = "text"  # the field read from each JSONL record
    tokenizer: str = "byte"  # "byte", "bpe" (trained locally), or a path to a tokenizer.json
    bpe_vocab_size: int = 4096
    max_bytes: int = 0  # read at most this many bytes of text (0: all of it)
    eval_fraction: float = 0.02  # tail of the token stream held out for eval loss
    cache_dir: str = "~/.cache/shardtrain"

    def validate(self) -> None:
        if not 0.0 < self.eval_fraction < 0.5:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must lie in (0, 0.5)")
        _positive(self, "bpe_vocab_size")
        if self.max_bytes < 0:
            raise ConfigError("data.max_bytes must be >= 0 (0 reads everything)")


@dataclass(kw_only=True)
class ParallelConfig:
    """The layout: degrees of each parallel dimension. dp=0 fills the world. sp: sequence
    parallelism inside each tensor-parallel group (needs tp > 1)."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    node_size: int = 0  # ranks per (virtual) node; 0: LOCAL_WORLD_SIZE from the launcher
    # ZeRO over the dp group: 1 shards optimizer state and master weights, 2 also gradients,
    # 3 also parameters (gathered unit by unit, zero_prefetch units ahead).
    zero: int = 0
    zero_prefetch: int = 1
    offload: Literal["none", "cpu", "nvme"] = "none"  # where optimizer state and step live
    offload_dir: str = ""  # nvme offload: directory of the memory-mapped shard files
    zero_quantized_weights: bool = False  # ZeRO++ qwZ: int8 parameter all-gather
    zero_hpz: bool = False  # ZeRO++ hpZ: a secondary parameter shard per node
    zero_quantized_gradients: bool = False  # ZeRO++ qgZ: int8 reduce-scatter over all-to-all
    # Pipeline: micro-batches per step (0: global_batch / (dp x train.micro_batch)), the
    # schedule, and model chunks per stage for the interleaved schedule.
    microbatches: int = 0
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = 1

    def resolved_dp(self, world_size: int) -> int:
        return self.dp or max(1, world_size // (self.tp * self.pp * self.cp))

    def validate(self, world_size: int) -> None:
        _positive(self, "tp", "pp", "cp", "ep")
        if self.dp < 0 or self.node_size < 0:
            raise ConfigError("parallel.dp and parallel.node_size must be >= 0 (0 means automatic)")
        dp = self.resolved_dp(world_size)
        product = dp * self.tp * self.pp * self.cp
        if product != world_size:
            raise ConfigError(
                f"parallel layout dp={dp} x tp={self.tp} x pp={self.pp} x cp={self.cp} = "
                f"{product} does not equal the world size {world_size}; change parallel.dp "
                f"(or set it to 0 to fill the world) or the number of processes (--nproc)")
        if not 0 <= self.zero <= 3:
            raise ConfigError(f"parallel.zero={self.zero} must be 0, 1, 2 or 3 (0: plain data "
                              "parallel; 1, 2, 3: ZeRO stage)")
        if self.zero_prefetch < 0 or self.microbatches < 0:
            raise ConfigError("parallel.zero_prefetch and parallel.microbatches must be >= 0")
        if self.zero_prefetch != 1 and self.zero != 3:
            raise ConfigError(f"parallel.zero_prefetch={self.zero_prefetch} only applies to "
                              f"parallel.zero=3 (units of parameters gathered ahead); this run "
                              f"has parallel.zero={self.zero}: drop zero_prefetch or set zero=3")
        self._validate_offload_and_zeropp()
        _positive(self, "virtual_stages")
        if (dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp x cp = {dp * self.cp}")
        for name in ("cp", "ep"):
            if getattr(self, name) > 1:
                raise ConfigError(
                    f"parallel.{name}={getattr(self, name)}: the trainer supports data, tensor "
                    f"and pipeline parallelism only in this release; set parallel.{name}=1")

    def _validate_offload_and_zeropp(self) -> None:
        """Offload and ZeRO++ act on ZeRO's flat shards; hpZ on stage 3's backward gathers.
        (The offload dir's existence and free space are checked by cli.prepare_run.)"""
        if self.offload != "none" and self.zero == 0:
            raise ConfigError(f"parallel.offload={self.offload} moves ZeRO's sharded optimizer "
                              "state off the device: set parallel.zero to 1, 2 or 3")
        if self.offload == "nvme" and not self.offload_dir:
            raise ConfigError("parallel.offload=nvme needs parallel.offload_dir: a directory on "
                              "a fast local disk for the optimizer state files")
        for name in ("zero_quantized_weights", "zero_quantized_gradients"):
            if getattr(self, name) and self.zero == 0:
                raise ConfigError(f"parallel.{name} quantizes ZeRO's collectives: set "
                                  "parallel.zero to 1, 2 or 3")
        if self.zero_hpz and self.zero != 3:
            raise ConfigError(f"parallel.zero_hpz keeps a node-local copy for ZeRO-3's backward "
                              f"all-gathers; this run has parallel.zero={self.zero}: set zero=3")


@dataclass(kw_only=True)
class CommConfig:
    """How bytes move: the collective algorithm, gradient bucketing and compression.

    algorithm: the backend's own (native), one of ours on point-to-point messages, or auto
    (the cost model picks per call). compress: what data parallelism sends. int8: the
    gradient all-reduce, block-wise quantized (quant_block values per scale). topk: not the
    gradient but each rank's optimizer update (parallel/data/topk.py): every dp rank
    clips its own gradient by its own norm and steps its own optimizer, sends the largest
    topk_ratio of each parameter tensor's update (plus what it kept from earlier steps, unless
    error_feedback=false) as values and indices, and every rank applies the average; a rank
    resets its momentum at the entries it sent. topk_warmup_steps > 0: the fraction sent falls
    from 25% to topk_ratio over those first steps. Under topk the optimizer state is per dp
    rank (checkpoints resume only in the same layout), the logged grad_norm is rank 0's
    local one, and bucket_mb does not apply (one exchange per step)."""

    algorithm: Literal["native", "ring", "tree", "recursive_doubling", "halving_doubling",
                       "rabenseifner", "hierarchical", "torus2d", "auto"] = "native"
    bucket_mb: float = 25.0
    timeout_s: float = 300.0
    compress: Literal["none", "int8", "topk"] = "none"
    topk_ratio: float = 0.01
    topk_warmup_steps: int = 50  # topk: the sent fraction falls from 25% to topk_ratio
    quant_block: int = 256
    error_feedback: bool = True

    def validate(self) -> None:
        _positive(self, "bucket_mb", "timeout_s", "quant_block")
        if self.topk_warmup_steps < 0:
            raise ConfigError(f"comm.topk_warmup_steps={self.topk_warmup_steps} must be >= 0 "
                              "(0: send topk_ratio from the first step)")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"comm.topk_ratio={self.topk_ratio} must be in (0, 1] "
                              "(0.01 keeps the largest 1% of gradient entries)")


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule (linear warmup, cosine decay)."""

    name: Literal["adamw", "sgd"] = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # global-norm clipping; 0 disables

    def validate(self) -> None:
        if self.warmup_steps < 0 or self.grad_clip < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0 and "
                              "optim.min_lr_ratio in [0, 1]")


@dataclass(kw_only=True)
class TrainConfig:
    """The loop: batch geometry, precision, schedule of eval, logging and samples."""

    run_dir: str = "runs/default"
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 256
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    lr: float = 3e-3
    activation_checkpointing: Literal["none", "full"] = "none"
    eval_every: int = 100  # steps between evals (0: only at the end)
    eval_batches: int = 4
    log_every: int = 10
    peak_flops: float = 0.0  # per device, for MFU; 0: from the device (measured on CPU)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    tensorboard: bool = False
    sample_tokens: int = 200  # generated after training; 0 disables
    sample_prompt: str = "def "

    def validate(self, dp: int, model: ModelConfig) -> None:
        _positive(self, "steps", "global_batch", "micro_batch", "seq_len", "lr", "eval_batches",
                  "log_every")
        if self.global_batch % (self.micro_batch * dp):
            raise ConfigError(
                f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                f"{self.micro_batch} x dp={dp}; choose a global batch that is a multiple of "
                f"{self.micro_batch * dp}")
        if self.seq_len > model.max_seq_len:
            raise ConfigError(f"train.seq_len={self.seq_len} exceeds model.max_seq_len="
                              f"{model.max_seq_len}; lower it or raise model.max_seq_len")

    def accumulation_steps(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)


@dataclass(kw_only=True)
class CheckpointConfig:
    """Atomic checkpoints under <run_dir>/checkpoints, keeping the last `keep`."""

    every: int = 0  # steps between checkpoints (0: only the final one)
    keep: int = 2
    resume: str = ""  # "", "latest" (newest in this run dir) or a checkpoint directory

    def validate(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, world_size: int) -> None:
        """Every check that needs no data or process group; raises ConfigError."""
        self.model.validate()
        self.data.validate()
        self.parallel.validate(world_size)
        self.comm.validate()
        self.optim.validate()
        self.resolve_microbatches(self.parallel.resolved_dp(world_size))
        self.train.validate(self.parallel.resolved_dp(world_size), self.model)
        self.checkpoint.validate()
        check_tensor_parallel(self)
        check_pipeline(self)
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
                    f"rank's share of train.global_batch={t.global_batch} (dp={dp}): each rank gets "
                    f"{t.global_batch / dp:g} sequences per step; choose a divisor of that, or "
                    "0 to derive it from train.micro_batch")
            t.micro_batch = t.global_batch // (dp * p.microbatches)
        elif t.global_batch % (t.micro_batch * dp) == 0:  # else train.validate says why not
            p.microbatches = t.global_batch // (t.micro_batch * dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _positive(obj: Any, *names: str) -> None:
    section = _SECTION_OF[type(obj)]
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)} must be positive")


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
_SECTION_OF = {cls: name for name, cls in SECTIONS.items()}
