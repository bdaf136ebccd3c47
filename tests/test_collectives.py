"""Collectives: every op x algorithm equals the native backend, the ledger's bytes equal
theory, bad input fails clearly. World sizes 1-8 come from one spawn of 8 processes (a
sub-group per size: spawning is the slow part; the checks each rank runs are in
tests/collectives_checks.py); world size 1 runs in this process.
"""

from __future__ import annotations

import pytest
import torch

from collectives_checks import BANDWIDTH_LINK, REDUCE_OPS, world_checks
from dist import run_distributed
from shardtrain import config
from shardtrain.comm import CommLedger, Communicator
from shardtrain.config import ConfigError
from shardtrain.comm.algorithms import IMPLEMENTATIONS
from shardtrain.comm.dispatch import ALGORITHMS, choose
from shardtrain.cost import topology
from shardtrain.cost.collectives import cost
from shardtrain.cost.link import Link


@pytest.fixture(scope="module")
def suite() -> list[dict]:
    return run_distributed(world_checks, 8, timeout_s=600)


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_every_op_and_algorithm_equals_native(suite):
    """World sizes 2-8 (3, 5, 6, 7 included), counts 0, 1, 7, 1000, 2^15+3; hierarchical
    and torus with virtual nodes of 2 and 3 (grids 2x2, 2x3, 3x2, 2x4, ...); mesh2d,
    torus3d (2x2x2) and ring_tree on virtual nodes of 2, where they lay the group out;
    gather_broadcast's all-gather on every size."""
    bad = [b for r in suite for b in r["bad"]]
    assert not bad, f"differs from native: {bad[:20]}"


def test_world_size_one_is_local():
    comm = Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), algorithm="ring")
    x = torch.arange(5.0)
    for op in REDUCE_OPS:
        comm.all_reduce(x, op)
    out = torch.empty(5)
    comm.all_gather(out, x)
    comm.reduce_scatter(out, x)
    assert torch.equal(x, torch.arange(5.0)) and torch.equal(out, x) and not comm.ledger.records


