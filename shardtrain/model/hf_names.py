"""Hugging Face <-> shardtrain: config.json fields and tensor names, for the llama-style
families (Llama, Qwen2, Qwen3, Mistral: their config.json in hf_families.py; Mixtral,
Qwen3-MoE, DeepSeek-V3: hf_moe.py) and GPT-2.

`model_config_from_hf` reads a Hugging Face config.json into a `ModelConfig` (errors name
the file and the field); `hf_config_from_model` writes one back. `tensor_maps` lists, for
one `ModelConfig`, every tensor of the Hugging Face checkpoint with the shardtrain
parameters it holds and the two conversions between them:

- Llama q/k projections: Hugging Face rotates the two halves of each head (channel i with
  channel i + D/2, "rotate_half"); shardtrain's RoPE rotates interleaved pairs (2i, 2i+1),
  as the original Llama release did. Attention scores are invariant to one permutation of
  the channels applied to q and k alike, so the rows of each head are permuted on the way
  in and back on the way out; pair i keeps its frequency theta^(-2i/D) in both layouts.
  A q/k bias (Qwen2) is permuted with its rows, a q/k norm weight [D] (Qwen3) as one head.
- DeepSeek-V3's latent attention (model/mla.py) maps one tensor to one: its RoPE channels
  are stored in interleaved pairs (rope_interleave), which is how ours turn.
- GPT-2 stores its linears as Conv1D, weight [in, out] (the transpose of nn.Linear), and
  fuses q, k, v into one c_attn tensor [C, 3C].
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.hf_families import FAMILIES, family_config, family_fields, refuse
from shardtrain.config.families import moe_family
from shardtrain.model.hf_moe import LAYOUT

SUPPORTED = (*FAMILIES, "gpt2")
# Non-persistent buffers some older checkpoints carry; they hold nothing to load.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory; give a Hugging Face model directory "
                          "(config.json and *.safetensors)")
    if not file.is_file():
        raise ConfigError(f"{file}: missing; a Hugging Face model directory holds a "
                          "config.json next to its *.safetensors files")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: malformed JSON ({e}); the file must be the config.json "
                          "that save_pretrained writes") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the top level must be a JSON object")
    return raw


def _get(raw: dict[str, Any], file: Path, key: str, kind: type, default: Any = ...) -> Any:
    value = raw.get(key, default)
    if value is ...:
        raise ConfigError(f"{file}: field {key!r} is missing")
    if value is None and default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ConfigError(f"{file}: field {key!r}={value!r} must be a {kind.__name__}")
    return value


def model_config_from_hf(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory of one of the SUPPORTED families."""
    raw = read_config_json(path)
    file = path / "config.json"
    arch = raw.get("model_type")
    if arch in FAMILIES:
        cfg = family_config(raw, file, lambda key, kind, default=...: _get(raw, file, key, kind,
                                                                           default))
    elif arch == "gpt2":
        cfg = _gpt2_config(raw, file)
    else:
        raise ConfigError(f"{file}: model_type={arch!r} is not supported; shardtrain reads "
                          f"model_type {', '.join(SUPPORTED)}")
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None
    return cfg


def _gpt2_config(raw: dict[str, Any], file: Path) -> ModelConfig:
    g = lambda key, kind, default=...: _get(raw, file, key, kind, default)  # noqa: E731
    act = g("activation_function", str, "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise refuse(file, "activation_function", act, "shardtrain's GPT-2 MLP uses the tanh "
                      "approximation of GELU (gelu_new)")
    if g("scale_attn_by_inverse_layer_idx", bool, False):
        raise refuse(file, "scale_attn_by_inverse_layer_idx", True, "attention scores are "
                      "scaled by 1/sqrt(head_dim) only")
    if not g("scale_attn_weights", bool, True):
        raise refuse(file, "scale_attn_weights", False, "attention scores are scaled by "
                      "1/sqrt(head_dim)")
    dim = g("n_embd", int)
    return ModelConfig(
        style="gpt2", vocab_size=g("vocab_size", int), dim=dim, n_layers=g("n_layer", int),
        n_heads=g("n_head", int), ffn_dim=g("n_inner", int, None) or 4 * dim,
        max_seq_len=g("n_positions", int, 1024),
        tie_embeddings=g("tie_word_embeddings", bool, True),
        norm_eps=g("layer_norm_epsilon", float, 1e-5))


