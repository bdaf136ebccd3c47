"""The alpha-beta-gamma cost model (shardtrain.cost.collectives) against Thakur et al. 2005's forms."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardtrain.cost.collectives import (ALGORITHMS, OPS, STAGED_FRESH_BYTES, best_algorithm,
                                         bus_bandwidth, cost, supported, torus_grid)
from shardtrain.cost.link import Link

A, B, G = 1e-5, 1e-9, 1e-10
LINK = Link(alpha_s=A, beta_s_per_byte=B, gamma_s_per_byte=G)
N = 1e8


@pytest.mark.parametrize("op,algorithm,expected", [
    ("all_reduce", "ring", lambda n, p: 2 * (p - 1) * A + 2 * (p - 1) / p * n * B
     + (p - 1) / p * n * G),
    ("all_reduce", "rabenseifner", lambda n, p: 2 * math.log2(p) * A + 2 * (p - 1) / p * n * B
     + (p - 1) / p * n * G),
    ("all_reduce", "halving_doubling", lambda n, p: 2 * math.log2(p) * A + 2 * (p - 1) / p * n * B
     + (p - 1) / p * n * G),
    ("all_reduce", "recursive_doubling", lambda n, p: math.log2(p) * (A + n * B + n * G)),
    ("all_reduce", "tree", lambda n, p: 2 * math.log2(p) * (A + n * B) + math.log2(p) * n * G),
    ("all_gather", "ring", lambda n, p: (p - 1) * A + (p - 1) / p * n * B),
    ("all_gather", "recursive_doubling", lambda n, p: math.log2(p) * A + (p - 1) / p * n * B),
    ("reduce_scatter", "ring", lambda n, p: (p - 1) * (A + n / p * B + n / p * G)),
    ("broadcast", "tree", lambda n, p: math.log2(p) * (A + n * B)),
    ("reduce", "tree", lambda n, p: math.log2(p) * (A + n * B + n * G)),
    ("all_to_all", "ring", lambda n, p: (p - 1) * (A + n / p * B)),
])
@pytest.mark.parametrize("p", [2, 8, 64])
def test_formulas(op, algorithm, expected, p):
    assert cost(op, N, p, LINK, algorithm=algorithm).time_s == pytest.approx(expected(N, p))


def test_bytes_sent_per_rank():
    p = 8
    ring = cost("all_reduce", N, p, LINK, algorithm="ring")
    assert ring.sent_bytes == pytest.approx(2 * 7 / 8 * N)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert cost(op, N, p, LINK, algorithm="ring").sent_bytes == pytest.approx(7 / 8 * N)
    tree = cost("broadcast", N, p, LINK, algorithm="tree")
    assert tree.sent_bytes == 3 * N  # the root sends lg p times
    assert tree.sent_bytes_mean == pytest.approx(7 / 8 * N)  # p - 1 messages over p ranks


def test_native_matches_the_runtime_ledger():
    pytest.importorskip("torch")  # shardtrain.comm's package imports the communicator
    from shardtrain.comm.ledger import native_volume
    p, msg = 8, 8 * 2 ** 20
    for op in OPS:
        modelled = cost(op, msg, p, LINK)
        root, other = (native_volume(op, msg, p, is_root=r)[0] for r in (True, False))
        assert modelled.sent_bytes == max(root, other), op
        rounds = max(native_volume(op, msg, p, is_root=r)[2] for r in (True, False))
        assert modelled.rounds == rounds, op


def test_one_rank_and_empty_messages_cost_nothing():
    for op in OPS:
        assert cost(op, N, 1, LINK).time_s == 0 and cost(op, 0, 8, LINK).sent_bytes == 0


def test_unsupported_and_unknown_raise():
    with pytest.raises(ValueError, match="does not implement all_to_all"):
        cost("all_to_all", N, 8, LINK, algorithm="tree")
    with pytest.raises(ValueError, match="is not one of"):
        cost("all_reduce", N, 8, LINK, algorithm="butterfly")
    with pytest.raises(ValueError, match="collective"):
        cost("allreduce", N, 8, LINK)
    assert "hierarchical" not in supported("all_reduce", 8)
    assert "hierarchical" in supported("all_reduce", 16, local_size=8)
    assert set(supported("all_reduce", 16, local_size=8)) == set(ALGORITHMS) - {
        "gather_broadcast"}  # an all_gather only
    assert "torus3d" not in supported("all_reduce", 6, local_size=3)  # 6 = 2 x 3: no 3D grid
    assert "torus3d" in supported("all_gather", 12) and "mesh2d" not in supported("all_reduce", 7)


def test_non_power_of_two_folds_extra_ranks():
    # 6 ranks = a core of 4 plus 2 folded: + 2 alpha + 2 n beta + n gamma (Thakur et al. s. 4)
    core = cost("all_reduce", N, 4, LINK, algorithm="rabenseifner").time_s
    six = cost("all_reduce", N, 6, LINK, algorithm="rabenseifner").time_s
    assert six == pytest.approx(core + 2 * A + 2 * N * B + N * G)


def test_best_algorithm_small_vs_large():
    slow_start = Link(alpha_s=1e-4, beta_s_per_byte=1e-10)
    assert best_algorithm("all_reduce", 64, 64, slow_start) in ("recursive_doubling", "tree")
    assert best_algorithm("all_reduce", 1e9, 64, slow_start) in (
        "rabenseifner", "halving_doubling", "torus2d", "torus3d")
    assert best_algorithm("all_reduce", 1e9, 7, slow_start) == "ring"


def test_best_algorithm_may_choose_native_when_asked():
    """The runtime's auto weighs the backend's own algorithm (modelled as a ring for
    all_reduce, ties going to native); the planner and two-tier phases name ours."""
    link = Link(alpha_s=1e-6, beta_s_per_byte=1e-9)
    assert best_algorithm("all_reduce", 1e9, 7, link, native=True) == "native"
    assert best_algorithm("all_reduce", 1e9, 7, link) == "ring"


def test_shared_medium_charges_all_ranks_bytes():
    """On a shared medium time follows the total sent by all ranks, not the critical path:
    a ring all-reduce and a binomial-tree all-reduce both send 2(p-1) n in all."""
    p, n, s = 8, 1e6, 1e-10
    shared = Link(alpha_s=0.0, beta_s_per_byte=0.0, shared_s_per_byte=s)
    for algorithm in ("ring", "tree"):
        assert cost("all_reduce", n, p, shared, algorithm=algorithm).time_s == pytest.approx(
            2 * (p - 1) * n * s)
    both = Link(alpha_s=A, beta_s_per_byte=B, gamma_s_per_byte=G, shared_s_per_byte=s)
    assert cost("all_gather", n, p, both, algorithm="ring").time_s == pytest.approx(
        (p - 1) * A + (p - 1) / p * n * B + (p - 1) * n * s)
    assert Link.from_figures(both.figures()) == both


def test_fit_recovers_the_link_figures():
    """Times made by the model from known figures fit back to those figures, native's own
    latency and staging included."""
    from shardtrain.bench import fit

    truth = Link(alpha_s=3e-4, beta_s_per_byte=2e-10, gamma_s_per_byte=1e-10,
                 shared_s_per_byte=2.5e-10, native_alpha_s=4e-5, staging_s_per_byte=1.2e-9,
                 backend="gloo")
    rows = [{"op": op, "algorithm": a, "bytes": n,
             "time_s": cost(op, n, 4, truth, algorithm=a, local_size=2).time_s}
            for op in OPS for a in (*fit.FITTED, "native") if a in supported(op, 4, 2)
            for n in (2**10, 2**16, 2**22, 2**26, 2**28)]
    got = fit.fit(rows, 4, 2, "gloo")
    assert got.backend == "gloo"
    for want, have in zip(truth.figures(), got.figures(), strict=True):
        assert have == pytest.approx(want, rel=1e-6)
    no_native = fit.fit([r for r in rows if r["algorithm"] != "native"], 4, 2, "gloo")
    assert no_native.native_alpha_s == pytest.approx(3e-4) and no_native.staging_s_per_byte == 0


def test_native_has_its_own_latency_and_staging():
    """The backend's rounds cost native_alpha. Gloo copies all_gather, gather and
    reduce_scatter through a temporary (fresh pages above glibc's mmap threshold), runs
    reduce_scatter as an all_reduce, reduce as a ring and broadcast as a binomial tree, and
    posts the p - 1 transfers of gather, scatter and all_to_all at once (one round); NCCL's
    native is the plain form."""
    link = Link(alpha_s=5e-4, beta_s_per_byte=0.0, shared_s_per_byte=2e-10, native_alpha_s=5e-5)
    assert Link(alpha_s=A, beta_s_per_byte=B).native_alpha_s == A
    assert Link.from_figures(link.figures()) == link
    assert Link.from_figures(link.figures()[:4]).native_alpha_s == 5e-4  # older figures
    with pytest.raises(ValueError, match="backend 'mpi'"):
        Link(alpha_s=A, beta_s_per_byte=B, backend="mpi")
    small = 2**10
    assert cost("all_reduce", small, 4, link).time_s == pytest.approx(6 * 5e-5 + 6 * small * 2e-10)
    assert best_algorithm("all_reduce", small, 4, link, native=True) == "native"
    gloo = dataclasses.replace(link, staging_s_per_byte=1e-9, gamma_s_per_byte=1e-10,
                               backend="gloo")
    nccl = dataclasses.replace(gloo, backend="nccl")
    big = STAGED_FRESH_BYTES * 2
    for n, fresh in ((big, big), (STAGED_FRESH_BYTES, 0)):
        for op, fewer_rounds in (("all_gather", 0), ("gather", 2)):
            assert cost(op, n, 4, gloo).time_s == pytest.approx(
                cost(op, n, 4, nccl).time_s - fewer_rounds * 5e-5 + n * 1e-10 + fresh * 1e-9)
        assert cost("reduce_scatter", n, 4, gloo).time_s == pytest.approx(
            cost("all_reduce", n, 4, nccl).time_s + n * 1e-10 + fresh * 1e-9)
    assert best_algorithm("all_gather", big, 4, gloo, native=True) != "native"
    assert cost("all_reduce", big, 4, gloo) == cost("all_reduce", big, 4, nccl)
    own = dataclasses.replace(gloo, alpha_s=5e-5)  # our algorithms at native's latency
    assert cost("reduce", small, 4, gloo).time_s == pytest.approx(  # gloo/reduce.cc: a ring
        cost("reduce", small, 4, own, algorithm="ring").time_s)
    assert cost("broadcast", small, 4, gloo) == cost("broadcast", small, 4, own, algorithm="tree")
    for op in ("scatter", "all_to_all"):
        assert cost(op, small, 4, gloo).rounds == 1 < cost(op, small, 4, nccl).rounds == 3
        assert cost(op, small, 4, gloo).time_s == pytest.approx(
            cost(op, small, 4, nccl).time_s - 2 * 5e-5)


def test_hierarchical_is_reduce_leaders_broadcast():
    intra = Link(alpha_s=1e-6, beta_s_per_byte=1 / 300e9)
    inter = Link(alpha_s=5e-6, beta_s_per_byte=1 / 25e9)
    h = cost("all_reduce", N, 32, inter, algorithm="hierarchical", intra=intra, local_size=8)

    def fastest(op, p, link):
        return min(cost(op, N, p, link, algorithm=a).time_s for a in supported(op, p)
                   if a not in ("native",))
    expected = (fastest("reduce", 8, intra) + fastest("all_reduce", 4, inter)
                + fastest("broadcast", 8, intra))
    assert h.time_s == pytest.approx(expected)
    # Leaders cross the slow tier with n bytes; a flat ring sends 2(p-1)/p n across it.
    flat = cost("all_reduce", N, 32, inter, algorithm="ring")
    assert h.time_s < flat.time_s


def test_auto_chooses_the_grids_where_they_pay():
    """Same bytes as one ring, fewer rounds: the 3D torus wins large all-reduces on 8 ranks
    in nodes of 2 (2 x 2 x 2: 6 rounds against the ring's 14); with 8 nodes of 8 at 1 MiB,
    ring_tree's tree across nodes (2 lg 8 rounds on the slow tier) wins."""
    intra = Link(alpha_s=1e-6, beta_s_per_byte=1 / 300e9, gamma_s_per_byte=1e-11)
    inter = Link(alpha_s=2e-5, beta_s_per_byte=1 / 25e9, gamma_s_per_byte=1e-11)
    assert best_algorithm("all_reduce", 2**28, 8, inter, intra=intra, local_size=2) == "torus3d"
    assert best_algorithm("all_reduce", 2**20, 64, inter, intra=intra, local_size=8) == \
        "ring_tree"
    t3 = cost("all_reduce", N, 8, inter, algorithm="torus3d", intra=intra, local_size=2)
    assert t3.rounds == 6 and t3.sent_bytes == pytest.approx(2 * 7 / 8 * N)
    mesh = cost("all_reduce", N, 8, inter, algorithm="mesh2d", intra=intra, local_size=2)
    # rows of 2 (a line of 2 sends n), columns of 4 (an interior member sends 2n)
    assert mesh.rounds == 2 + 6 and mesh.sent_bytes == pytest.approx(3 * N)


def test_torus2d_rows_inside_columns_across():
    intra = Link(alpha_s=0, beta_s_per_byte=1 / 300e9)
    inter = Link(alpha_s=0, beta_s_per_byte=1 / 25e9)
    assert torus_grid(32, 8) == (4, 8) and torus_grid(12) == (3, 4) and torus_grid(7) == (1, 7)
    t = cost("all_reduce", N, 32, inter, algorithm="torus2d", intra=intra, local_size=8)
    rows = 2 * 7 / 8 * N / 300e9
    cols = 2 * 3 / 4 * (N / 8) / 25e9
    assert t.time_s == pytest.approx(rows + cols)
    assert t.sent_bytes == pytest.approx(2 * 7 / 8 * N + 2 * 3 / 4 * N / 8)


def test_bus_bandwidth_nccl_tests_convention():
    assert bus_bandwidth("all_reduce", 1e9, 8, 1.0) == pytest.approx(1.75e9)
    assert bus_bandwidth("all_gather", 1e9, 8, 1.0) == pytest.approx(0.875e9)
    assert bus_bandwidth("broadcast", 1e9, 8, 1.0) == pytest.approx(1e9)
