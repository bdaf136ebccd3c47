"""The checks that need the model and the layout together (tensor, pipeline, context and
expert parallelism), run by `Config.validate` before any process starts."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from shardtrain.config.errors import ConfigError
from shardtrain.config.pipedream import check_pipedream

if TYPE_CHECKING:
    from shardtrain.config.schema import Config


def check_pipeline(cfg: Config, world_size: int) -> None:
    """Every stage needs a layer; the interleaved schedule (Narayanan et al. 2021) needs
    several equal chunks per stage and whole rounds of pp micro-batches. Every ZeRO stage
    composes (zero/model.py: stages 2 and 3 reduce once per step under a pipeline)."""
    m, p = cfg.model, cfg.parallel
    check_pipedream(cfg)
    if p.pp > 1 and p.zero_hpz:
        raise ConfigError(f"parallel.zero_hpz with parallel.pp={p.pp}: under a pipeline ZeRO-3 "
                          "gathers each unit once per step, before the forward, and keeps it "
                          "through the backward, so hpZ's node-local copy (which serves the "
                          "backward's gathers) would never be read; drop parallel.zero_hpz")
    if p.pp > m.n_layers:
        raise ConfigError(f"parallel.pp={p.pp} exceeds model.n_layers={m.n_layers}: every "
                          "pipeline stage needs at least one layer; lower parallel.pp")
    if p.schedule in ("zbv", "dualpipev"):
        check_v_shape(cfg, world_size)
        return
    if p.schedule != "interleaved":
        if p.virtual_stages > 1:
            raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs "
                              f"parallel.schedule=interleaved, zbv or dualpipev (schedule="
                              f"{p.schedule} runs one chunk per stage); set the schedule or "
                              "virtual_stages=1")
        return
    if p.pp < 2 or p.virtual_stages < 2:
        raise ConfigError(f"parallel.schedule=interleaved needs parallel.pp >= 2 and "
                          f"parallel.virtual_stages >= 2 (got pp={p.pp}, virtual_stages="
                          f"{p.virtual_stages}); use schedule=1f1b for one chunk per stage")
    if m.n_layers % (p.pp * p.virtual_stages):
        raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by parallel.pp="
                          f"{p.pp} x parallel.virtual_stages={p.virtual_stages}: the "
                          "interleaved schedule needs equal chunks; change either")
    if p.microbatches % p.pp:
        raise ConfigError(f"parallel.microbatches={p.microbatches} is not a multiple of "
                          f"parallel.pp={p.pp}: the interleaved schedule sends micro-batches "
                          "through each chunk in rounds of pp; change parallel.microbatches "
                          "(or train.micro_batch)")

def check_v_shape(cfg: Config, world_size: int) -> None:
    """ZB-V and DualPipeV: two equal chunks per stage in a V (docs/pipeline.md); DualPipeV
    needs 2 pp micro-batches to fill it (zero_bubble.check_dualpipev). A tied embedding is
    one tensor both chunks of stage 0 use; data parallelism's reducer waits for both
    chunks' shares (parallelize.shared_uses)."""
    m, p = cfg.model, cfg.parallel
    if p.pp < 2 or p.virtual_stages != 2:
        raise ConfigError(f"parallel.schedule={p.schedule} needs parallel.pp >= 2 and "
                          f"parallel.virtual_stages=2, two chunks per stage in a V (got pp="
                          f"{p.pp}, virtual_stages={p.virtual_stages}); set them")
    if m.n_layers % (2 * p.pp):
        raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by 2 x parallel.pp="
                          f"{2 * p.pp}: parallel.schedule={p.schedule} needs two equal chunks "
                          "per stage; change either")
    if p.schedule == "dualpipev" and p.microbatches < 2 * p.pp:
        raise ConfigError(f"parallel.microbatches={p.microbatches} is below 2 x parallel.pp="
                          f"{2 * p.pp}: parallel.schedule=dualpipev needs a micro-batch per "
                          "virtual stage; raise parallel.microbatches (or the global batch)")


def check_tensor_parallel(cfg: Config) -> None:
    """The checks that need the model and the layout together: attention is split by
    heads and the MLP by its hidden units (Shoeybi et al. 2019), the sequence by tp
    under sequence parallelism (Korthikanti et al. 2022)."""
    m, p, t = cfg.model, cfg.parallel, cfg.parallel.tp
    if p.sp and t == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1: sequence parallelism "
                          "shards the norms that tensor parallelism leaves replicated, "
                          "along the sequence of the tp group; set parallel.tp or drop "
                          "parallel.sp")
    if t == 1:
        return
    if m.n_heads % t:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={t}; "
                          "attention is split by heads: choose a tp that divides the head "
                          "count")
    g = m.kv_heads
    if g % t if g >= t else t % g:
        raise ConfigError(
            f"model.n_kv_heads={g} does not fit parallel.tp={t}: kv heads are split when "
            "n_kv_heads >= tp (tp must divide them) and replicated when n_kv_heads < tp "
            "(tp must be a multiple of them); choose another tp or n_kv_heads")
    if m.ffn_hidden % t:
        raise ConfigError(f"the MLP hidden size {m.ffn_hidden} (model.ffn_dim) is not "
                          f"divisible by parallel.tp={t}; choose a tp that divides it")
    if p.sp and cfg.train.seq_len % t:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by "
                          f"parallel.tp={t}; sequence parallelism splits the sequence "
                          "over the tp group")
    if p.node_size and t > p.node_size:
        warnings.warn(
            f"parallel.tp={t} is larger than parallel.node_size={p.node_size}: tensor-"
            "parallel groups then span nodes, and their activation all-reduces, on the "
            "critical path of every layer, cross the slower inter-node network; keep "
            "tp <= the devices per node", stacklevel=3)


