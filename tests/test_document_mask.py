"""data.document_mask: packed documents compute exactly what each computes alone (logits and
gradients, Llama and GPT-2 styles, with recomputation), a text stream's positions restart
after each EOS, context parallelism is accepted and proposed with them, and a tokenizer
without EOS is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parity import tiny
from shardtrain.config import ConfigError, DataConfig, ModelConfig
from shardtrain.data import TokenSampler, eval_batches, load_dataset
from shardtrain.model.transformer import build_model
from shardtrain.parallel.activation import checkpoint_attention_cores, checkpoint_blocks
from shardtrain.plan.search import candidates

LENGTHS = [(5, 11, 16), (20, 12)]  # documents of each row; 32 tokens a row


def packed_and_alone(model, seed=0):
    """(the packed rows' loss and logits, the documents-alone loss and logits); both losses
    are sums over every token, so their gradients must agree too."""
    gen = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, 256, (1, n), generator=gen) for n in row] for row in LENGTHS]
    tokens = torch.cat([torch.cat(row, 1) for row in docs])  # [2, 32]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    logits = model(tokens, positions)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum")
    alone = torch.cat([torch.cat([model(d) for d in row], 1) for row in docs])
    loss_alone = F.cross_entropy(alone.flatten(0, 1), tokens.flatten(), reduction="sum")
    return (loss, logits), (loss_alone, alone)


@pytest.mark.parametrize("style,recompute", [("llama", "none"), ("gpt2", "selective"),
                                             ("llama", "full")])
def test_packed_documents_compute_as_each_alone(tmp_path, style, recompute):
    model = build_model(tiny(tmp_path, "m", "--model.style", style).model)
    if recompute == "selective":
        assert checkpoint_attention_cores(model.layers) == 2
    elif recompute == "full":
        checkpoint_blocks(model.layers)
    (loss, logits), (loss_alone, alone) = packed_and_alone(model)
    torch.testing.assert_close(logits, alone, rtol=0, atol=2e-5)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    grads_alone = torch.autograd.grad(loss_alone, list(model.parameters()))
    for g, want in zip(grads, grads_alone):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
    # Without the mask the documents see each other: the check above can fail.
    tokens = logits.argmax(-1)
    assert not torch.allclose(model(tokens), model(tokens, torch.stack(
        [torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])), atol=1e-3)


def test_text_positions_restart_after_each_eos():
    eos = 255
    tokens = np.array([1, 2, eos, 3, 4, 5, eos, 6, 7, eos, 8, 9, 10, 11, 12, 13, 14],
                      dtype=np.uint8)
    s = TokenSampler(tokens, seq_len=8, global_batch=2, micro_batch=2, dp_rank=0, dp_size=1,
                     seed=0, eos_id=eos)
    (inputs, targets, positions), = s.next_step()
    for x, p in zip(inputs.tolist(), positions.tolist()):
        want, at = [], 0
        for i, t in enumerate(x):
            at = 0 if i == 0 or x[i - 1] == eos else at + 1
            want.append(at)
        assert p == want
    assert s.loss_tokens == 16 and targets.ne(-100).all()
    (_, _, positions), = eval_batches(tokens, seq_len=8, batch_size=1, n_batches=1, eos_id=eos)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # Without the flag: the plain (inputs, targets) of every layout so far.
    plain = TokenSampler(tokens, seq_len=8, global_batch=2, micro_batch=2, dp_rank=0,
                         dp_size=1, seed=0)
    assert len(plain.next_step()[0]) == 2


def test_document_mask_composes_with_cp_and_needs_an_eos(tmp_path):
    for mode in ("ring", "ulysses"):  # context parallelism keeps attention in documents
        tiny(tmp_path, "cp", "--parallel.cp", "2", "--parallel.cp_mode", mode,
             "--data.document_mask", "true").validate(2)
    # The planner proposes it too.
    long = ModelConfig(style="llama", vocab_size=256, dim=256, n_layers=2, n_heads=8,
                       n_kv_heads=2, max_seq_len=8192)

    def cps(data=None):
        return {c.cp for c in candidates(long, gpus=2, node_size=8, global_batch=8,
                                         seq_len=8192, precision="bf16", data=data)}

    assert cps() == {1, 2} and cps(DataConfig(document_mask=True)) == {1, 2}
    # A tokenizer.json without an EOS token has no document boundaries to mask at.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["some text here"] * 5, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    source = tmp_path / "t.txt"
    source.write_text("some text here " * 200)
    with pytest.raises(ConfigError, match="data.document_mask=true finds documents by the "):
        load_dataset(DataConfig(source=str(source), tokenizer=str(tmp_path / "tokenizer.json"),
                                document_mask=True, cache_dir=str(tmp_path / "c")), seq_len=8)
