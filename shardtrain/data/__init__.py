"""Data pipeline: sources, tokenizers, a cached token stream, and the batch sampler.

The names below are imported on first use (PEP 562): a tokenization worker process
(data/tokenize.py) imports this package and should not pay for torch, which only the
sampler needs.
"""

from importlib import import_module
from typing import Any

_HOMES = {"Dataset": "dataset", "check_vocab": "dataset", "load_dataset": "dataset",
          "TokenSampler": "sampler", "eval_batches": "sampler", "check_source": "sources",
          "load_tokenizer": "tokenizer", "make_sampler": "stream"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'shardtrain.data' has no attribute {name!r}")
    return getattr(import_module(f"shardtrain.data.{_HOMES[name]}"), name)
