"""ZB-H1 (split backward: B, then W later), ZB-V and DualPipeV (two chunks per stage in a
V: schedules.py) reproduce the single-process run, fp32 (losses,
eval loss, final weights) and bf16 (parity.py's bound), at pp = 2 and 4, alone and with
full recomputation, LoRA, tied embeddings (test_pipeline_parity.py's row; under the V with
data parallelism too), ZeRO-1/2/3 over dp = 2 and tensor + sequence parallelism inside a
stage; each run's measured timeline
(timeline_rank*.json) runs its computes in the simulator's order; the split itself gives a
full backward's gradients under LoRA and, in six autograd calls for W, a Llama block's
(one process); a W right after its B leaves the backward whole."""

from __future__ import annotations

import pytest
import torch
from dist import run_distributed
from parity import BF16_LOSS_RTOL, assert_parity, train_layouts, worst_loss_deviation
from test_pipeline_parity import GPT2, RECOMPUTE, _cfg, _check_order, _pp
from test_pipeline_parity import references, tmp  # noqa: F401 (the module's fixtures)

from shardtrain import config
from shardtrain.model.transformer import Block
from shardtrain.parallel.pipeline.split_backward import split_keys
from shardtrain.parallel.pipeline.schedules import build
from shardtrain.parallel.pipeline.split_backward import input_backward, weight_backward

