"""The layout and communication sections of the configuration: the degree of each parallel
dimension and its options (ZeRO, offload, ZeRO++, pipeline schedule), and how bytes move
(collective algorithm, buckets, compression). Checks that need other sections too live in
layout.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardtrain.config.errors import ConfigError, positive


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
    # Context parallelism (parallel/context/, docs/context-parallel.md): each sequence is
    # split over cp ranks. ring: K and V travel around the cp ring (Liu et al. 2023);
    # ulysses: all-to-alls trade the sequence split for a head split (Jacobs et al. 2023).
    # cp_split zigzag gives rank r chunks r and 2cp-1-r of 2cp, so causal work is even;
    # contiguous (chunk r of cp) is kept to show the imbalance it avoids.
    cp_mode: Literal["ring", "ulysses"] = "ring"
    cp_split: Literal["zigzag", "contiguous"] = "zigzag"
    node_size: int = 0  # ranks per (virtual) node; 0: LOCAL_WORLD_SIZE from the launcher
    # ZeRO over the dp group: 1 shards optimizer state and master weights, 2 also gradients,
    # 3 also parameters (gathered unit by unit, zero_prefetch units ahead; under pp the
    # step's one gather of each unit, in the stage's first forward).
    zero: int = 0
    zero_prefetch: int = 1
    # ZeRO-3: transformer blocks per flat unit (gathered, reduced and freed together): finer
    # units cost a collective's latency each, coarser ones peak memory (docs/zero.md).
    zero_unit_blocks: int = 1
    # ZeRO-3: flat: every dp rank owns 1/N_d of every unit (all-gather, reduce-scatter);
    # layer: each rank owns whole units (broadcast from the owner, reduce to it: seed 001's
    # inter-layer partitioning; parallel/zero/layer.py).
    zero_partition: Literal["flat", "layer"] = "flat"
    # ZeRO-2/3 under gradient accumulation (parallel/zero/accumulate.py): sharded reduce-
    # scatters every micro-batch (ZeRO-3 also gathers every unit twice per micro-batch);
    # unsharded keeps the full gradient (ZeRO-3 the gathered units) through the step and
    # reduces once: one micro-batch's bytes per step, for the stage's full gradient in memory.
    zero_accumulate: Literal["sharded", "unsharded"] = "sharded"
    offload: Literal["none", "cpu", "nvme"] = "none"  # where optimizer state and step live
    offload_dir: str = ""  # nvme offload: directory of the memory-mapped shard files
    zero_quantized_weights: bool = False  # ZeRO++ qwZ: int8 parameter all-gather
    zero_hpz: bool = False  # ZeRO++ hpZ: a secondary parameter shard per node
    zero_quantized_gradients: bool = False  # ZeRO++ qgZ: int8 reduce-scatter over all-to-all
    # Pipeline: micro-batches per step (0: global_batch / (dp x train.micro_batch)), the
    # schedule (zb-h1, zbv: Qi et al. 2024; dualpipev: DeepSeek-V3; pipedream-2bw:
    # asynchronous, two weight versions, Narayanan et al. 2021; docs/pipeline.md), and model
    # chunks per stage for the interleaved schedule (2 for zbv and dualpipev).
    microbatches: int = 0
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev",
                      "pipedream-2bw"] = "1f1b"
    virtual_stages: int = 1
    # Parameter server (parallel/ps/, docs/ps.md): ps_servers > 0 puts that many server
    # ranks beside the workers (the rest of the world, their dp group).
    ps_servers: int = 0
    ps_mode: Literal["sync", "async", "ssp"] = "sync"
    ps_staleness: int = 0  # ssp: steps a worker may run ahead of the slowest (0: sync)
    ps_partition_mb: float = 4.0  # pushes and pulls travel in partitions of at most this
    ps_priority: Literal["none", "layer"] = "layer"  # earliest layers first, or FIFO
    ps_credit: int = 4  # a worker's pushes in flight at once
    # Replica groups (parallel/replica/, docs/faults.md): dp splits into `replicas` groups,
    # sharded inside (ZeRO over dp / replicas: HSDP) and averaged across. `sync`: what
    # crosses groups - every_step: the gradients; local_sgd: the weights every `sync_every`
    # steps (averaged); diloco: the pseudo-gradient (weights at the last sync - averaged
    # weights) into an outer SGD with Nesterov momentum (Douillard et al. 2023, arXiv
    # 2311.08105: outer_lr 0.7, outer_momentum 0.9). sync_fragments F: streaming DiLoCo, a
    # 1/F slice of the model synchronised every sync_every / F steps.
    replicas: int = 1
    sync: Literal["every_step", "local_sgd", "diloco"] = "every_step"
    sync_every: int = 1
    sync_fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def resolved_dp(self, world_size: int) -> int:
        """dp = 0 fills the world; parameter servers are not part of it."""
        return self.dp or max(1, (world_size - self.ps_servers) // (self.tp * self.pp * self.cp))

    def validate(self, world_size: int) -> None:
        positive("parallel", self, "tp", "pp", "cp", "ep")
        if self.dp < 0 or self.node_size < 0:
            raise ConfigError("parallel.dp and parallel.node_size must be >= 0 (0 means automatic)")
        dp = self.resolved_dp(world_size)
        model_ranks = self.tp * self.pp * self.cp  # ranks one model replica spans
        workers = world_size - self.ps_servers
        if not self.dp and workers % model_ranks:
            raise ConfigError(
                f"parallel.tp={self.tp} x parallel.pp={self.pp} x parallel.cp={self.cp} = "
                f"{model_ranks} ranks per model replica does not divide the {workers} "
                f"training processes, so parallel.dp=0 cannot fill them; change tp, pp or cp, "
                "or the number of processes (--nproc)")
        product = dp * self.tp * self.pp * self.cp
        if product != world_size - self.ps_servers:
            raise ConfigError(
                f"parallel layout dp={dp} x tp={self.tp} x pp={self.pp} x cp={self.cp} = "
                f"{product} does not equal the world size {world_size}"
                f"{f' less parallel.ps_servers={self.ps_servers}' if self.ps_servers else ''}"
                f"; change parallel.dp "
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
        if self.zero_unit_blocks < 1 or (self.zero_unit_blocks != 1 and self.zero != 3):
            raise ConfigError(f"parallel.zero_unit_blocks={self.zero_unit_blocks} must be >= 1 "
                              f"and only applies to parallel.zero=3 (this run has zero="
                              f"{self.zero}): set zero=3 or drop zero_unit_blocks")
        self._validate_offload_and_zeropp()
        self._validate_layer_partition()
        self._validate_accumulate()
        positive("parallel", self, "virtual_stages")
        if (dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp x cp = {dp * self.cp}")

    def _validate_layer_partition(self) -> None:
        """The layer partition is built for ZeRO-3 over plain data parallelism."""
        if self.zero_partition == "flat":
            return
        if self.zero != 3:
            raise ConfigError(f"parallel.zero_partition={self.zero_partition} partitions "
                              f"ZeRO-3's parameters; this run has parallel.zero={self.zero}: "
                              "set zero=3 or zero_partition=flat")
        used = [f"{n}={getattr(self, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(self, n) > 1]
        used += [f"{n}=true" for n in ("zero_quantized_weights", "zero_hpz",
                                       "zero_quantized_gradients") if getattr(self, n)]
        used += [f"offload={self.offload}"] if self.offload != "none" else []
        if used:
            raise ConfigError(f"parallel.zero_partition=layer runs over plain data parallelism "
                              f"without offload or ZeRO++; this run has parallel.{used[0]}: use "
                              "zero_partition=flat or drop it")

    def _validate_accumulate(self) -> None:
        """unsharded changes what ZeRO-2 and 3 do between micro-batches, where they do it."""
        if self.zero_accumulate == "sharded":
            return
        why = ""
        if self.zero < 2:
            why = (f"parallel.zero={self.zero} keeps no sharded gradient to accumulate into "
                   "(DP and ZeRO-1 reduce once per step already): set zero=2 or 3")
        elif self.pp > 1:
            why = (f"parallel.pp={self.pp}: under a pipeline ZeRO-2 and 3 already keep the full "
                   "gradient and reduce once per step (docs/zero.md): drop zero_accumulate")
        elif self.zero_hpz:
            why = ("parallel.zero_hpz serves ZeRO-3's backward gathers, which unsharded "
                   "accumulation does not make (units stay gathered): drop one of the two")
        elif self.zero_partition == "layer":
            why = ("parallel.zero_partition=layer broadcasts whole units per micro-batch; "
                   "unsharded accumulation runs on the flat partition: drop one of the two")
        if why:
            raise ConfigError(f"parallel.zero_accumulate=unsharded with {why}")

    def _validate_offload_and_zeropp(self) -> None:
        """Offload and ZeRO++ act on ZeRO's flat shards; hpZ on stage 3's backward gathers.
        (The offload dir's existence and free space are checked by train/start/prepare.py prepare_run.)"""
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

    bucket_mb: the gradient buckets, in MiB: data parallelism's all-reduce buckets, and
    ZeRO's reduce-scatter buckets of whole consecutive units (parallel/zero/buckets.py).

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
                       "rabenseifner", "gather_broadcast", "hierarchical", "torus2d",
                       "mesh2d", "torus3d", "ring_tree", "auto"] = "native"
    bucket_mb: float = 25.0
    timeout_s: float = 300.0
    compress: Literal["none", "int8", "topk"] = "none"
    topk_ratio: float = 0.01
    topk_warmup_steps: int = 50  # topk: the sent fraction falls from 25% to topk_ratio
    quant_block: int = 256
    error_feedback: bool = True

    def validate(self) -> None:
        positive("comm", self, "bucket_mb", "timeout_s", "quant_block")
        if self.topk_warmup_steps < 0:
            raise ConfigError(f"comm.topk_warmup_steps={self.topk_warmup_steps} must be >= 0 "
                              "(0: send topk_ratio from the first step)")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"comm.topk_ratio={self.topk_ratio} must be in (0, 1] "
                              "(0.01 keeps the largest 1% of gradient entries)")

    def check_layout(self, parallel: ParallelConfig, world_size: int) -> None:
        """A grid algorithm (mesh2d, torus3d) must lay out every group of the layout (the
        mesh's dims and dp x cp), whatever the node size: refused here, before any process
        starts. ring_tree depends on where the node boundaries fall in each group: the
        communicator checks it when it is built (comm/dispatch.py on_grid)."""
        if self.algorithm not in ("mesh2d", "torus3d"):
            return
        dp = parallel.resolved_dp(world_size)
        for name, size in (("dp", dp), ("tp", parallel.tp), ("pp", parallel.pp),
                           ("cp", parallel.cp), ("dp_cp", dp * parallel.cp)):
            if size > 1 and not grid_exists(self.algorithm, size):
                raise ConfigError(no_grid(self.algorithm, size, f"group {name}"))


