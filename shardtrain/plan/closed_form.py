"""The papers' closed forms, kept beside the exact counts of counts.py to check them.

For a GPT-2/3-style model (biases, LayerNorm, learned positions, tied head) the exact
count is the closed form of Narayanan et al. 2021 plus the final LayerNorm's 2h; the
exact model FLOPs and full-recomputation hardware FLOPs equal these forms exactly.
Korthikanti et al.'s selective form charges 12 s^2 h per layer and sequence for the
recomputed attention core where the exact count (counts.hardware_flops_per_token)
charges the forward the runtime reruns, 4 s^2 h; the planner uses the exact count.
"""

from __future__ import annotations

from shardtrain.config import ModelConfig


def narayanan_params(cfg: ModelConfig) -> float:
    """12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)) (Narayanan et al. 2021, section 5.1)."""
    L, h, V, s = cfg.n_layers, cfg.dim, cfg.vocab_size, cfg.max_seq_len
    return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def narayanan_model_flops(cfg: ModelConfig, *, batch: int, seq_len: int) -> float:
    """Model FLOPs of one step: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) (Narayanan et al.
    2021, eq. 3, without the recomputation their 96 counts)."""
    L, h, V, s = cfg.n_layers, cfg.dim, cfg.vocab_size, seq_len
    return 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def korthikanti_hardware_flops(cfg: ModelConfig, *, batch: int, seq_len: int,
                               recompute: str) -> float:
    """Hardware FLOPs of one step (Korthikanti et al. 2022, section 6): full
    recomputation 96 B s L h^2 (1 + s/(6h) + V/(16 L h)); selective
    72 B s L h^2 (1 + s/(3h) + V/(12 h L)); none: the model FLOPs."""
    L, h, V, s = cfg.n_layers, cfg.dim, cfg.vocab_size, seq_len
    if recompute == "full":
        return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    if recompute == "selective":
        return 72 * batch * s * L * h * h * (1 + s / (3 * h) + V / (12 * h * L))
    return narayanan_model_flops(cfg, batch=batch, seq_len=seq_len)


def training_flops(params: float, tokens: float, *, recompute: str = "none") -> float:
    """The rule of thumb: 6 N D (forward 2, backward 4 per parameter and token); 8 N D
    with full recomputation (Narayanan et al. 2021: time ~ 8TP/(nX), 6TP/(nX) without)."""
    return (8 if recompute == "full" else 6) * params * tokens


def activation_bytes_per_layer(*, s: int, b: int, h: int, a: int, t: int = 1,
                               sp: bool = False, recompute: str = "none",
                               value_bytes: int = 2) -> float:
    """One layer, one micro-batch (Korthikanti et al. 2022, Table 2), with value_bytes = 2:
    none sbh(34 + 5as/h); tp sbh(10 + 24/t + 5as/(ht)); tp+sp (sbh/t)(34 + 5as/h);
    selective drops the 5as/h term; full keeps the layer input, 2sbh (/t with sp).
    Of the 10 sbh kept whole under tp, 2 sbh are 1-byte dropout masks; of 5as^2b, as^2b."""
    sbh = s * b * h
    if recompute == "full":
        return value_bytes * sbh / (t if sp else 1)
    replicated = (4 * value_bytes + 2) * sbh / (t if sp else 1)
    split = 12 * value_bytes * sbh / t
    scores = 0.0 if recompute == "selective" else (2 * value_bytes + 1) * a * s * s * b / t
    return replicated + split + scores
