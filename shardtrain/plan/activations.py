"""Activation bytes one layer saves for backward in shardtrain's own runtime.

Korthikanti et al. 2022 (Table 2; closed_form.activation_bytes_per_layer) count Megatron-LM's
kernels: 16-bit activations, stored attention probabilities and 1-byte dropout masks.
shardtrain's block saves other things, and this file counts them exactly as
`parallel.activation.SavedActivations` measures them (docs/recompute.md has the table and
the tensor-by-tensor list). One layer, one micro-batch of b sequences of s local tokens
(s = S / cp), on one tensor-parallel rank:

- value bytes v: 4 under fp32, 2 under the amp policy (autocast; the residual stream, the
  norms and their statistics stay fp32, r = 4 bytes, in both).
- norms (two per block; n = b s tokens, n / t under sequence parallelism): RMSNorm keeps
  its input and x * rstd (2 r C per token) and rstd (4); LayerNorm its input (r C) and
  mean and rstd (8).
- linear inputs: fp32 keeps a region's normed input once (n r C); under autocast every
  column-parallel linear keeps its own 16-bit cast (3 for q, k, v; 2 for SwiGLU's w1, w3,
  1 for GELU's w1). Under tensor parallelism a region's input enters in the compute dtype
  (tensor/layers.py) and is kept once (n v C), under sp its sequence chunk (n/t v C).
- attention core, `flash` (what SDPA runs on CPU, fp32 and autocast alike, and on CUDA in
  16 bits; model/sdpa_kernels.py): q, k, v after RoPE [b, s, H+2G, D] and out [b, s, H, D]
  at v bytes, the logsumexp [b, H, s] fp32; wo's input is out itself; packed documents
  the same (one call per document). `efficient` (CUDA's memory-efficient kernel, fp32):
  the same, but with grouped kv heads k and v are repeated to H for it, [b, s, 3H, D]
  kept. `math` (SDPA's
  math kernel): q scaled, k and v repeated to H heads, the probabilities [b, H, s, s]
  (fp32 on CPU, where autocast runs this kernel in fp32: m = 4), and wo's own input
  (n H D v): the s^2 term Korthikanti's 5 a s^2 b counts.
- MLP: SwiGLU keeps w1 x, w3 x, silu(w1 x) and their product (4 n F v); GELU keeps w1 x
  and its GELU (2 n F v).
- qk-norm (Qwen3, model.qk_norm): the RMSNorm of each query and key head keeps its input
  and x * rstd (2 r D per head and token) and rstd (4): n (H + G) (2 r D + 4).
- latent attention (model.attention = mla, model/mla.py; `latent_bytes`): the core's
  terms with D = qk_nope + qk_rope head dims and every head its own k and v (v zero-padded
  to D); wo keeps its own copy of out's first v_head_dim channels (n H Dv v), so selective
  recomputation drops out too; q/kv inputs cast twice under autocast (wq or wq_a, and
  wkv_a); per latent (kv_lora_rank, and q_lora_rank when set) fp32: the norm's input (a
  view of wkv_a's output, with the RoPE key), x * rstd, rstd and its output, 3 r R + 4;
  autocast: the norm's fp32 copy of its input, rstd, its fp32 output and the cast the
  up-projection keeps, (2 r + v) R + 4.
- context parallelism (parallel/context/): the ring core saves q, k, v, out and the lse
  (the flash terms); its out has q's memory layout ([b, s, H, D]), so wo's input is a view
  of it, no copy. Its
  chunk pairs run fused flash kernels forward and backward: no [c, c] scores are kept
  (nor made), so no s^2 term.
  Ulysses runs SDPA on the all-to-all'd [b, S, H/N, D] tensors (the same bytes as the
  local ones; kv heads repeated to G' when N does not divide them), and wo keeps the
  all-to-all'd output. Under the zigzag split (the default, parallel.cp_split) SDPA sees
  position-ordered copies, so the rank-ordered q, k, v and out the Function keeps for its
  backward are held besides (+ (H + 2G' + H) D v n, and two int64 [S] indices); with the
  contiguous split they are the same tensors.
- mixture of experts (model/moe.py; `moe_block_bytes`), in place of the MLP, for the n
  tokens this rank routes (n / t under sp; the experts are whole on every tp rank): the
  router's fp32 input (n r C, also under autocast: the router runs in fp32), its logits
  and probabilities, top-k indices and (for k > 1, renormalised) weights, the z-loss's
  logsumexp; the dispatch's
  N = n k slot indices and keep mask; the experts' input rows (fp32: once; autocast:
  each projection's own 16-bit cast, 2 for SwiGLU) and hidden tensors as the MLP keeps
  them but on N rows (of the expert width); shared experts as a dense MLP keeps them, on
  the n tokens; combine's weighted rows, 2 N C in the experts' output dtype (gpt2's
  fp32 bias add makes it fp32). Under ep the rows are the R received ones (R = N under
  uniform routing) and the exchange keeps two [R] int64 permutations.
Selective recomputation (the core under a checkpoint) keeps only the core's inputs q, k,
v; wo still keeps out: with `flash` it saves exactly the lse, with `math` the s^2 term.
A context-parallel core is never wrapped (`recomputes_in_backward`: it manages its own
backward). Full recomputation keeps the block input (n / t r C with sp).

Outside the blocks (`head_activation_bytes`, the rank holding the head): the final norm (as
a block's), the head's input (fp32: n r C; autocast: its 16-bit cast; under tp the
region's input, n / t v C under sp), the token indices (int64), and the loss's fp32 [n, V']
(V' = V / t under tp): the log-probabilities cross-entropy keeps (tp: the softmax, with
an int64 column and a bool mask per token, parallel/tensor/vocab.py). With a large
vocabulary and few layers the loss is the largest tensor backward starts with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from shardtrain.config import ModelConfig
from shardtrain.model.sdpa_kernels import KERNELS as ATTENTION
from shardtrain.plan.closed_form import activation_bytes_per_layer

if TYPE_CHECKING:
    from shardtrain.plan.layout import Layout
    from shardtrain.plan.partition import RankParams


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """kv heads on one tensor-parallel rank: split when n_kv_heads >= tp, else one
    replicated head (config.check_tensor_parallel)."""
    return max(cfg.kv_heads // tp, 1)


def ulysses_kv_heads(cfg: ModelConfig, tp: int, cp: int) -> int:
    """G': the kv heads Ulysses sends per tp rank: G when cp divides them, else repeated
    to the query heads H (each rank of the cp group needs whole heads)."""
    g, h = kv_heads_per_rank(cfg, tp), cfg.n_heads // tp
    return g if g % cp == 0 else h


def runtime_activation_bytes(cfg: ModelConfig, *, s: int, b: int, t: int = 1,
                             sp: bool = False, recompute: str = "none",
                             precision: str = "fp32", attention: str = "flash",
                             cp: int = 1, cp_mode: str = "ring",
                             cp_split: str = "zigzag", ep: int = 1) -> float:
    """Bytes one layer keeps for backward (see the module docstring); s is the local
    sequence length (S / cp). precision: fp32, or amp / bf16 / fp16 (autocast)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
    v = 4 if precision == "fp32" else 2
    r = 4  # residual stream, norms and their statistics: fp32 under both policies
    c, d = cfg.dim, cfg.qk_head_dim
    n = b * s
    local = n / t if sp else n  # tokens of the replicated (norm, residual) region
    if recompute == "full":
        return local * c * r
    heads, kv = cfg.n_heads // t, kv_heads_per_rank(cfg, t)
    llama = cfg.style == "llama"
    norms = 2 * local * ((2 * r * c + 4) if llama else (r * c + 8))
    if t > 1:  # a tensor-parallel region's input enters in the compute dtype, kept once
        attn_in = mlp_in = local * c * v  # (under sp its sequence chunk)
    elif v == 4:  # one fp32 input shared by a region's linears
        attn_in = mlp_in = n * c * r
    else:  # autocast's cast of the input, one per linear (mla: wq or wq_a, and wkv_a)
        attn_in = (2 if cfg.attention == "mla" else 3) * n * c * v
        mlp_in = (2 if llama else 1) * n * c * v
    mlp = (4 if llama else 2) * n * (cfg.ffn_hidden // t) * v
    if cfg.n_experts:
        mlp = moe_block_bytes(cfg, tokens=local, precision=precision, ep=ep)
        mlp_in = local * c * r  # the router keeps its fp32 input, not the MLP's casts
    inputs = attn_in + mlp_in
    if cfg.qk_norm:  # the query and key heads' RMSNorms (module docstring)
        inputs += n * (heads + kv) * (2 * r * d + 4)
    if cfg.attention == "mla":
        inputs += latent_bytes(cfg, n=n, heads=heads, v=v)
    lse = 4 * b * heads * s
    out = n * heads * d * v
    qkv = n * (heads + 2 * kv) * d * v
    if cp > 1 and cp_mode == "ulysses":
        qkv = n * (heads + 2 * ulysses_kv_heads(cfg, t, cp)) * d * v
        # SDPA on the all-to-all'd tensors: q, k, v, out, lse; wo's all-to-all'd input
        core = qkv + out + lse + out
        if cp_split == "zigzag":  # SDPA saves position-ordered copies (and two [S] int64
            # indices); the Function keeps the rank-ordered q, k, v and out besides
            core += qkv + out + 2 * 8 * s * cp
    elif cp > 1:  # ring: q, k, v, out, lse; out laid out as q ([b, s, H, D] in memory), so
        core = qkv + out + lse  # wo's input is a view of it, no copy
    elif recompute == "selective":  # the checkpoint keeps q, k, v; wo keeps out (mla:
        core = qkv + (0 if cfg.attention == "mla" else out)  # a copy of its slice)
    elif attention == "flash":
        core = qkv + out + lse
    elif attention == "efficient":  # k, v repeated to the query heads for the kernel
        core = n * 3 * heads * d * v + out + lse
    else:
        m = 4  # the math kernel's dtype on CPU, autocast included
        core = 3 * n * heads * d * m + b * heads * s * s * m + out
    return norms + inputs + core + mlp


def latent_bytes(cfg: ModelConfig, *, n: float, heads: int, v: int) -> float:
    """What latent attention (model/mla.py) keeps beyond the core's q, k, v and out, for n
    tokens and `heads` heads on this rank (module docstring)."""
    r, ranks = 4, [cfg.kv_lora_rank] + ([cfg.q_lora_rank] if cfg.q_lora_rank else [])
    if v == 4:  # each latent: the down-projection's output (the norm's input; wkv_a's with
        # the RoPE key), the norm's x * rstd and rstd, its output (the up-projection's input)
        latents = sum(3 * r * rank + 4 for rank in ranks) + r * cfg.qk_rope_head_dim
    else:  # autocast: the norm's fp32 copy of its 16-bit input, rstd, its fp32 output
        # and the up-projection's cast of it
        latents = sum((2 * r + v) * rank + 4 for rank in ranks)
    return n * (latents + heads * cfg.v_head_dim * v)  # + wo's input, a copy of out's slice


def moe_block_bytes(cfg: ModelConfig, *, tokens: float, precision: str = "fp32",
                    ep: int = 1) -> float:
    """What a mixture-of-experts block keeps for backward beyond its input, for `tokens`
    routed on this rank (module docstring), dropless under uniform routing."""
    v = 4 if precision == "fp32" else 2
    n, e, k, c, f = tokens, cfg.n_experts, cfg.moe_top_k, cfg.dim, cfg.expert_hidden
    slots = n * k  # N; under ep the received rows R, N under uniform routing
    # probs and the z-loss's logits [n, E], top-k indices (int64), the logsumexp [n], the
    # balance loss's f [E]; for k > 1 the renormalisation's weights [n, k] and sum [n]
    renorm = k * 4 + 4 if k > 1 else 0  # top-1 gates by the probability (model/moe.py)
    router = n * (2 * e * 4 + k * 8 + 4 + renorm) + e * 4
    # token and slot indices (int64), the keep mask (bool); the experts' group offsets
    dispatch = slots * 17 + (e // ep) * 4 + (2 * slots * 8 if ep > 1 else 0)
    if cfg.style == "llama":  # rows (2 casts under autocast), w1 x, w3 x, silu, product
        rows, out = slots * c * v * (1 if v == 4 else 2) + 4 * slots * f * v, v
    else:  # rows, the bias rows' expert index, GELU's fp32 input and its output
        rows, out = slots * c * v + slots * 8 + slots * f * (4 + v), 4
    shared = 0.0
    if cfg.moe_shared_experts:  # a dense MLP on all n tokens (autocast: its input's casts)
        llama = cfg.style == "llama"
        casts = 0 if v == 4 else (2 if llama else 1) * n * c * v
        shared = casts + (4 if llama else 2) * n * cfg.moe_shared_experts * f * v
    return router + dispatch + rows + slots * out * (1 + 2 * c) + shared  # combine: weights, 2 rows


def head_activation_bytes(cfg: ModelConfig, *, s: int, b: int, t: int = 1, sp: bool = False,
                          precision: str = "fp32") -> float:
    """Bytes the rank holding the head keeps for backward outside the blocks, per
    micro-batch of b sequences of s local tokens (module docstring)."""
    v, r = (4 if precision == "fp32" else 2), 4
    n, c = b * s, cfg.dim
    local = n / t if sp else n
    norm = local * ((2 * r * c + 4) if cfg.style == "llama" else (r * c + 8))
    if t > 1:  # the head's region input, in the compute dtype
        head_in = local * c * v
    else:  # fp32: the norm's output; autocast: its 16-bit cast
        head_in = n * c * (r if v == 4 else v)
    vocab = -(-cfg.vocab_size // t)
    loss = 4 * n * vocab + (9 * n if t > 1 else 0)
    return norm + head_in + 8 * n + loss


def mtp_activation_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int) -> float:
    """What the multi-token prediction modules (model/mtp.py) keep for backward per
    micro-batch, on the rank holding them (the last stage): per depth a dense block
    (`layer_activation_bytes`), its output norm, head and loss as the main head's
    (`head_activation_bytes`), its two input norms less the hidden state's input (already
    kept by the norm before it: the final norm, or the previous depth's output norm), the
    projection's input [n, 2C] (in the compute dtype; under tp its region's, whole) and the
    shifted tokens' ids [n] int64 (under tp and its vocabulary split, their mask too). Equal
    to the runtime's measurement without tp (tests/test_mtp_plan.py)."""
    if not cfg.mtp_depth:
        return 0.0
    lay, s = layout, seq_len // layout.cp
    dense = cfg if not cfg.n_experts else replace(cfg, n_experts=0)
    v, r, n = (4 if lay.precision == "fp32" else 2), 4, s * lay.micro_batch
    local = n / lay.tp if lay.sp else n
    norm = local * ((2 * r * cfg.dim + 4) if cfg.style == "llama" else (r * cfg.dim + 8))
    norms = 2 * norm - local * r * cfg.dim
    projection = (n if lay.tp > 1 else local) * 2 * cfg.dim * v
    ids = 8 * n + (n if lay.tp > 1 else 0)
    head = head_activation_bytes(cfg, s=s, b=lay.micro_batch, t=lay.tp, sp=lay.sp,
                                 precision=lay.precision)
    block = layer_activation_bytes(dense, lay, seq_len=seq_len)
    return cfg.mtp_depth * (block + head + norms + projection + ids)


def layer_activation_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                           recompute: str | None = None) -> float:
    """One layer, one micro-batch, on one rank: Korthikanti's Table 2 under the `bf16`
    convention (the published figures), shardtrain's runtime under fp32 and amp."""
    lay, s = layout, seq_len // layout.cp
    recompute = recompute or lay.recompute
    if lay.precision == "bf16":
        dense = activation_bytes_per_layer(s=s, b=lay.micro_batch, h=cfg.dim, a=cfg.n_heads,
                                           t=lay.tp, sp=lay.sp, recompute=recompute)
        if not cfg.n_experts or recompute == "full":
            return dense
        # an MoE block: the published dense layer plus what the block keeps beyond a dense
        # MLP, counted as shardtrain's runtime keeps it in 16 bits (activations.py)
        n = s * lay.micro_batch
        mlp = (4 if cfg.style == "llama" else 2) * n * (cfg.ffn_hidden // lay.tp) * 2
        return dense + moe_block_bytes(cfg, tokens=n / lay.tp if lay.sp else n,
                                       precision="bf16", ep=lay.ep) - mlp
    return runtime_activation_bytes(cfg, s=s, b=lay.micro_batch, t=lay.tp, sp=lay.sp,
                                    recompute=recompute, precision=lay.precision,
                                    attention=lay.attention, cp=lay.cp, cp_mode=lay.cp_mode,
                                    ep=lay.ep)


def mean_layer_activation_bytes(cfg: ModelConfig, layout: Layout, ranks: RankParams, *,
                                seq_len: int) -> float:
    """`layer_activation_bytes` averaged over the rank's blocks: its dense first blocks
    (model.moe_first_dense) keep a dense MLP's activations, its MoE blocks the experts'."""
    moe = layer_activation_bytes(cfg, layout, seq_len=seq_len)
    plain = ranks.layers - ranks.moe_layers if cfg.n_experts else 0
    if not plain:
        return moe
    dense = layer_activation_bytes(replace(cfg, n_experts=0), layout, seq_len=seq_len)
    return (ranks.moe_layers * moe + plain * dense) / ranks.layers