def check_context_parallel(cfg: Config) -> None:
    """Context parallelism splits every sequence over cp ranks: in 2 cp chunks under the
    zig-zag split (rank r holds chunks r and 2cp-1-r), in cp otherwise; sequence
    parallelism then splits a rank's slice over tp. Ulysses trades the sequence split for
    a head split, so each tensor-parallel rank's query heads must divide by cp (kv heads
    that do not are repeated up to the query heads)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return
    chunks = 2 * p.cp if p.cp_split == "zigzag" else p.cp
    if t.seq_len % chunks:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by {chunks} (parallel.cp={p.cp}"
            f"{', x 2 for cp_split=zigzag' if p.cp_split == 'zigzag' else ''}): every cp rank "
            "holds equal chunks of each sequence; choose a seq_len that divides, or another cp")
    if p.sp and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"train.seq_len={t.seq_len} / parallel.cp={p.cp} = {t.seq_len // p.cp} tokens per "
            f"cp rank is not divisible by parallel.tp={p.tp}: sequence parallelism splits "
            "each cp rank's slice over tp; change seq_len, cp or tp")
    heads = m.n_heads // p.tp
    if p.cp_mode == "ulysses" and heads % p.cp:
        raise ConfigError(
            f"parallel.cp_mode=ulysses with model.n_heads={m.n_heads} / parallel.tp={p.tp} = "
            f"{heads} query heads per tensor-parallel rank, not divisible by parallel.cp="
            f"{p.cp}: Ulysses gives every cp rank whole heads; use cp_mode=ring, or a cp that "
            "divides the heads")


def check_expert_parallel(cfg: Config) -> None:
    """Expert parallelism (parallel/expert/) splits the experts over ep ranks carved out of
    dp x cp, and composes with tensor, pipeline and context parallelism and ZeRO (over the
    expert-data-parallel group for the experts). Not with a parameter server, top-k
    update compression or LoRA (their update halves know one replica group)."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    if not m.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits a mixture of experts, but "
                          "model.n_experts=0 (a dense model): set model.n_experts (a multiple "
                          "of ep) or parallel.ep=1")
    if m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} needs model.n_experts divisible by it (got "
                          f"n_experts={m.n_experts}): each ep rank holds n_experts / ep "
                          "experts; change parallel.ep or model.n_experts")
    why = "their update keeps one replica group, and experts are replicated over dp x cp / ep"
    for field, value, fix in (("parallel.ps_servers", p.ps_servers, "0"),
                              ("comm.compress", cfg.comm.compress if cfg.comm.compress == "topk"
                               else 0, "none or int8"),
                              ("lora.rank", cfg.lora.rank if cfg.lora.enabled else 0, "0")):
        if value:
            raise ConfigError(f"{field}={value} with parallel.ep={p.ep}: {why}; set {field}="
                              f"{fix} or parallel.ep=1")


def check_compile(cfg: Config) -> None:
    """train.compile (parallel/compile.py) compiles each transformer block's forward and
    composes with the layouts whose hooks sit on or around the block (data parallelism,
    ZeRO-1/2/3, the pipeline, activation checkpointing, LoRA/QLoRA), with those whose
    exchanges inside the block are one call it can leave eager (context parallelism's
    attention core, the MoE layer under expert parallelism), and with tensor and sequence
    parallelism, whose collectives are custom ops the graph holds (parallel/tensor/ops.py).
    Refused: a parameter server, whose worker communicates around every linear and norm
    inside the block, in Python the graph would break at and trace through."""
    p = cfg.parallel
    if cfg.train.compile and p.pp > 1 and p.schedule in ("zb-h1", "zbv", "dualpipev"):
        raise ConfigError(f"train.compile=true with parallel.schedule={p.schedule}: its split "
                          "backward calls each block's compiled backward twice (B, then W), "
                          "which AOT autograd's donated buffers forbid (graphs compiled or "
                          "cached for another schedule carry them); set train.compile=false "
                          "or parallel.schedule=1f1b")
    if cfg.train.compile and cfg.train.activation_offload != "none":
        raise ConfigError(f"train.compile=true with train.activation_offload="
                          f"{cfg.train.activation_offload}: a compiled block saves what AOT "
                          "autograd's partitioner picks, not the tensors the planner's offload "
                          "term counts, and the pair has no parity rows yet; set "
                          "train.compile=false or train.activation_offload=none")
    if cfg.train.compile and p.ps_servers:
        raise ConfigError(f"train.compile=true with parallel.ps_servers={p.ps_servers}: a "
                          "parameter-server worker waits for each module's pulled weights in "
                          "a forward pre-hook on every linear and norm inside the block, which "
                          "would break the compiled block into a graph per linear traced "
                          "through the communication code; set parallel.ps_servers=0 or "
                          "train.compile=false")
