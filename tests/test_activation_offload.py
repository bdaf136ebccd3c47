"""Activation offload (train.activation_offload = cpu, parallel/offload_activations.py).

On one process: the offloaded run's loss and gradients are bitwise those of the run
without it (llama with GQA and gpt2, fp32 and bf16 autocast, no / selective / full
recomputation); the bytes the hooks move down and up, the host peak and the device window
equal the planner's terms (plan/activation_offload.py through plan/evaluate.py); the hooks
offload per block in forward order and reload each block before the previous block's
backward needs it (one ahead), each micro-batch in its own chain; a split backward
(zero-bubble's B then W) reloads in W what B's window dropped. On two processes (slow
tier): dp, ZeRO-3, tp + sp, pp 1F1B, ZB-H1 and ZB-V, selective recomputation, each bitwise
against the same layout without offload, and the ledger's figures against the planner's.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_distributed
from parity import tiny, train_layouts

from shardtrain import config
from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.transformer import build_model
from shardtrain.parallel.activation import checkpoint_attention_cores, checkpoint_blocks
from shardtrain.parallel.offload_activations import ActivationOffload
from shardtrain.parallel.pipeline.split_backward import input_backward, weight_backward
from shardtrain.plan.evaluate import activation_offload_terms
from shardtrain.plan.layout import Layout, config_layout
from shardtrain.plan.memory import memory_per_gpu
from shardtrain.plan.partition import rank_params

B, S, M = 2, 32, 2  # micro-batch, sequence, micro-batches accumulated
MODELS = {
    "llama-gqa": ModelConfig(style="llama", vocab_size=256, dim=64, n_layers=3, n_heads=4,
                             n_kv_heads=2, max_seq_len=S),
    "gpt2": ModelConfig(style="gpt2", vocab_size=256, dim=64, n_layers=3, n_heads=4,
                        max_seq_len=S),
}


def _model(cfg: ModelConfig, recompute: str, offload: ActivationOffload | None):
    model = build_model(cfg, seed=3)
    if recompute == "selective":
        checkpoint_attention_cores(model.layers)
    elif recompute == "full":
        checkpoint_blocks(model.layers)
    if offload is not None:
        offload.install(model.layers)
    return model


def _train(cfg: ModelConfig, recompute: str, precision: str, offload=None):
    """M micro-batches accumulated: (losses, gradients)."""
    model = _model(cfg, recompute, offload)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(M):
        tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "amp"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_offload_is_bitwise_and_moves_the_planned_bytes(name, precision, recompute):
    cfg = MODELS[name]
    losses, grads = _train(cfg, recompute, precision)
    offload = ActivationOffload(torch.device("cpu"))
    got_losses, got_grads = _train(cfg, recompute, precision, offload)
    assert all(torch.equal(a, b) for a, b in zip(losses, got_losses, strict=True))
    for n, g in grads.items():
        assert torch.equal(got_grads[n], g), n
    lay = Layout(precision=precision, micro_batch=B, microbatches=M, recompute=recompute,
                 activation_offload="cpu")
    memory = memory_per_gpu(cfg, lay, seq_len=S, staging_bytes=0)  # no save's pool
    terms = activation_offload_terms(cfg, lay, memory)
    ledger = offload.ledger()
    # what the hooks moved, each way, is the planner's per step; the host held one
    # micro-batch's layers (accumulation runs them one after another), the device two layers
    assert ledger["activation_offload_down_bytes"] == terms.moved_bytes
    assert ledger["activation_offload_up_bytes"] == terms.moved_bytes
    assert ledger["activation_offload_host_peak_bytes"] == terms.host_bytes == memory.host
    assert ledger["activation_offload_device_peak_bytes"] == terms.device_bytes
    assert terms.device_bytes == 2 * memory.activations_per_layer
    assert offload.host_bytes == offload.device_bytes == 0  # all freed with the graphs


def _chains(trace: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for what, chain, block in trace:
        out.setdefault(chain, []).append((what, block))
    return out


def test_hooks_offload_per_block_and_reload_one_block_ahead():
    """Micro-batches in 1F1B's order (F0 F1 B0 F2 B1 B2): each keeps its own chain; in
    each, blocks go down in forward order, and block i - 1's reload starts before block
    i's first unpack (its backward), block i's own before that."""
    cfg = MODELS["llama-gqa"]
    trace: list = []
    offload = ActivationOffload(torch.device("cpu"), trace=trace)
    model = _model(cfg, "selective", offload)
    tokens = torch.randint(0, cfg.vocab_size, (3, B, S), generator=torch.Generator().manual_seed(1))
    outs = {}
    for op, mb in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)):
        if op == "F":
            outs[mb] = model(tokens[mb]).square().mean()
        else:
            outs.pop(mb).backward()
    per_layer = offload.host_peak // (2 * cfg.n_layers)
    assert offload.host_peak == 2 * cfg.n_layers * per_layer  # two micro-batches in flight
    chains = _chains(trace)
    assert len(chains) == 3
    layers = range(cfg.n_layers)
    for events in chains.values():
        assert [b for w, b in events if w == "offload"] == list(layers)
        assert [b for w, b in events if w == "unpack"] == list(reversed(layers))
        assert [b for w, b in events if w == "reload"] == list(reversed(layers))
        for i in layers:
            first_unpack = events.index(("unpack", i))
            assert events.index(("reload", i)) < first_unpack
            if i > 0:  # one ahead: the previous block is on its way before i's backward
                assert events.index(("reload", i - 1)) < first_unpack
    assert offload.device_peak == 2 * per_layer


def test_split_backward_reloads_in_w_what_b_dropped():
    """Zero-bubble's B (the input gradient, graph kept) then W (the weights' gradients) on
    a stack of blocks: W's unpacks reload from the host copies what B's window released;
    the gradients are bitwise those of the same split without offload."""
    cfg = MODELS["llama-gqa"]
    results = []
    for offload in (None, ActivationOffload(torch.device("cpu"), trace=[])):
        model = _model(cfg, "none", offload)
        x = torch.randn(B, S, cfg.dim, generator=torch.Generator().manual_seed(2),
                        requires_grad=True)
        rope = (model.rope_cos[:S], model.rope_sin[:S])
        out = x
        for block in model.layers:
            out = block(out, rope)
        kept = input_backward(out, torch.ones_like(out), x)
        weight_backward(kept)
        del kept, out
        results.append((x.grad, {n: p.grad for n, p in model.named_parameters()
                                 if p.grad is not None}))
    (x_grad, grads), (got_x, got_grads) = results
    assert torch.equal(got_x, x_grad) and grads.keys() == got_grads.keys()
    for n, g in grads.items():
        assert torch.equal(got_grads[n], g), n
    events = _chains(offload.trace)[1]
    released = [b for w, b in events if w == "release"]
    assert released == [2, 1]  # B's window moved down the stack
    assert events.count(("reload", 1)) == 2  # W reloaded it


def test_compile_with_offload_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match="train.compile=true with train.activation_offload"
                                          "=cpu.*train.activation_offload=none"):
        tiny(tmp_path, "x", "--train.compile", "true", "--train.activation_offload", "cpu"
             ).validate(1)


def test_planner_layout_round_trips_the_field(tmp_path):
    cfg = tiny(tmp_path, "x", "--train.activation_offload", "cpu")
    lay = config_layout(cfg, 1)
    assert lay.activation_offload == "cpu" and "activation_offload=cpu" in lay.describe()
    plain = memory_per_gpu(cfg.model, Layout(precision="fp32", micro_batch=2), seq_len=32,
                           staging_bytes=0)  # host: the activations alone, no save's pool
    off = memory_per_gpu(cfg.model, Layout(precision="fp32", micro_batch=2,
                                           activation_offload="cpu"), seq_len=32,
                         staging_bytes=0)
    per_layer = plain.activations_per_layer  # the head's activations stay on the device
    assert plain.activations - off.activations == (cfg.model.n_layers - 2) * per_layer
    assert off.host == off.offloaded == cfg.model.n_layers * per_layer


STEPS = "3"
LAYOUTS = [  # label, overrides (each trained without and with offload in one spawn)
    ("dp2", []),
    ("zero3", ["--parallel.zero", "3"]),
    ("tp2 sp", ["--parallel.tp", "2", "--parallel.sp", "true"]),
    ("pp2 1f1b", ["--parallel.pp", "2", "--parallel.microbatches", "4"]),
    ("pp2 zb-h1", ["--parallel.pp", "2", "--parallel.schedule", "zb-h1",
                   "--parallel.microbatches", "4"]),
    ("pp2 zbv", ["--parallel.pp", "2", "--parallel.schedule", "zbv",
                 "--parallel.virtual_stages", "2", "--parallel.microbatches", "4"]),
    ("dp2 selective", ["--train.activation_checkpointing", "selective"]),
]
SPLIT = ("zb-h1", "zbv")  # W after B: W reloads what B's window dropped, holds it to its end


def _figures(trainer) -> dict:
    return {"ledger": trainer.memory_ledger(),
            "layers": len(trainer.parallel.module.layers)}


@pytest.mark.slow  # 14 runs on 2 ranks (about 40 s on 2 cores)
def test_offload_is_bitwise_under_every_layout(tmp_path):
    cfgs = [tiny(tmp_path, f"{i}-{off}", "--model.n_layers", "4", "--train.steps", STEPS,
                 "--train.activation_offload", off, *over)
            for i, (_, over) in enumerate(LAYOUTS) for off in ("none", "cpu")]
    per_rank = run_distributed(train_layouts, 2, [config.to_toml(c) for c in cfgs], _figures)
    for i, (label, _) in enumerate(LAYOUTS):
        for rank, results in enumerate(per_rank):
            plain, off = results[2 * i], results[2 * i + 1]
            assert plain["losses"] == off["losses"], f"{label} rank {rank}"
            assert plain["eval_loss"] == off["eval_loss"], f"{label} rank {rank}"
            for n, w in plain["weights"].items():
                assert torch.equal(off["weights"][n], w), f"{label} rank {rank} {n}"
            cfg, ledger = cfgs[2 * i + 1], off["ledger"]
            lay = config_layout(cfg, 2)
            memory = memory_per_gpu(cfg.model, lay, seq_len=cfg.train.seq_len, staging_bytes=0)
            terms = activation_offload_terms(cfg.model, lay, memory)
            # the planner's busiest stage holds as many layers as each rank here
            assert off["layers"] == rank_params(cfg.model, lay).layers, label
            moved = ledger["activation_offload_down_bytes"] / int(STEPS)
            host = ledger["activation_offload_host_peak_bytes"]
            print(f"{label} rank {rank}: down {moved:.0f} B/step, planned "
                  f"{terms.moved_bytes:.0f}; host peak {host}, planned {terms.host_bytes:.0f}")
            assert moved == terms.moved_bytes, label
            if label.split()[-1] in SPLIT:
                assert ledger["activation_offload_up_bytes"] >= moved * int(STEPS), label
                continue
            assert ledger["activation_offload_up_bytes"] == moved * int(STEPS), label
            assert host <= terms.host_bytes, label  # the last stage holds fewer in flight
            assert ledger["activation_offload_device_peak_bytes"] <= terms.device_bytes, label
