"""Every layout the planner can propose, the parameter server's included, creates its process
groups with the same NCCL communicator splits on every rank (tests/nccl_splits.py models
torch's group creation with the device bound at init_process_group, as launch.py binds it).
Before mesh.py made each CUDA group one `cpu:gloo,cuda:nccl` group, a parameter server made
two world splits per mesh group against its workers' one, and the job hung at start."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from nccl_splits import problems, splits
from shardtrain.comm import build_mesh
from shardtrain.config import ModelConfig
from shardtrain.cost.hardware import runtime_link
from shardtrain.mesh import MeshShape
from shardtrain.parallel.ps.groups import ps_comms
from shardtrain.parallel.zero.zeropp import inter_node_comm, node_comm, spans_nodes
from shardtrain.plan.search import candidates

LINK = runtime_link("cuda", gpu_name="H100")
GPUS, NODE = 8, 4


def _build(shape: MeshShape, *, node_size: int, servers: int = 0, hpz: bool = False):
    """One rank's group creation in run_worker's order: the mesh, then ZeRO++'s node groups
    (parallelize, parallel.zero_hpz with zero_quantized_gradients: zeropp.build_unit_comm) or the parameter server's groups (ps_comms)."""
    def build(rank: int) -> None:
        mesh = build_mesh(shape, rank=rank, node_size=node_size, device=torch.device("cuda", 0),
                          link=LINK)
        if hpz:  # with qgZ too: its inter-node groups when the replica group spans nodes
            node_comm(mesh, mesh.replica_dim)
            if spans_nodes(mesh, mesh.replica_dim):
                inter_node_comm(mesh, mesh.replica_dim)
        if servers:
            ps_comms(rank, shape.world_size + servers, servers, mesh.ledger)
    return build


@functools.cache
def _planned_shapes() -> set[tuple[MeshShape, bool]]:
    """The mesh shapes (and whether ZeRO-3's hpZ node groups apply) of every layout the
    search proposes on 8 GPUs in nodes of 4, dense and mixture-of-experts, short sequences
    and the long ones that bring context parallelism."""
    found = set()
    for experts in (0, 8):
        model = ModelConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                            max_seq_len=8192, n_experts=experts)
        for seq_len in (256, 8192):
            for lay in candidates(model, gpus=GPUS, node_size=NODE, global_batch=16,
                                  seq_len=seq_len, precision="bf16"):
                shape = MeshShape(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep)
                found.add((shape, lay.zero == 3 and lay.pp == 1))
    return found


def test_the_search_proposes_every_parallelism_this_test_covers():
    shapes = _planned_shapes()
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        assert any(getattr(s, dim) > 1 for s, _ in shapes), dim
    assert any(hpz for _, hpz in shapes)


def test_every_planned_layout_splits_alike_on_every_rank():
    failed = []
    for shape, zero3 in sorted(_planned_shapes(), key=repr):
        for hpz in (False, True) if zero3 else (False,):
            calls = splits(GPUS, _build(shape, node_size=NODE, hpz=hpz))
            failed += [f"{shape} hpz={hpz}: {p}" for p in problems(calls)]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("workers, servers", [(w, s) for w in range(1, 8)
                                              for s in range(1, 9 - w)])
def test_parameter_server_layouts_split_alike_on_every_rank(workers, servers):
    """Servers sit outside every mesh group (launch.run_worker: node size = gcd of the
    node's ranks and the workers)."""
    world = workers + servers
    calls = splits(world, _build(MeshShape(dp=workers), node_size=math.gcd(NODE, workers),
                                 servers=servers))
    assert not problems(calls), problems(calls)


@pytest.mark.parametrize("shape", [MeshShape(rep=2, dp=2, tp=2), MeshShape(rep=2, pp=2, dp=2),
                                   MeshShape(rep=4, dp=2), MeshShape(rep=2, dp=2, ep=2)])
def test_replica_group_layouts_split_alike_on_every_rank(shape):
    """parallel.replicas: the rep groups (outermost) on top of the group's own."""
    assert not problems(splits(GPUS, _build(shape, node_size=NODE)))


def test_the_model_finds_the_hang_of_gloo_only_groups():
    """A Gloo group beside each NCCL group (the mesh before): the server's count differs."""
    import torch.distributed as dist

    def build(rank: int) -> None:
        for ranks in ([0, 1], [0, 1]):
            dist.new_group(ranks)
            dist.new_group(ranks, backend="gloo")

    assert problems(splits(3, build)) == [
        "ranks make different numbers of world splits: [2, 2, 4] (rank: count "
        "{0: 2, 1: 2, 2: 4}); the ranks with fewer leave the others waiting"]


def test_mesh_communicators_on_cuda_stream_their_payload_over_nccl():
    """One group, two backends: the communicator reads its device's (NCCL: stream waits, no
    lane thread) and sends metadata to the same group (its Gloo backend)."""
    meshes = []
    splits(4, lambda rank: meshes.append(build_mesh(MeshShape(dp=2, tp=2), rank=rank,
                                                    device=torch.device("cuda", 0), link=LINK)))
    comms = [mesh.comm(dim) for mesh in meshes for dim in ("dp", "tp")]
    assert all(c.streamed and c.meta is c.group for c in comms)
