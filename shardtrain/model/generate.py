"""Autoregressive sampling from a trained model (no KV cache: the models here are small)."""

from __future__ import annotations

import torch

from shardtrain.model.transformer import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Extend `prompt` by `max_new_tokens` tokens sampled with temperature and top-k."""
    if not prompt:
        raise ValueError("generate: the prompt encodes to no tokens; give a non-empty prompt")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt)
    window = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-window:]], device=device)
        logits = model(context)[0, -1].float().cpu()  # [V]
        if temperature <= 0:
            tokens.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if 0 < top_k < logits.numel():
            cutoff = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    model.train(was_training)
    return tokens
