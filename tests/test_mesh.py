"""ParallelMesh: rank <-> coordinates, groups per dim, node topology; the native
communicator's collectives and ledger volumes; world size 1 as no-ops."""

import itertools

import pytest
import torch

from dist import run_distributed
from shardtrain.comm import CommLedger, Communicator, build_mesh
from shardtrain.comm.ledger import CommRecord
from shardtrain.config import ConfigError
from shardtrain.mesh import MeshShape

SHAPES = [MeshShape(pp=2, dp=2, cp=1, tp=2), MeshShape(pp=1, dp=4, cp=2, tp=1, ep=4),
          MeshShape(pp=2, dp=3, cp=2, tp=2, ep=2), MeshShape(pp=4), MeshShape(dp=6, ep=3)]


@pytest.mark.parametrize("shape", SHAPES, ids=repr)
def test_coordinates_are_a_bijection(shape):
    seen = set()
    for r in range(shape.world_size):
        c = shape.coords(r)
        assert shape.rank_of(pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=c["tp"]) == r
        seen.add((c["pp"], c["dp"], c["cp"], c["tp"]))
    assert len(seen) == shape.world_size


@pytest.mark.parametrize("shape", SHAPES, ids=repr)
def test_groups_partition_the_world_with_the_right_sizes(shape):
    sizes = {"pp": shape.pp, "dp": shape.dp, "cp": shape.cp, "tp": shape.tp,
             "dp_cp": shape.dp * shape.cp, "ep": shape.ep, "edp": shape.dp * shape.cp // shape.ep}
    for dim, size in sizes.items():
        groups = shape.groups(dim)
        assert sorted(itertools.chain(*groups)) == list(range(shape.world_size)), dim
        assert all(len(g) == size for g in groups), (dim, groups)
        varying = {"dp_cp": ("dp", "cp")}.get(dim, (dim,))
        for g in groups:  # members differ only in the dim's own coordinates
            coords = [shape.coords(r) for r in g]
            for key in ("pp", "tp") if dim in ("dp_cp", "ep", "edp") else \
                    tuple(k for k in ("pp", "dp", "cp", "tp") if k not in varying):
                assert len({c[key] for c in coords}) == 1, (dim, key, g)


def test_tp_is_innermost_and_pp_outermost():
    shape = MeshShape(pp=2, dp=2, tp=4)
    assert shape.groups("tp")[0] == [0, 1, 2, 3]  # consecutive ranks: inside one node
    assert shape.groups("pp")[0] == [0, 8]
    assert shape.groups("dp")[0] == [0, 4]


@pytest.mark.parametrize("shape, world, node, needle", [
    (MeshShape(dp=3), 4, 4, "does not equal the world size 4"),
    (MeshShape(dp=4, ep=3), 4, 4, "parallel.ep=3 must divide dp x cp = 4"),
    (MeshShape(dp=4), 4, 3, "node size 3 must be >= 1 and divide the world size 4"),
    (MeshShape(dp=0), 0, 1, "parallel.dp=0 must be >= 1"),
])
def test_invalid_shapes_are_named(shape, world, node, needle):
    with pytest.raises(ConfigError) as e:
        shape.validate(world, node)
    assert needle in str(e.value)


def test_world_size_one_is_not_a_special_case():
    mesh = build_mesh(MeshShape())
    comm = mesh.comm("dp")
    t = torch.arange(5.0)
    comm.all_reduce(t, "avg").wait()
    out = torch.empty(5)
    comm.all_gather(out, t)
    comm.reduce_scatter(out, t)
    comm.broadcast(t)
    assert torch.equal(t, torch.arange(5.0)) and torch.equal(out, t)
    assert mesh.ledger.records == []


def _mesh_collectives(rank: int, world: int) -> dict:
    mesh = build_mesh(MeshShape(dp=2, tp=2), rank=rank, node_size=2)
    out = {"coords": mesh.coords, "node": mesh.node_of(rank)}
    for dim in ("tp", "dp"):
        comm = mesh.comm(dim)
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, "sum")
        out[f"{dim}_sum"] = t.item()
    comm = mesh.comm("dp")  # sizes 2: ring volumes per rank
    big = torch.ones(1000)
    comm.all_reduce(big, "avg", tag="x")
    gathered = torch.empty(2000)
    comm.all_gather(gathered, big)
    shard = torch.empty(500)
    comm.reduce_scatter(shard, big, "max")
    out["records"] = [(r.op, r.group, r.sent_bytes, r.recv_bytes) for r in mesh.ledger.records]
    # Sub-groups come from the mesh too: the node-local part of a dim's group.
    out["node_parts"] = {dim: mesh.node_group(dim).ranks for dim in ("dp", "tp")}
    out["meta"] = all(mesh.comm(d).meta is mesh.comm(d).group for d in ("dp", "tp"))  # Gloo
    out["values"] = (big[0].item(), gathered.sum().item(), shard[0].item())
    return out


def test_mesh_groups_and_native_ledger_on_four_ranks():
    results = run_distributed(_mesh_collectives, 4)
    for rank, r in enumerate(results):
        tp_peers = [q for q in range(4) if q // 2 == rank // 2]
        dp_peers = [q for q in range(4) if q % 2 == rank % 2]
        assert r["tp_sum"] == sum(tp_peers) and r["dp_sum"] == sum(dp_peers)
        assert r["node"] == rank // 2
        assert r["values"] == (1.0, 2000.0, 1.0)
        assert r["node_parts"] == {"dp": [rank], "tp": tp_peers} and r["meta"]
        # p = 2: all-reduce 2(p-1)/p S = S; all-gather and reduce-scatter (p-1)/p S.
        assert r["records"][-3:] == [("all_reduce", "dp", 4000, 4000),
                                     ("all_gather", "dp", 4000, 4000),
                                     ("reduce_scatter", "dp", 2000, 2000)]


def test_communicator_rejects_unknown_algorithm():
    with pytest.raises(ValueError, match="comm.algorithm='warp' is not one of"):
        Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), algorithm="warp")


def test_the_ledger_stays_bounded_over_a_long_run_and_keeps_the_open_interval():
    ledger = CommLedger(keep=10)
    record = CommRecord(op="all_reduce", group="dp", algorithm="native", dtype="float32",
                        numel=1, msg_bytes=4, sent_bytes=4, recv_bytes=4, rounds=1)
    for _ in range(1000):  # steps of 3 calls
        for _ in range(3):
            ledger.add(record)
        assert ledger.totals(ledger.mark())["calls"] == 3
    assert len(ledger.records) < 20
    for _ in range(50):  # one interval longer than `keep`: nothing of it is dropped
        ledger.add(record)
    assert ledger.totals(ledger.mark())["calls"] == 50


def test_mesh_imports_nothing_of_comm_and_comm_nothing_above_it():
    """The arrows mesh <- comm <- parallel: mesh builds groups, comm builds communicators
    from them (CommFactory), and comm knows nothing of plan, parallel or train."""
    import ast
    from pathlib import Path

    import shardtrain

    root = Path(shardtrain.__file__).parent
    rules = [(root / "mesh.py", ("shardtrain.comm",))]
    rules += [(f, ("shardtrain.plan", "shardtrain.parallel", "shardtrain.train"))
              for f in sorted((root / "comm").rglob("*.py"))]
    for file, banned in rules:
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.startswith(banned)], (file.name, names)
