"""The runtime's exact model-state bytes on rank 0 of a layout, from the model config.

`memory.model_states` divides the parameters by N_d; the runtime cannot: its flat buffers
are padded so that every rank holds an equal shard. This module lists the parameter tensors
rank 0 holds (tensor-parallel rank 0's slices, pipeline stage 0's layers) and applies the
runtime's padding to them, so the planner reproduces the runtime's ledger to the byte:

- ZeRO (cost/units.py): one flat unit for the embedding (token + position tables), one per
  transformer block (the last with the final norm), one for the head (a tied embedding
  joins it); each unit padded to a multiple of N_d; then `model_states(padded, nd=N_d,
  zero=...)`.
- Plain DP (parallel/data/ddp.py): gradient buckets filled in reverse module order, the first
  closed at min(bucket, 1 MiB), each padded to a multiple of N_d; then
  `runtime_adamw_fp32` with that padding and one AdamW `step` scalar per tensor.
- Tensor parallelism (parallel/tensor/): every split dimension is padded to a multiple of
  its parts (the vocabulary to a multiple of t; kv heads fewer than t are shared by t / kv
  ranks, each holding one head); norms, position table and row-parallel biases whole.

- Offload (cpu or nvme, parallel/zero/offload.py): the ZeRO states above, then
  `memory.offload_states` with this rank's padded shard: the optimizer state and the fp32
  master shards off the device, under ZeRO-3 the parameter shards too (`offloaded`).

- ZeRO++ (parallel/zero/zeropp.py): under qwZ every parameter starts at a multiple of
  comm.quant_block and units pad to nd x block; at stages 1-2 the fp32 master shard gets
  storage of its own (the gather writes dequantized values over the shard). hpZ adds its
  secondary shards to the parameters (`hpz_secondary_bytes`).

Covered: dense models (no experts, no LoRA), AdamW, SGD, RMSprop, Adagrad (the layout's
`optim`), no parameter server; anything else
raises PlanError naming what is not covered.
Pure arithmetic, like the rest of plan/: the rules are restated here, and the dry run
(train/start/dryrun.py, tests/test_dryrun.py) checks them against the runtime's ledger.
"""

from __future__ import annotations

from dataclasses import replace

from shardtrain.config import ModelConfig
from shardtrain.cost.counts import attention_linears
from shardtrain.cost.units import ROUNDED, backward_reads_params, unit_key
from shardtrain.plan.layout import Layout, PlanError
from shardtrain.config.precision import TRUE16
from shardtrain.plan.memory import (STATE_BYTES, ModelStates, compensation_bytes, model_states,
                                    offload_states)
from shardtrain.plan.optim_states import OPTIM_STATES
from shardtrain.plan.partition import layers_per_stage

FIRST_BUCKET_BYTES = 2**20  # parallel/data/ddp.py: the first bucket's cap
PARAM_BYTES = 4  # fp32 and amp both hold fp32 parameters (memory.py, STATE_BYTES)


