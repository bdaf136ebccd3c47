"""The [model] section: the transformer's shape and architectural pieces (model/transformer.py
builds it; model.init_from reads it from a Hugging Face config.json)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardtrain.config.errors import ConfigError, positive
from shardtrain.config.families import check_families


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
    # Mixture of experts (docs/moe.md): Switch load-balancing and ST-MoE router z-loss
    # coefficients; capacity per expert per micro-batch = ceil(factor * tokens * k / E)
    # (0: dropless), an over-full expert keeping its highest-probability (`probs`) or
    # earliest (`position`) slots; `grouped`: one grouped matmul per projection, `loop`:
    # a Python loop over experts (the benchmark's baseline).
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.001
    moe_capacity_factor: float = 0.0
    moe_drop_policy: Literal["probs", "position"] = "probs"
    moe_impl: Literal["grouped", "loop"] = "grouped"
    # Routing scores (docs/moe.md, "Routing"): softmax over the experts (Switch, Mixtral),
    # or sigmoid affinities normalised over the k chosen (DeepSeek-V3). Balance: `aux`,
    # Switch's loss over the micro-batch; `bias`, DeepSeek-V3's auxiliary-loss-free
    # per-expert bias on the selection scores, moved each step by moe_bias_rate times the
    # sign of the load's error (Wang et al. 2024), with moe_aux_loss_coef weighting its
    # sequence-wise loss (0: none); `none`, neither.
    moe_score: Literal["softmax", "sigmoid"] = "softmax"
    moe_balance: Literal["aux", "bias", "none"] = "aux"
    moe_bias_rate: float = 0.001
    # Experts (docs/moe.md, "Shared and fine-grained experts"): each routed expert's hidden
    # width (0: ffn_dim's), shared experts every token passes through (one MLP of
    # moe_shared_experts x that width, added to the routed output, DeepSeekMoE), and the
    # first moe_first_dense blocks dense MLPs of ffn_dim (DeepSeek-V3's first 3).
    moe_ffn_dim: int = 0
    moe_shared_experts: int = 0
    moe_first_dense: int = 0
    # Group-limited routing (docs/moe.md, "Group-limited routing"): the experts in
    # moe_groups groups of consecutive experts, each token choosing among its
    # moe_max_groups best groups only (DeepSeek-V3: 8 groups, 4 per token); 0: no limit.
    moe_groups: int = 0
    moe_max_groups: int = 0
    init_from: str = ""  # a Hugging Face directory: its weights, and its config.json's shape
    # Hugging Face families (config/families.py): q/k/v biases (Qwen2), per-head q/k RMSNorm
    # (Qwen3), head_size (0: dim / n_heads), RoPE scaling (llama3, linear, dynamic, yarn), an
    # attention window (Mistral; 0: none) that train.seq_len must fit in.
    qkv_bias: bool = False
    qk_norm: bool = False
    head_size: int = 0
    rope_scaling: Literal["none", "llama3", "linear", "dynamic", "yarn"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_attention_factor: float = 0.0  # yarn's cos/sin scale; 0: 0.1 ln(factor) + 1
    sliding_window: int = 0
    # Attention (docs/moe.md, "Multi-head latent attention"): `mha`, multi-head attention
    # (grouped kv heads by n_kv_heads); `mla`, DeepSeek-V2's latent attention (arXiv
    # 2405.04434 sec. 2.1; model/mla.py): q through a rank-q_lora_rank bottleneck (0: one
    # projection), k and v up-projected per head from one kv_lora_rank latent, each head's
    # query and key qk_nope_head_dim channels without RoPE plus qk_rope_head_dim with it
    # (the key's shared by all heads), values of v_head_dim.
    attention: Literal["mha", "mla"] = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The routed experts' gates times this (DeepSeek-V3's routed_scaling_factor, 2.5 there)
    moe_route_scale: float = 1.0
    # Multi-token prediction (docs/moe.md, "Multi-token prediction"; DeepSeek-V3, arXiv
    # 2412.19437 sec. 2.2): mtp_depth sequential modules after the model, module k
    # predicting the token k + 1 ahead with the shared embedding and head; their mean loss
    # weighted by mtp_loss_coef (DeepSeek-V3's lambda: 0.3 for its first 10T tokens, 0.1
    # after; 0.1 here, the value a run spends most of its tokens at) joins the main loss.
    mtp_depth: int = 0
    mtp_loss_coef: float = 0.1

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def qk_head_dim(self) -> int:
        """The head dim the attention core sees: q and k (and v, padded to it, under mla)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" \
            else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The channels of each head RoPE turns (the RoPE tables' width)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.style == "gpt2":
            return 4 * self.dim
        return 64 * ((int(2 * 4 * self.dim / 3) + 63) // 64)

    @property
    def expert_hidden(self) -> int:
        """A routed (or shared) expert's hidden width."""
        return self.moe_ffn_dim or self.ffn_hidden

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` routes to experts (else a dense MLP of ffn_hidden)."""
        return bool(self.n_experts) and layer >= self.moe_first_dense

    def sends_per_group(self, ep: int) -> bool:
        """Whether expert parallelism over `ep` ranks sends each token once per kept group
        rather than once per slot (parallel/expert/grouped.py): routing limited to fewer
        groups than slots per token (g < k), each group whole on one rank."""
        return bool(self.moe_max_groups) and self.moe_groups % ep == 0 \
            and self.moe_max_groups < self.moe_top_k

    @property
    def moe_layers(self) -> int:
        """Blocks that route to experts (the planner reads it per layout: O(1))."""
        return max(self.n_layers - self.moe_first_dense, 0) if self.n_experts else 0

    def validate(self) -> None:
        positive("model", self, "vocab_size", "dim", "n_layers", "n_heads", "max_seq_len")
        if self.dim % self.n_heads and not self.head_size:
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
        if self.style == "llama" and self.attention == "mha" and self.head_dim % 2:
            raise ConfigError(f"model.dim / model.n_heads = {self.head_dim} must be even for RoPE")
        check_families(self)
        self._validate_attention()
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.moe_top_k <= self.n_experts):
            raise ConfigError(f"model.moe_top_k={self.moe_top_k} must lie in 1..model.n_experts="
                              f"{self.n_experts}")
        self._validate_moe()
        if self.mtp_depth < 0 or self.mtp_loss_coef < 0:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth} and model.mtp_loss_coef="
                              f"{self.mtp_loss_coef} must be >= 0 (mtp_depth 0: no multi-token "
                              "prediction)")

    @property
    def table_at_ends(self) -> bool:
        """Whether the token table is read after the blocks too: by a tied head, or by the
        multi-token prediction modules (model/mtp.py). A pipeline's last stage then holds a
        copy of it (parallel/pipeline/stage.py)."""
        return self.tie_embeddings or self.mtp_depth > 0

    def _validate_moe(self) -> None:
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_capacity_factor",
                     "moe_bias_rate", "moe_ffn_dim", "moe_shared_experts", "moe_first_dense",
                     "moe_groups", "moe_max_groups"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 0"
                                  + (" (0: dropless)" if name == "moe_capacity_factor" else ""))
        for name, choices in (("moe_drop_policy", ("probs", "position")),
                              ("moe_impl", ("grouped", "loop")),
                              ("moe_score", ("softmax", "sigmoid")),
                              ("moe_balance", ("aux", "bias", "none"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is not one of "
                                  f"{', '.join(choices)}")
        if self.moe_balance == "none" and self.moe_aux_loss_coef:
            raise ConfigError(f"model.moe_balance='none' takes no balance loss, but "
                              f"model.moe_aux_loss_coef={self.moe_aux_loss_coef}: set it to 0, "
                              "or choose moe_balance 'aux' or 'bias'")
        if self.moe_balance != "bias" and self.moe_bias_rate != type(self).moe_bias_rate:
            raise ConfigError(f"model.moe_bias_rate={self.moe_bias_rate} moves the expert bias "
                              f"of model.moe_balance='bias' only (it is "
                              f"{self.moe_balance!r}): set moe_balance='bias' or drop the rate")
        self._validate_groups()
        for name in ("moe_ffn_dim", "moe_shared_experts", "moe_first_dense"):
            if getattr(self, name) and not self.n_experts:
                raise ConfigError(f"model.{name}={getattr(self, name)} shapes the experts of a "
                                  "mixture-of-experts model, but model.n_experts=0: set "
                                  f"model.n_experts or drop model.{name}")
        if self.n_experts and self.moe_first_dense >= self.n_layers:
            raise ConfigError(f"model.moe_first_dense={self.moe_first_dense} leaves none of the "
                              f"model.n_layers={self.n_layers} blocks to the experts: make it "
                              "smaller, or set model.n_experts=0 for a dense model")
        if self.n_experts and self.moe_impl == "grouped" and \
                (self.dim % 8 or self.expert_hidden % 8):
            # torch._grouped_mm needs 16-byte row strides (8 bf16 values).
            raise ConfigError(f"model.moe_impl='grouped' needs model.dim={self.dim} and the "
                              f"expert width {self.expert_hidden} to be multiples of 8; change "
                              "them (model.moe_ffn_dim) or set model.moe_impl='loop'")

    def _validate_attention(self) -> None:
        latent = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim")
        if self.attention not in ("mha", "mla"):
            raise ConfigError(f"model.attention={self.attention!r} is not one of mha, mla")
        if self.moe_route_scale <= 0:
            raise ConfigError(f"model.moe_route_scale={self.moe_route_scale} must be positive")
        if self.attention == "mha":
            for name in latent:
                if getattr(self, name):
                    raise ConfigError(f"model.{name}={getattr(self, name)} shapes latent "
                                      "attention: set model.attention='mla' or drop it")
            return
        if self.style != "llama" or self.qkv_bias or self.qk_norm or self.head_size \
                or self.n_kv_heads not in (0, self.n_heads) or self.rope_scaling != "none":
            raise ConfigError("model.attention='mla' is DeepSeek's llama-style block with every "
                              "head its own latent keys: it takes no n_kv_heads, head_size, "
                              "qkv_bias, qk_norm or rope_scaling (set them to their defaults)")
        for name in latent:
            if getattr(self, name) < 0 or (not getattr(self, name) and name in (
                    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")):
                raise ConfigError(f"model.{name}={getattr(self, name)} must be "
                                  + (">= 0" if name in ("q_lora_rank", "qk_nope_head_dim")
                                     else "positive") + " under model.attention='mla'")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even "
                              "(RoPE turns channel pairs)")
        if self.v_head_dim > self.qk_head_dim:
            # the core takes one head dim: v is zero-padded up to q and k's (model/mla.py)
            raise ConfigError(f"model.v_head_dim={self.v_head_dim} exceeds the query/key head "
                              f"dim qk_nope_head_dim + qk_rope_head_dim = {self.qk_head_dim}; "
                              "make it no larger")

    def _validate_groups(self) -> None:
        g, limit = self.moe_groups, self.moe_max_groups
        if bool(g) != bool(limit):
            raise ConfigError(f"model.moe_groups={g} and model.moe_max_groups={limit}: set both "
                              "(groups of experts, and how many a token may use) or neither")
        if not g:
            return
        if not self.n_experts or self.n_experts % g:
            raise ConfigError(f"model.moe_groups={g} must divide model.n_experts="
                              f"{self.n_experts} (groups of equal size)")
        if not limit <= g or limit * (self.n_experts // g) < self.moe_top_k:
            raise ConfigError(f"model.moe_max_groups={limit} must lie in 1..model.moe_groups={g}"
                              f" and hold model.moe_top_k={self.moe_top_k} experts (each group "
                              f"has {self.n_experts // g})")
