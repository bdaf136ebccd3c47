"""Data pipeline: text sources, tokenizers, a cached token stream, and the batch sampler."""

from shardtrain.data.dataset import Dataset, check_vocab, load_dataset
from shardtrain.data.sampler import TokenSampler, eval_batches
from shardtrain.data.sources import check_source
from shardtrain.data.tokenizer import load_tokenizer

__all__ = ["check_source", "check_vocab", "load_tokenizer", "load_dataset", "Dataset", "TokenSampler",
           "eval_batches"]
