"""Group-limited routing (issue 44 part 3, docs/moe.md "Group-limited routing"): the choice
by hand, the config's errors, and on 2 ranks (one spawn) the expert-parallel exchange that
sends each token once per kept group: the single process's numbers, and ledger bytes equal
to the planner's with and without it."""

from __future__ import annotations

import pytest
import torch

from shardtrain import config
from shardtrain.config import ConfigError, ModelConfig
from shardtrain.model.moe_routing import limit_groups, route
from shardtrain.plan.layout import config_layout
from shardtrain.plan.traffic import expert_parallel_ops

from dist import run_distributed
from parity import BF16_LOSS_RTOL, LOSS_RTOL, WEIGHT_TOL, make_mesh, tiny

STEPS = 2
EXPERTS = ("--model.n_experts", "4", "--model.moe_top_k", "2", "--train.steps", str(STEPS))
LIMITED = ("--model.moe_groups", "2", "--model.moe_max_groups", "1")


def test_the_choice_by_hand():
    """Groups score by the sum of their two best experts; a token keeps its best g groups
    and picks its k experts among theirs; g = G is no limit."""
    choice = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.1, 0.1],   # groups: 0.9, 1.0, 0.2
                           [0.1, 0.3, 0.2, 0.0, 0.8, 0.0]])  # 0.4, 0.2, 0.8
    limited, kept = limit_groups(choice, 3, 1)
    assert kept.tolist() == [[1], [2]]
    assert limited.topk(2).indices.sort().values.tolist() == [[2, 3], [4, 5]]
    assert limit_groups(choice, 3, 2)[1].tolist() == [[0, 1], [0, 2]]
    router = torch.nn.Linear(8, 6, bias=False)
    x = torch.randn(32, 8)
    free, two = route(x, router, 2), route(x, router, 2, groups=(3, 3))
    assert torch.equal(free.experts, two.experts) and torch.equal(free.weights, two.weights)
    one = route(x, router, 2, "sigmoid", groups=(3, 1))
    assert torch.equal(one.experts // 2, one.groups.expand(-1, 2))  # both in the kept group


@pytest.mark.parametrize("overrides,field", [
    (dict(moe_groups=2), "model.moe_groups"),
    (dict(moe_groups=3, moe_max_groups=1), "model.moe_groups"),
    (dict(moe_groups=4, moe_max_groups=5), "model.moe_max_groups"),
    (dict(moe_groups=4, moe_max_groups=1, moe_top_k=2), "model.moe_max_groups"),  # 1 expert
])
def test_config_errors(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{"n_experts": 4, **overrides}).validate()


def _train(rank: int, world: int, texts: list[str]) -> list[dict]:
    """Worker: each config STEPS steps; per step its loss and this rank's ep records'
    (what, sent bytes); then the full weights."""
    from shardtrain.train.trainer import Trainer

    out = []
    for text in texts:
        cfg = config.loads(text)
        trainer = Trainer(cfg, make_mesh(cfg, rank, world), torch.device("cpu"))
        losses, sent = [], []
        for _ in range(STEPS):
            first = len(trainer.mesh.ledger.records)
            losses.append(trainer.train_step()["loss"])
            sent.append([r.sent_bytes for r in trainer.mesh.ledger.records[first:]
                         if r.tag == "ep"])
        out.append({"losses": losses, "sent": sent,
                    "weights": trainer.parallel.full_state_dict()})
    return out


def test_grouped_exchange_parity_and_bytes(tmp_path):
    """ep = 2, 2 groups, one per token, top-2: every token sends one row (and its group's
    2 gates) where the slot exchange sends two. fp32 (also with capacity drops, and gpt2's
    biased experts) and bf16 train as one process does;
    per step the ledger's calls and bytes summed over the two ranks equal the planner's
    (every row received was sent: the per-rank split depends on the routing), and fall
    against the same model's slot exchange (no limit) as the planner says."""
    bf16, capacity = ("--train.precision", "bf16"), ("--model.moe_capacity_factor", "0.5")
    gpt2 = ("--model.style", "gpt2", "--model.n_kv_heads", "0")
    runs = {"grouped": EXPERTS + LIMITED, "grouped bf16": EXPERTS + LIMITED + bf16,
            # capacity drops some slots: their gates travel as -1, the row count is T g still
            "grouped capacity": EXPERTS + LIMITED + capacity,
            "grouped gpt2": EXPERTS + LIMITED + gpt2,  # the experts' biases, per slot
            "slots": EXPERTS}  # the same exchange on an unlimited router
    cfgs = {n: tiny(tmp_path, n.replace(" ", "-"), *o, "--parallel.ep", "2") for n, o in
            runs.items()}
    refs = {n: _train(0, 1, [config.to_toml(tiny(tmp_path, "ref-" + n.replace(" ", "-"), *o))])[0]
            for n, o in runs.items() if n != "slots"}
    per_rank = run_distributed(_train, 2, [config.to_toml(c) for c in cfgs.values()])
    planned = {}
    for i, (name, cfg) in enumerate(cfgs.items()):
        cfg.validate(2)
        ops = expert_parallel_ops(cfg.model, config_layout(cfg, 2), seq_len=cfg.train.seq_len)
        assert [op.what for op in ops] == (["counts", "dispatch", "gates", "combine"]
                                           if name != "slots" else ["counts", "dispatch", "combine"])
        planned[name] = sum(op.bytes_sent for op in ops)
        for step in range(STEPS):
            records = [per_rank[r][i]["sent"][step] for r in range(2)]
            assert [len(r) for r in records] == [sum(op.calls for op in ops)] * 2, name
            assert sum(map(sum, records)) == 2 * planned[name], (name, step)
        for rank in range(2):
            got = per_rank[rank][i]
            if name == "slots":
                continue
            ref = refs[name]
            if "bf16" in name:
                worst = max(abs(g - r) / r for g, r in zip(got["losses"], ref["losses"]))
                assert worst <= BF16_LOSS_RTOL[False], (name, rank, worst)
                continue
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                       rtol=LOSS_RTOL, atol=0)
            for key, w in ref["weights"].items():
                torch.testing.assert_close(got["weights"][key], w, rtol=WEIGHT_TOL,
                                           atol=WEIGHT_TOL, msg=lambda m: f"{key}: {m}")
    # one row of C fp32 values and 2 gates per token against two rows per token
    assert planned["grouped"] < 0.6 * planned["slots"], planned
