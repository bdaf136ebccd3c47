"""GPU check of activation offload (train.activation_offload = cpu,
parallel/offload_activations.py): one forward and backward of a Llama-style model under
bf16 autocast, with and without offload. On a GPU the step's peak allocated memory drops by
at least half of what the hooks kept off the device (all but the two-layer window: the
memory a no-offload step holds for the other layers), the loss is the same, the gradients
agree within bf16 backward's run-to-run noise (SDPA's backward kernels may use atomics),
and the side stream's copies are checked to have landed (the reloaded tensors feed the
backward). The CPU twin (tiny size) runs the same code path without the side stream: loss
and gradients bitwise, the ledger's window two layers.
"""

from __future__ import annotations

import torch

from shardtrain.config import ModelConfig
from shardtrain.model.transformer import build_model
from shardtrain.parallel.offload_activations import ActivationOffload

SIZES = {  # device type -> (model, micro-batch, sequence)
    "cuda": (ModelConfig(style="llama", vocab_size=32000, dim=1024, n_layers=8, n_heads=16,
                         n_kv_heads=4, max_seq_len=1024), 4, 1024),
    "cpu": (ModelConfig(style="llama", vocab_size=256, dim=64, n_layers=4, n_heads=4,
                        n_kv_heads=2, max_seq_len=32), 2, 32),
}


def _step(device: torch.device, offload: bool):
    cfg, b, s = SIZES[device.type]
    model = build_model(cfg, device=device, seed=0)
    hooks = None
    if offload:
        hooks = ActivationOffload(device)
        hooks.install(model.layers)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator()
                           .manual_seed(0)).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             tokens[:, 1:].flatten())
    loss.backward()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    return loss.item(), grads, peak, hooks


def test_offload_saves_device_memory_with_the_same_step(device):
    cfg = SIZES[device.type][0]
    loss, grads, peak, _ = _step(device, offload=False)
    got_loss, got_grads, got_peak, hooks = _step(device, offload=True)
    ledger = hooks.ledger()
    per_layer = ledger["activation_offload_down_bytes"] // cfg.n_layers
    assert ledger["activation_offload_up_bytes"] == ledger["activation_offload_down_bytes"]
    assert ledger["activation_offload_device_peak_bytes"] == 2 * per_layer
    assert got_loss == loss
    for n, g in grads.items():
        if device.type == "cpu":
            assert torch.equal(got_grads[n], g), n
        else:
            err = (got_grads[n] - g).abs().max().item()
            assert err <= 2 ** -6 * g.abs().max().item(), f"{n}: {err:.3e}"
    if device.type == "cuda":
        off_device = (cfg.n_layers - 2) * per_layer
        print(f"peak {peak / 2**20:.0f} MiB without offload, {got_peak / 2**20:.0f} MiB with; "
              f"{off_device / 2**20:.0f} MiB of activations kept on the host")
        assert peak - got_peak >= off_device / 2, (peak, got_peak, off_device)
