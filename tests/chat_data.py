"""Chat fixtures: a tiny Llama directory with a tokenizer and chat template, and
conversations whose user turns are random words and whose assistant turns are one fixed
reply (so only the assistant's tokens can be learned)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"{a}{b}{c}" for a in "bcdfgklmnprstvz" for b in "aeiou" for c in "nrst"][:200]
REPLY = "sure thing , here it is"
SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
# Replies marked for transformers' assistant-token mask; WITHOUT_MARKS renders the same text
# (the assistant's spans are then found by rendering prefixes: data/chat.py).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
            "<|assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITHOUT_MARKS = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def conversation(rng: random.Random, turns: int = 1) -> list[dict[str, str]]:
    out = []
    for _ in range(turns):
        out += [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 9)))},
                {"role": "assistant", "content": REPLY}]
    return out


def write_chat(path: Path, n: int, seed: int = 0, turns: int = 1) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"messages": conversation(rng, rng.randint(1, turns))})
                            + "\n" for _ in range(n)))
    return path


def tokenizer_dir(out: Path, template: str = TEMPLATE) -> Path:
    """A word-level BPE of at most 256 tokens (the tiny preset's vocabulary), saved by
    transformers with the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS), REPLY] * 4, trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", *SPECIALS], show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return out


def llama_dir(out: Path) -> Path:
    """A random tiny Llama with the tiny preset's shape, and the chat tokenizer beside it."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return tokenizer_dir(out)
