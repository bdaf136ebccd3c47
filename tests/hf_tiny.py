"""Tiny random Hugging Face checkpoints for the interop tests (test_hf_families.py,
test_hf_moe.py), and the logits both sides compare."""

from __future__ import annotations

import torch

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def save_random(path, hf_config):
    """A random model of `hf_config` (a transformers config), saved to `path`; every 1-D
    weight (biases, norms) moved away from its init so a misplaced or unpermuted one shows
    in the logits."""
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.eval().save_pretrained(path)
    return model


def logits(model, ours: bool) -> torch.Tensor:
    """`model`'s logits on TOKENS: ours (a Transformer) or transformers' (`.logits`)."""
    with torch.no_grad():
        return model(TOKENS) if ours else model(TOKENS).logits