def _core(p: int) -> int:
    return 1 << (p.bit_length() - 1)


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_ledger_volumes_equal_theory(suite):
    """Bytes sent per rank, S the message (the gathered size for all_gather / reduce_scatter;
    S divisible by every p here, so no padding):
    - ring and Rabenseifner / halving-doubling all-reduce: 2(p-1)/p S (power-of-two p);
      off powers of two, with core c = 2^floor(lg p) and r = p - c: members 2i+1 < 2r send S
      (fold), members 2i < 2r send 2(c-1)/c S + S (core share + unfold), the rest 2(c-1)/c S;
    - recursive doubling all-reduce: lg2(p) S (folded as above, lg2(c) S in the core);
    - ring and recursive-doubling all-gather, ring reduce-scatter: (p-1)/p S;
    - binomial broadcast: the root sends ceil(lg2 p) S;
    - hierarchical (nodes of k, m = p/k nodes): only node leaders send across nodes, exactly
      a ring all-reduce among the leaders, 2(m-1)/m S; torus r x c: 2(r-1)/r S/c across nodes.
    """
    S = 4 * 840 * 8
    for p, per_rank in {p: [r["volumes"].get(p) for r in suite[:p]] for p in (4, 5, 6, 8)}.items():
        c, k = _core(p), 3 if p == 6 else 2
        m = p // k
        for rank, v in enumerate(per_rank):
            folded = rank < 2 * (p - c)
            odd = folded and rank % 2 == 1
            ring_ar = 2 * (p - 1) * S // p
            assert v[("all_reduce", "ring")][:2] == (ring_ar, ring_ar)
            assert v[("all_reduce", "ring")][3] == 2 * (p - 1)
            core_share = 2 * (c - 1) * S // c
            expect = S if odd else core_share + (S if folded else 0)
            for a in ("rabenseifner", "halving_doubling"):
                assert v[("all_reduce", a)][0] == expect, (p, rank, a)
            lg = c.bit_length() - 1
            expect = S if odd else lg * S + (S if folded else 0)
            assert v[("all_reduce", "recursive_doubling")][0] == expect, (p, rank)
            for op in ("all_gather", "reduce_scatter"):
                assert v[(op, "ring")][:2] == ((p - 1) * S // p,) * 2, (p, op)
            if p == c:
                assert v[("all_gather", "recursive_doubling")][0] == (p - 1) * S // p
            if rank == 0:
                assert v[("broadcast", "tree")][0] == (p - 1).bit_length() * S
            if p == 5:  # nodes of 2, 2, 1: checked for correctness only
                continue
            leader = rank % k == 0
            inter = v[("all_reduce", "hierarchical")][2]
            assert inter == (2 * (m - 1) * S // m if leader else 0), (p, rank, inter)
            rows = p // k
            assert v[("all_reduce", "torus2d")][2] == 2 * (rows - 1) * S // (rows * k)


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_grid_ledger_equals_cost_model_to_the_byte(suite):
    """mesh2d, torus3d, ring_tree and gather_broadcast: the bytes each rank sent (the
    ledger, counted message by message) against the cost model's busiest rank and mean,
    on virtual nodes of 2 (p = 4, 8) and 3 (p = 6); S divides evenly. Across nodes: the
    torus3d on 2 x 2 x 2 sends only its two outer rings' bytes, 3/4 S; mesh2d's column
    line (4 x 2 grid, nodes of 2) is all of its inter-node traffic: 2 S from an interior
    member, S from an end."""
    S = 4 * 840 * 8
    checked = set()
    for p, node in ((4, 2), (6, 3), (8, 2)):
        per_rank = [r["volumes"][p] for r in suite[:p]]
        for (op, a) in per_rank[0]:
            if a not in ("mesh2d", "torus3d", "ring_tree", "gather_broadcast"):
                continue
            sent = [v[(op, a)][0] for v in per_rank]
            model = cost(op, S, p, BANDWIDTH_LINK, algorithm=a, local_size=node)
            assert max(sent) == model.sent_bytes, (p, op, a, sent, model)
            if a != "gather_broadcast" or p in (4, 8):  # its tree's mean is exact on 2^k
                assert sum(sent) == p * model.sent_bytes_mean, (p, op, a, sent, model)
            checked.add((op, a))
    assert checked == {("all_reduce", "mesh2d"), ("all_reduce", "ring_tree"),
                       ("all_gather", "gather_broadcast"), ("all_reduce", "torus3d"),
                       ("reduce_scatter", "torus3d"), ("all_gather", "torus3d")}
    for v in (r["volumes"][8] for r in suite):
        assert v[("all_reduce", "torus3d")][2] == 3 * S // 4
    for rank, v in enumerate(r["volumes"][8] for r in suite):  # column line of 4, rows of 2
        interior = 0 < rank // 2 < 3  # sends 3 + 5 parts of S/4; an end 3 + 1
        assert v[("all_reduce", "mesh2d")][2] == (2 * S if interior else S), rank


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_grid_link_bytes_equal_cost_model(suite):
    """Per directed link, the ledger's bytes (each rank's `sent_to`) equal the cost model's
    (topology.link_bytes) to the byte: torus3d 2 x 2 x 2, mesh2d 2 x 2, 3 x 2 (nodes of
    2) and 2 x 3 (nodes of 3), torus2d on the same grids. mesh2d: n on every directed link;
    the 3D torus: S, S/2, S/4 on the inner, middle and outer dimension's links."""
    S = 4 * 840 * 8
    for p, node in ((4, 2), (6, 3), (8, 2)):
        for a in ("torus2d", "mesh2d", "torus3d"):
            if ("all_reduce", a) not in suite[0]["volumes"][p]:
                continue
            ledger = {(r, peer): sent for r in range(p)
                      for peer, sent in suite[r]["volumes"][p][("all_reduce", a)][4].items()}
            assert ledger == topology.link_bytes(a, S, p, node), (p, a)
            if a == "torus3d":
                assert sorted(set(ledger.values())) == [S // 4, S // 2, S]


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_bad_input_fails_clearly(suite):
    e = suite[0]["errors"]
    assert "all_reduce on group err0: unknown algorithm 'warp'" in e["unknown"]
    assert ("all_gather on group err0: algorithm 'tree' cannot serve this call (it has no "
            "all_gather); use one of native, ring, recursive_doubling") in e["cannot"]
    for rank in (0, 1):
        err = suite[rank]["errors"]
        assert "CommError: all_reduce on group err0 (algorithm ring): ranks disagree on the " \
               "element count" in err["size"]
        assert "all_to_all on group err0 (algorithm native): output_splits disagree" \
            in err["splits"]
    for name in ("ring", "native"):
        assert f"all_reduce on group err{1 if name == 'ring' else 2} (algorithm {name})" \
            in e[f"timeout_{name}"] and "comm.timeout_s" in e[f"timeout_{name}"]
        assert e[f"timeout_{name}_s"] < 3.0
    assert ("ValueError: group err0: comm.algorithm=torus3d needs a 3D torus: a size with "
            "three factors >= 2 (8, 12, 16, 18, 27, ...), and this group has 2 ranks; change "
            "the layout") in e["grid"]


def test_grid_that_does_not_factor_is_refused_at_config():
    """Before any process starts: the dp group of 4 makes no 3D torus, of 2 no 2D mesh."""
    for algorithm, world, why in (("torus3d", 4, "a 3D torus"), ("mesh2d", 2, "a 2D grid")):
        cfg = config.load("tiny", ["--comm.algorithm", algorithm])
        with pytest.raises(ConfigError, match=f"group dp: comm.algorithm={algorithm} needs "
                                              f"{why}.* this group has {world} ranks"):
            cfg.validate(world)
    config.load("tiny", ["--comm.algorithm", "mesh2d"]).validate(4)  # 2 x 2


def test_choice_and_names():
    link = Link(alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10)
    kw = dict(requested=None, group="dp", p=8, local_size=2, link=link)
    assert choose("all_reduce", 1024, default="auto", **kw) == "recursive_doubling"
    assert choose("all_reduce", 2**28, default="auto", **kw) in (
        "ring", "rabenseifner", "halving_doubling", "torus2d", "torus3d")
    assert choose("all_to_all", 2**10, default="auto", **kw) == "recursive_doubling"
    assert choose("all_to_all", 2**10, default="auto", equal_splits=False, **kw) == "ring"
    assert choose("all_gather", 2**20, default="tree", **kw) == "native"  # run default
    assert ALGORITHMS[-1] == "auto" and set(ALGORITHMS[1:-1]) == set(IMPLEMENTATIONS)