def runtime_adamw_fp32(params: int, *, grad_padding: int = 0,
                       step_tensors: int = 0, optim: str = "adamw", width: int = 4,
                       compensation: int = 0) -> ModelStates:
    """The runtime's ledger convention for a replicated data-parallel run of torch's
    `optim` (AdamW by default), exactly: params width Psi, grads width (Psi + grad_padding)
    (elements a flat or bucketed gradient buffer adds), optimizer 4 Psi per state (AdamW's
    exp_avg, exp_avg_sq) + 4 bytes per `step_tensors` (PyTorch's AdamW, RMSprop and Adagrad
    keep one fp32 `step` per parameter tensor, SGD none; 0 ignores them). `width`: 4 for
    fp32 parameters, 2 under bf16-true and fp16-true (train/optim.py Optimizer16 keeps a
    `step` for every optimizer, SGD's too, and `compensation` bytes per parameter)."""
    steps = 0 if optim in ("sgd", "momentum") and width == 4 else step_tensors
    return ModelStates(params=width * params, grads=width * (params + grad_padding), master=0,
                       optimizer=(4 * OPTIM_STATES[optim] + compensation) * params + 4 * steps)


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def block_tensors(cfg: ModelConfig, index: int, t: int) -> list[tuple[str, int]]:
    """(name, elements) of block `index` on tensor-parallel rank 0, in module order."""
    h, gpt2 = cfg.dim, cfg.style == "gpt2"
    q, f = cfg.n_heads * cfg.head_dim, cfg.ffn_hidden
    kv_parts = cfg.kv_heads if cfg.kv_heads < t else t  # shared kv heads: one per rank
    kv = -(-cfg.kv_heads * cfg.head_dim // kv_parts)
    norm = [("weight", h), ("bias", h)] if gpt2 else [("weight", h)]
    col = lambda rows: [("weight", rows * h)] + ([("bias", rows)] if gpt2 else [])  # noqa: E731
    row = lambda cols: [("weight", h * cols)] + ([("bias", h)] if gpt2 else [])  # noqa: E731
    qkv = lambda rows: [("weight", rows * h)] + (  # noqa: E731
        [("bias", rows)] if gpt2 or cfg.qkv_bias else [])
    linears = [("attn_norm", norm), ("attn.wq", qkv(-(-q // t))), ("attn.wk", qkv(kv)),
               ("attn.wv", qkv(kv)), ("attn.wo", row(-(-q // t)))]
    if cfg.attention == "mla":  # heads split, the latents whole (parallel/tensor/latent.py)
        whole = {"wq_a", "wkv_a"}
        linears = [("attn_norm", norm)]
        for name, (out, inp) in attention_linears(cfg).items():
            size = out * inp if name in whole else (out * -(-inp // t) if name == "wo"
                                                     else -(-out // t) * inp)
            linears.append((f"attn.{name}", [("weight", size)]))
            if name in ("wq_a", "wkv_a"):
                rank = cfg.q_lora_rank if name == "wq_a" else cfg.kv_lora_rank
                linears.append((f"attn.{name[1:]}_norm", [("weight", rank)]))
    if cfg.qk_norm:  # Qwen3: whole on every tp rank
        linears += [("attn.q_norm", [("weight", cfg.head_dim)]),
                    ("attn.k_norm", [("weight", cfg.head_dim)])]
    linears += [("mlp_norm", norm), ("mlp.w1", col(-(-f // t)))]
    linears += [("mlp.w2", row(-(-f // t)))] if gpt2 else \
        [("mlp.w3", col(-(-f // t))), ("mlp.w2", row(-(-f // t)))]
    return [(f"layers.{index}.{m}.{p}", n) for m, parts in linears for p, n in parts]


def rank0_tensors(cfg: ModelConfig, layout: Layout, *, layers: int | None = None
                  ) -> list[tuple[str, int]]:
    """(name, elements) of every trainable tensor rank 0 holds, in module order: the
    embedding, stage 0's `layers` blocks (default: the planner's layers_per_stage; the
    runtime's balanced cut may differ, parallel/pipeline/partition.py), and with pp = 1 the
    final norm, the head (once, if tied) and the multi-token prediction modules."""
    if cfg.n_experts:
        raise PlanError("the exact per-rank count covers dense models; model.n_experts="
                        f"{cfg.n_experts} (use memory_per_gpu's estimate)")
    t, h = layout.tp, cfg.dim
    vocab_rows = -(-cfg.vocab_size // t)
    out = [("tok_emb.weight", vocab_rows * h)]
    if cfg.style == "gpt2":
        out.append(("pos_emb.weight", cfg.max_seq_len * h))
    n = layers_per_stage(cfg, layout) if layers is None else layers
    for i in range(n):
        out += block_tensors(cfg, i, t)
    if layout.pp == 1:
        norm = [("weight", h)] + ([("bias", h)] if cfg.style == "gpt2" else [])
        out += [(f"norm.{p}", n) for p, n in norm]
        if not cfg.tie_embeddings:
            out.append(("head.weight", vocab_rows * h))
        for k in range(cfg.mtp_depth):  # model/mtp.py, registered after the head
            block = [(f"mtp.{k}.block.{n.split('.', 2)[2]}", c) for n, c in block_tensors(cfg, 0, t)]
            out += [(f"mtp.{k}.{m}.{p}", n) for m in ("h_norm", "e_norm") for p, n in norm] \
                + [(f"mtp.{k}.proj.weight", h * -(-2 * h // t))] + block \
                + [(f"mtp.{k}.out_norm.{p}", n) for p, n in norm]
    return out


def zero_units(tensors: list[tuple[str, int]], *, nd: int, tied: bool, n_layers: int,
               rounded: bool = False, align: int = 1, blocks: int = 1
               ) -> dict[tuple[int, int, int], int]:
    """unit key -> elements of that flat unit (cost/units.py; `rounded`: split by gather
    dtype, ZeRO-3 under amp; `blocks` transformer blocks per unit), each parameter starting
    at a multiple of `align` (qwZ's blocks: zero/units.py build_units) and the unit padded
    to a multiple of nd x align."""
    units: dict[tuple[int, int, int], int] = {}
    for name, n in tensors:
        key = unit_key(name, tied=tied, n_layers=n_layers, rounded=rounded, blocks=blocks)
        units[key] = units.get(key, 0) + _up(n, align)
    return {key: _up(n, nd * align) for key, n in sorted(units.items())}


def zero_padded(tensors: list[tuple[str, int]], *, nd: int, tied: bool, n_layers: int,
                rounded: bool = False, align: int = 1, blocks: int = 1) -> int:
    """Elements of the flat units (`zero_units`), in all."""
    return sum(zero_units(tensors, nd=nd, tied=tied, n_layers=n_layers, rounded=rounded,
                          align=align, blocks=blocks).values())


def hpz_secondary_bytes(units: dict[tuple[int, int, int], int], *, local: int,
                        precision: str) -> int:
    """hpZ's secondary shards (parallel/zero/zeropp.py): 1/local of every unit gathered again
    for backward (not the embedding's lookup tables: cost/units.py `backward_reads_params`),
    in its gather dtype (a split unit's rounded half 16-bit under amp), local = the dp
    ranks on this rank's node."""
    return sum(n // local * (2 if precision == "amp" and key[2] == ROUNDED else PARAM_BYTES)
               for key, n in units.items() if backward_reads_params(key))


def bucket_padded(tensors: list[tuple[str, int]], *, nd: int, bucket_mb: float,
                  width: int = PARAM_BYTES) -> int:
    """Elements of the data-parallel gradient buckets (parallel/data/ddp.py) of `width`-byte
    gradients."""
    cap, sizes, size = bucket_mb * 2**20, [0], 0
    for _, n in reversed(tensors):
        limit = min(cap, FIRST_BUCKET_BYTES) if len(sizes) == 1 else cap
        if sizes[-1] and size >= limit:
            sizes.append(0)
            size = 0
        sizes[-1] += n
        size += n * width
    return sum(_up(n, nd) for n in sizes)


def rank0_states(cfg: ModelConfig, layout: Layout, *, layers: int | None = None,
                 bucket_mb: float = 25.0, optimizer: str = "adamw", block: int = 256,
                 local: int = 1) -> ModelStates:
    """Rank 0's model-state bytes exactly as the runtime's ledger reports them
    (Trainer.memory_ledger: params, grads, master, optimizer). ZeRO++: `block` is
    comm.quant_block (qwZ aligns the units to it), `local` the dp ranks on a node (hpZ)."""
    lay = layout
    if lay.precision not in ("fp32", "amp", *TRUE16):
        raise PlanError(f"layout precision={lay.precision!r}: the runtime holds fp32, amp "
                        "(train.precision bf16/fp16), bf16-true or fp16-true states")
    if optimizer not in ("adamw", "sgd", "rmsprop", "adagrad"):
        raise PlanError(f"optim.name={optimizer!r}: the exact count covers adamw, sgd, "
                        "rmsprop and adagrad")
    if lay.ps_servers:
        raise PlanError("the exact per-rank count does not cover parameter servers")
    if lay.offload != "none" and not lay.zero:
        raise PlanError(f"layout offload={lay.offload} needs zero >= 1: it moves ZeRO's "
                        "sharded states")
    tensors = rank0_tensors(cfg, lay, layers=layers)
    psi = sum(n for _, n in tensors)
    if lay.zero:
        units = zero_units(tensors, nd=lay.nd, tied=cfg.tie_embeddings,
                           n_layers=cfg.n_layers, align=block if lay.qwz else 1,
                           blocks=lay.unit_blocks,
                           rounded=lay.zero == 3 and lay.precision == "amp")
        padded = sum(units.values())
        states = model_states(padded, nd=lay.nd, zero=lay.zero, precision=lay.precision,
                              optim=lay.optim, compensation=compensation_bytes(lay.bf16_update))
        if lay.qwz and lay.zero < 3:  # the dequantized gather lands in the shard: the fp32
            # master gets storage of its own (zero/model.py)
            states = replace(states, master=PARAM_BYTES * padded / lay.nd)
        if lay.offload != "none":
            states = offload_states(states, shard_params=padded // lay.nd, zero=lay.zero)
        secondary = hpz_secondary_bytes(units, local=local, precision=lay.precision) \
            if lay.hpz else 0  # on the device, offload or not
        return replace(states, params=states.params + secondary)
    width = STATE_BYTES[lay.precision][0]
    padded = bucket_padded(tensors, nd=lay.nd, bucket_mb=bucket_mb, width=width) \
        if lay.nd > 1 else psi  # one replica: no reducer, no buckets
    return runtime_adamw_fp32(psi, grad_padding=padded - psi, step_tensors=len(tensors),
                              optim=lay.optim, width=width,
                              compensation=compensation_bytes(lay.bf16_update))