def hf_config_from_model(cfg: ModelConfig, base: dict[str, Any] | None = None,
                         dtype: str = "float32") -> dict[str, Any]:
    """config.json for `cfg`: the fields of `base` (the source checkpoint's, so token ids
    and the like survive) with every shape field replaced by shardtrain's."""
    out = dict(base or {})
    if cfg.style == "llama":
        out.update(family_fields(cfg, base))
        out.pop("rope_scaling", None)
    else:
        out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.dim,
                   n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.ffn_hidden,
                   n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
                   activation_function="gelu_new", scale_attn_by_inverse_layer_idx=False)
    out.update(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, dtype=dtype)
    return out


@dataclass(frozen=True)
class TensorMap:
    """One Hugging Face tensor and the shardtrain tensors it holds (in order); `expert`:
    it is slice `expert` of our one stacked expert tensor (hf_moe.py)."""

    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[torch.Tensor], list[torch.Tensor]]
    to_hf: Callable[[list[torch.Tensor]], torch.Tensor]
    expert: int | None = None


def _plain(hf: str, ours: str) -> TensorMap:
    return TensorMap(hf, (ours,), lambda t: [t], lambda ts: ts[0])


def _conv1d(hf: str, ours: str) -> TensorMap:
    return TensorMap(hf, (ours,), lambda t: [t.t()], lambda ts: ts[0].t())


def _rope_rows(hf: str, ours: str, heads: int) -> TensorMap:
    def to_ours(t: torch.Tensor) -> list[torch.Tensor]:  # [H*D, C], halves -> pairs
        return [t.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)]

    def to_hf(ts: list[torch.Tensor]) -> torch.Tensor:  # pairs -> halves
        return ts[0].unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2)

    return TensorMap(hf, (ours,), to_ours, to_hf)