BF16 = ("--train.precision", "bf16")
LORA = ("--lora.rank", "4", "--lora.targets", "q,v,gate,down", "--train.lr", "1e-2")
# spawn -> (world size, [(label, model overrides -- the reference has them too --, layout
# overrides)]), all in the slow tier: the README's command runs ZB-H1 with tied embeddings
# and full recomputation, and ZB-V and DualPipeV with tied embeddings, in
# test_pipeline_parity.py's two-rank spawn.
LAYOUTS = {
    "pp2": (2, [("pp2 zb-h1 m8", (), _pp(2, "zb-h1", 8)),
                ("pp2 zb-h1 m1", (), _pp(2, "zb-h1", 1)),
                ("pp2 zb-h1 m4 bf16", BF16, _pp(2, "zb-h1", 4)),
                *[row for s in ("zbv", "dualpipev") for row in (
                    (f"pp2 {s} m8", (), _pp(2, s, 8)),
                    (f"pp2 {s} m4 bf16", BF16, _pp(2, s, 4)),
                    (f"pp2 {s} m4 full recomputation", (), _pp(2, s, 4, *RECOMPUTE)),
                    (f"pp2 {s} m4 lora", LORA, _pp(2, s, 4)))],
                ("pp2 zb-h1 m4 lora", LORA, _pp(2, "zb-h1", 4))]),
    "4 ranks": (4, [("pp4 zb-h1 m8", (), _pp(4, "zb-h1", 8)),
                    ("pp4 zb-h1 m4 full recomputation", (), _pp(4, "zb-h1", 4, *RECOMPUTE)),
                    ("pp2 x dp2 zb-h1 zero1", (), _pp(2, "zb-h1", 2, "--parallel.zero", "1")),
                    ("pp2 x tp2 sp zb-h1", (), _pp(2, "zb-h1", 4, "--parallel.tp", "2",
                                                    "--parallel.sp", "true")),
                    ("pp2 x dp2 zb-h1 zero2", (), _pp(2, "zb-h1", 2, "--parallel.zero", "2")),
                    ("pp2 x dp2 zb-h1 zero3", (), _pp(2, "zb-h1", 2, "--parallel.zero", "3")),
                    ("pp2 x dp2 zb-h1 zero1 bf16", BF16,
                     _pp(2, "zb-h1", 2, "--parallel.zero", "1")),
                    ("pp4 zbv m8", (), _pp(4, "zbv", 8)),
                    ("pp4 dualpipev m8", (), _pp(4, "dualpipev", 8)),
                    ("pp4 dualpipev m8 bf16", BF16, _pp(4, "dualpipev", 8)),
                    ("pp4 dualpipev m8 full recomputation", (), _pp(4, "dualpipev", 8, *RECOMPUTE)),
                    ("pp4 dualpipev m8 lora", LORA, _pp(4, "dualpipev", 8)),
                    *[row for s in ("zbv", "dualpipev") for row in (
                        (f"pp2 x dp2 {s} zero1", (), _pp(2, s, 4, "--parallel.zero", "1")),
                        # the tied table's two uses on stage 0, both awaited by the reducer
                        (f"pp2 x dp2 {s} gpt2 tied", GPT2, _pp(2, s, 4)),
                        (f"pp2 x dp2 {s} gpt2 tied zero1", GPT2,
                         _pp(2, s, 4, "--parallel.zero", "1")),
                        (f"pp2 x tp2 sp {s}", (), _pp(2, s, 4, "--parallel.tp", "2",
                                                      "--parallel.sp", "true")))]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("spawn", ["pp2", "4 ranks"])
def test_zb_h1_parity_with_single_process(tmp, references, spawn):  # noqa: F811
    world_size, layouts = LAYOUTS[spawn]
    cfgs = [_cfg(tmp, f"zb-{spawn}-{i}", *model, *layout)
            for i, (_, model, layout) in enumerate(layouts)]
    per_rank = run_distributed(train_layouts, world_size, [config.to_toml(c) for c in cfgs])
    for i, (label, model, _) in enumerate(layouts):
        c = cfgs[i]
        dp = world_size // (c.parallel.pp * c.parallel.tp)
        reference = references(model, c.train.global_batch // (dp * c.parallel.microbatches))
        for rank, results in enumerate(per_rank):
            if c.train.precision == "bf16":
                worst = worst_loss_deviation(reference["losses"], results[i]["losses"])
                assert worst <= BF16_LOSS_RTOL[c.parallel.tp > 1], (label, worst)
            else:
                assert_parity(reference, results[i], f"{label} rank {rank}")
        print(f"{label}: losses {[round(x, 5) for x in per_rank[0][i]['losses']]}")
        _check_order(c, world_size)


class _LoRALinear(torch.nn.Module):
    """A frozen base weight plus a trainable low-rank update (Hu et al. 2021)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_split_backward_equals_the_full_one_under_lora():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_LoRALinear(8, 2), torch.nn.GELU(), _LoRALinear(8, 2))
    x, grad = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    model(x).backward(grad)
    full = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    x_grad = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    kept = input_backward(model(x), grad, x)
    assert torch.equal(x.grad, x_grad)
    assert all(p.grad is None for p in model.parameters())  # B: no weight gradient yet
    weight_backward(kept)
    assert all(torch.equal(p.grad, g) for p, g in
               zip((p for p in model.parameters() if p.requires_grad), full))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_split_backward_of_a_llama_block_is_the_whole_one_in_six_calls():
    """Bit for bit the whole backward's gradients, with W's sibling groups in one autograd
    call each: w2 | w1 w3 | the MLP's norm | wo | wq wk wv | the attention's norm."""
    cfg = config.load("tiny", ["--model.style", "llama", "--model.n_layers", "1"]).model
    torch.manual_seed(0)
    block = Block(cfg)
    x, grad = torch.randn(2, 8, cfg.dim, requires_grad=True), torch.randn(2, 8, cfg.dim)
    block(x, None).backward(grad)
    whole = {n: p.grad.clone() for n, p in block.named_parameters()}
    x_grad, x.grad = x.grad.clone(), None
    block.zero_grad(set_to_none=True)
    kept = input_backward(block(x, None), grad, x)
    assert torch.equal(x.grad, x_grad)
    assert [len(nodes) for nodes, _, _ in kept.groups] == [1, 2, 1, 1, 3, 1]
    weight_backward(kept)
    assert all(torch.equal(p.grad, whole[n]) for n, p in block.named_parameters())


def test_a_w_right_after_its_b_runs_whole_at_the_b():
    """split_keys: only the (micro-batch, chunk)s whose W waits for other actions split;
    ZB-V's rank 1 runs chunk 1's W right after its B (the hand-off to its own chunk 0)
    but in the cool-down."""
    plan = build("zbv", 2, 4, 2)
    for rank, actions in enumerate(plan):
        waits = set()
        for i, a in enumerate(actions):
            if a.op == "B":
                w = next(j for j, b in enumerate(actions) if (b.op, b.mb, b.chunk) ==
                         ("W", a.mb, a.chunk))
                if w > i + 1:
                    waits.add((a.mb, a.chunk))
        assert split_keys(actions) == waits, rank
    assert {(mb, 1) for mb in range(3)}.isdisjoint(split_keys(plan[1]))
    assert split_keys(plan[0]) and split_keys(plan[1])