# The grid algorithms' dimensions. A grid of d sides, each >= 2, exists on p ranks exactly
# when p has at least d prime factors (with multiplicity); cost/topology.py lays it out.
GRID_DIMS = {"torus2d": 2, "mesh2d": 2, "torus3d": 3}


def grid_exists(algorithm: str, p: int) -> bool:
    factors, q, d = 0, p, 2
    while d * d <= q:
        while q % d == 0:
            q, factors = q // d, factors + 1
        d += 1
    return factors + (q > 1) >= GRID_DIMS[algorithm]


def no_grid(algorithm: str, p: int, where: str) -> str:
    """Why `algorithm` cannot lay out p ranks, and the fix (config and runtime errors)."""
    need = {"mesh2d": "a 2D grid: a size with two factors >= 2 (4, 6, 8, 9, ...)",
            "torus2d": "a 2D grid: a size with two factors >= 2 (4, 6, 8, 9, ...)",
            "torus3d": "a 3D torus: a size with three factors >= 2 (8, 12, 16, 18, 27, ...)",
            "ring_tree": "nodes of equal size and more than one of them (parallel.node_size "
                         "must divide the group and be smaller than it)"}[algorithm]
    return (f"{where}: comm.algorithm={algorithm} needs {need}, and this group has {p} "
            "ranks; change the layout (the group's degree, parallel.node_size) or use "
            "comm.algorithm=ring, torus2d, hierarchical or auto")