def _split(hf: str, ours: tuple[str, ...], transpose: bool) -> TensorMap:
    """GPT-2's fused c_attn: weight [C, 3C] (Conv1D) or bias [3C] -> q, k, v."""
    flip = (lambda t: t.t()) if transpose else (lambda t: t)
    return TensorMap(hf, ours, lambda t: list(flip(t).chunk(len(ours), 0)),
                     lambda ts: flip(torch.cat(ts, 0)))


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Every tensor of the Hugging Face checkpoint of `cfg`, in the checkpoint's order."""
    if cfg.style == "llama":
        maps = [_plain("model.embed_tokens.weight", "tok_emb.weight")]
        for i in range(cfg.n_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            if cfg.attention == "mla":
                maps += _latent_maps(cfg, hf, me)
            else:
                maps += _head_maps(cfg, hf, me)
            maps += _expert_maps(cfg, hf, me) if cfg.is_moe(i) else [
                _plain(hf + "mlp.gate_proj.weight", me + "mlp.w1.weight"),
                _plain(hf + "mlp.up_proj.weight", me + "mlp.w3.weight"),
                _plain(hf + "mlp.down_proj.weight", me + "mlp.w2.weight")]
            maps += [_plain(hf + "input_layernorm.weight", me + "attn_norm.weight"),
                     _plain(hf + "post_attention_layernorm.weight", me + "mlp_norm.weight")]
        maps.append(_plain("model.norm.weight", "norm.weight"))
    else:
        maps = _gpt2_maps(cfg)
    if not cfg.tie_embeddings:
        maps.append(_plain("lm_head.weight", "head.weight"))
    return maps


def _head_maps(cfg: ModelConfig, hf: str, me: str) -> list[TensorMap]:
    """A llama-style block's q, k, v, o projections (biases, q/k norms)."""
    a = hf + "self_attn."
    maps = [_rope_rows(a + "q_proj.weight", me + "attn.wq.weight", cfg.n_heads),
            _rope_rows(a + "k_proj.weight", me + "attn.wk.weight", cfg.kv_heads),
            _plain(a + "v_proj.weight", me + "attn.wv.weight")]
    if cfg.qkv_bias:  # a q/k bias row moves with its weight row
        maps += [_rope_rows(a + "q_proj.bias", me + "attn.wq.bias", cfg.n_heads),
                 _rope_rows(a + "k_proj.bias", me + "attn.wk.bias", cfg.kv_heads),
                 _plain(a + "v_proj.bias", me + "attn.wv.bias")]
    if cfg.qk_norm:  # the norm weight [D] is one head's channels: permuted alike
        maps += [_rope_rows(a + f"{n}_norm.weight", me + f"attn.{n}_norm.weight", 1)
                 for n in ("q", "k")]
    return maps + [_plain(a + "o_proj.weight", me + "attn.wo.weight")]


def _latent_maps(cfg: ModelConfig, hf: str, me: str) -> list[TensorMap]:
    """A DeepSeek-V3 block's latent attention (model/mla.py), one tensor for one: its RoPE
    channels are laid out in interleaved pairs (rope_interleave), as ours turn them."""
    names = {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj"} \
        if cfg.q_lora_rank else {"wq": "q_proj"}
    names.update(wkv_a="kv_a_proj_with_mqa", kv_a_norm="kv_a_layernorm", wkv_b="kv_b_proj",
                 wo="o_proj")
    return [_plain(f"{hf}self_attn.{theirs}.weight", f"{me}attn.{ours}.weight")
            for ours, theirs in names.items()]


def _gpt2_maps(cfg: ModelConfig) -> list[TensorMap]:
    maps = [_plain("transformer.wte.weight", "tok_emb.weight"),
            _plain("transformer.wpe.weight", "pos_emb.weight")]
    for i in range(cfg.n_layers):
        hf, me = f"transformer.h.{i}.", f"layers.{i}."
        qkv = ("attn.wq", "attn.wk", "attn.wv")
        maps += [_plain(hf + f"ln_{n}.{leaf}", me + f"{norm}.{leaf}")
                 for n, norm in ((1, "attn_norm"), (2, "mlp_norm")) for leaf in ("weight", "bias")]
        maps += [_split(hf + "attn.c_attn.weight", tuple(me + q + ".weight" for q in qkv), True),
                 _split(hf + "attn.c_attn.bias", tuple(me + q + ".bias" for q in qkv), False),
                 _conv1d(hf + "attn.c_proj.weight", me + "attn.wo.weight"),
                 _plain(hf + "attn.c_proj.bias", me + "attn.wo.bias"),
                 _conv1d(hf + "mlp.c_fc.weight", me + "mlp.w1.weight"),
                 _plain(hf + "mlp.c_fc.bias", me + "mlp.w1.bias"),
                 _conv1d(hf + "mlp.c_proj.weight", me + "mlp.w2.weight"),
                 _plain(hf + "mlp.c_proj.bias", me + "mlp.w2.bias")]
    return maps + [_plain("transformer.ln_f.weight", "norm.weight"),
                   _plain("transformer.ln_f.bias", "norm.bias")]


def _expert_maps(cfg: ModelConfig, hf: str, me: str) -> list[TensorMap]:
    """A MoE block's router and its experts' projections, one Hugging Face tensor per
    expert and projection, each a slice of our stacked [E, out, in] (hf_moe.py)."""
    family = moe_family(cfg)
    where, names = LAYOUT[family]
    maps = [_plain(f"{hf}{where}.gate.weight", me + "mlp.router.weight")]
    if family == "deepseek_v3":  # the router's bias (ours only under moe_balance = bias:
        # zeros otherwise, which select as no bias does) and the shared experts' MLP
        bias = f"{hf}mlp.gate.e_score_correction_bias"
        maps.append(_plain(bias, me + "mlp.expert_bias") if cfg.moe_balance == "bias" else
                    TensorMap(bias, (), lambda t: [], lambda ts: torch.zeros(cfg.n_experts)))
        maps += [_plain(f"{hf}mlp.shared_experts.{theirs}.weight", f"{me}mlp.shared.{ours}.weight")
                 for theirs, ours in zip(names, ("w1", "w3", "w2"))]
    for e in range(cfg.n_experts):
        for theirs, ours in zip(names, ("w1", "w3", "w2")):
            maps.append(TensorMap(f"{hf}{where}.experts.{e}.{theirs}.weight",
                                  (me + f"mlp.experts.{ours}",), lambda t: [t],
                                  lambda ts, e=e: ts[0][e], expert=e))
    return maps


def beyond_the_model(cfg: ModelConfig, key: str) -> bool:
    """A tensor of the blocks after the last: DeepSeek-V3's multi-token-prediction modules
    (num_nextn_predict_layers), which transformers' model leaves out as shardtrain's does."""
    parts = key.split(".")
    return cfg.attention == "mla" and parts[:2] == ["model", "layers"] and \
        parts[2].isdigit() and int(parts[2]) >= cfg.n_layers


def canonical_name(cfg: ModelConfig, key: str) -> str:
    """The original GPT-2 release names its tensors without the "transformer." prefix."""
    if cfg.style == "gpt2" and not key.startswith(("transformer.", "lm_head.")):
        return "transformer." + key
    return key
