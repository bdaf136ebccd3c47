"""ZeRO++ (Wang et al. 2023): ZeRO's parameter all-gathers and gradient reduce-scatters with
less traffic, and less of it between nodes.

- qwZ, `parallel.zero_quantized_weights`: each rank quantizes its parameter shard to int8
  in blocks of `comm.quant_block` values with one fp32 scale each (comm/compress.py), the
  ranks all-gather the int8 bytes and scales, and every rank dequantizes the same bytes,
  so every rank computes with the same (quantized) weights. A shard of n values costs
  n + 4n/block bytes on the wire instead of 2n (bf16) or 4n (fp32). Only the all-gather's
  copy is quantized: the fp32 master shards and the optimizer never see int8.
- hpZ, `parallel.zero_hpz`: ZeRO-3 gathers each unit twice per step, before its forward and
  again before its backward. After the forward all-gather over the whole dp group, each
  rank keeps a secondary shard, its 1/s of the gathered unit (s = the dp ranks on its node);
  the backward all-gather then runs over the node's ranks only, so it never crosses the
  inter-node network. The price is the secondary shards' memory (full parameters / s per
  rank), and the weights used in backward are exactly those of the forward.
- qgZ, `parallel.zero_quantized_gradients`: int8 values cannot be summed on the wire, so
  the reduce-scatter becomes an all-to-all: each rank quantizes the chunk destined for each
  peer, the all-to-all delivers them, and each rank dequantizes its p chunks and reduces
  them in fp32 (one quantization per gradient, versus one per ring hop if a quantized ring
  reduced as it went). When the dp group spans nodes with several of its ranks on each
  (1 < s < p ranks per node), the reduce-scatter takes the paper's hierarchical path
  (Wang et al. 2023, sec. 4.3; seed 004), `hierarchical_reduce_scatter`: an int8
  all-to-all inside the node first, which leaves each rank its node's partial sums of the
  chunks bound for the ranks at its place on every node, then those partials re-quantized
  and all-to-all'd across nodes among the ranks at the same place. Each rank sends the
  one-hop form's bytes in all, but only N - 1 of its p - 1 packed chunks cross the
  inter-node network (N = p / s nodes) instead of p - s: s times fewer. The price is a
  second quantization, of the node partial sums.

`ZeroPlusPlusComm` is the UnitComm (units.py) that ZeRO's units then call: it picks
the exact or quantized collective, and the node-local one for hpZ's backward gathers.
"""

from __future__ import annotations


import torch

from shardtrain.comm import Communicator, Handle
from shardtrain.comm.compress import pack_int8, unpack_int8
from shardtrain.config import ParallelConfig
from shardtrain.cost.units import backward_reads_params
from shardtrain.mesh import ParallelMesh
from shardtrain.parallel.zero.units import FlatUnit, UnitComm, on_wire


def quantized_all_gather(comm: Communicator, output: torch.Tensor, shard: torch.Tensor, *,
                         block: int, tag: str = "param", async_op: bool = False) -> Handle:
    """qwZ: output [p * n] <- every rank's shard [n], sent as int8 blocks plus fp32 scales.
    Every rank (this one too) gets the dequantized values, so all ranks agree bit for bit."""
    n, p = shard.numel(), comm.size
    blocks = -(-n // block)

    def job() -> None:
        rows = torch.zeros(1, blocks * block, dtype=torch.float32, device=shard.device)
        rows[0, :n] = shard.reshape(-1)  # [1, blocks x block], zero padded
        gathered = torch.empty(p, blocks * block + 4 * blocks, dtype=torch.uint8,
                               device=shard.device)
        comm.all_gather(gathered, pack_int8(rows, block), tag=f"{tag}:int8")
        output.view(p, n).copy_(unpack_int8(gathered, blocks, block)[:, :n])  # [p, n]

    return comm.composite(job, async_op=async_op)


def quantized_reduce_scatter(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
                             op: str = "avg", *, block: int, tag: str = "grad",
                             async_op: bool = False) -> Handle:
    """qgZ: output [n] <- chunk `rank` of the sum (or average) over ranks of input [p * n],
    each chunk quantized once by its sender and reduced in fp32 by its receiver."""
    if op not in ("sum", "avg"):
        raise ValueError(f"quantized reduce-scatter sums gradients; op {op!r} is not supported")
    n, p = output.numel(), comm.size
    blocks = -(-n // block)

    def job() -> None:
        chunks = torch.zeros(p, blocks * block, dtype=torch.float32, device=input.device)
        chunks[:, :n] = input.view(p, n)  # [p, blocks x block]: row j goes to rank j
        received = torch.empty(p, blocks * block + 4 * blocks, dtype=torch.uint8,
                               device=input.device)
        comm.all_to_all(received, pack_int8(chunks, block), tag=f"{tag}:int8")
        total = unpack_int8(received, blocks, block).sum(0)[:n]  # [n] fp32: row i from rank i
        output.view(-1).copy_(total.div_(p) if op == "avg" else total)

    return comm.composite(job, async_op=async_op)


def hierarchical_reduce_scatter(node: Communicator, inter: Communicator, output: torch.Tensor,
                                input: torch.Tensor, op: str = "avg", *, block: int,
                                tag: str = "grad", async_op: bool = False) -> Handle:
    """qgZ across nodes: output [n] <- chunk `rank` of the sum (or average) over the p =
    s x N ranks of input [p * n], dp rank d = k s + j living on node k at place j (`node`:
    the s ranks of this node, `inter`: the N ranks at this rank's place, one per node).
    Hop 1 quantizes each value once and reduces the node's s copies in fp32; hop 2
    quantizes those partial sums once more and reduces the N of them in fp32."""
    if op not in ("sum", "avg"):
        raise ValueError(f"quantized reduce-scatter sums gradients; op {op!r} is not supported")
    s, nodes, n = node.size, inter.size, output.numel()
    blocks = -(-n // block)
    width = blocks * block  # one chunk, padded to whole blocks

    def job() -> None:
        # hop 1: row j' holds the N chunks bound for place j' on every node
        chunks = torch.zeros(s, nodes, width, dtype=torch.float32, device=input.device)
        chunks[:, :, :n] = input.view(nodes, s, n).transpose(0, 1)  # [s, N, n]
        packed = pack_int8(chunks.view(s, nodes * width), block)  # [s, N (width + 4 blocks)]
        received = torch.empty_like(packed)
        node.all_to_all(received, packed, tag=f"{tag}:int8")
        partial = unpack_int8(received, nodes * blocks, block).sum(0)  # [N x width] fp32
        # hop 2: node k's partial sum of this place's chunk goes to node k's rank here
        packed = pack_int8(partial.view(nodes, width), block)  # [N, width + 4 blocks]
        received = torch.empty_like(packed)
        inter.all_to_all(received, packed, tag=f"{tag}:int8")
        total = unpack_int8(received, blocks, block).sum(0)[:n]  # [n] fp32
        output.view(-1).copy_(total.div_(s * nodes) if op == "avg" else total)

    return node.composite(job, async_op=async_op)


def node_places(mesh: ParallelMesh, dim: str) -> dict[int, int] | None:
    """Global rank -> its place among its `dim` group's ranks on its node (0..s-1), when
    every group has s ranks on each of its nodes and its ranks run node by node (dp rank
    k s + j on the group's k-th node; true of the mesh's sorted groups); else None."""
    places: dict[int, int] = {}
    sizes = set()
    for ranks in mesh.shape.groups(dim):
        count: dict[int, int] = {}
        for r in ranks:
            places[r] = count.get(mesh.node_of(r), 0)
            count[mesh.node_of(r)] = places[r] + 1
        sizes |= set(count.values())
    return places if len(sizes) == 1 else None


def spans_nodes(mesh: ParallelMesh, dim: str) -> bool:
    """Whether qgZ takes its hierarchical path over `dim`: the group's ranks sit on several
    nodes, more than one on each (1 < s < p), evenly."""
    places = node_places(mesh, dim)
    size = mesh.comm(dim).size
    local = 1 + max(places.values()) if places else 1
    return places is not None and 1 < local < size


def inter_node_comm(mesh: ParallelMesh, dim: str = "dp") -> Communicator:
    """The ranks of this rank's `dim` group at its place on every node ("<dim>_inter"), one
    per node, in node order. Collective, like node_comm."""
    places = node_places(mesh, dim)
    return mesh.communicator(mesh.sub_group(dim, places.__getitem__, f"{dim}_inter"))


def node_comm(mesh: ParallelMesh, dim: str = "dp") -> Communicator:
    """The ranks of this rank's `dim` group that share its node, as a Communicator named
    "<dim>_node" on the mesh's ledger. Collective: every rank calls it at the same point,
    and creates every such group in the same order (torch.distributed's rule), as the mesh
    does for its own groups. The node groups must all be the same size."""
    return mesh.communicator(mesh.node_group(dim))


class ZeroPlusPlusComm(UnitComm):
    """ZeRO's unit all-gathers and gradient reduce-scatters (zero_units.UnitComm) with the
    ZeRO++ options: `quantize_weights` (qwZ), `node` (hpZ: the group's ranks on this node,
    see node_comm) and `quantize_gradients` (qgZ); `block` values per int8 scale. `inter`
    (inter_node_comm; with `grad_node`, this node's ranks): qgZ's hierarchical path."""

    def __init__(self, comm: Communicator, *, quantize_weights: bool = False,
                 quantize_gradients: bool = False, node: Communicator | None = None,
                 block: int = 256, grad_scale: float = 1.0,
                 grad_node: Communicator | None = None, inter: Communicator | None = None):
        super().__init__(comm, grad_scale=grad_scale)
        self.node, self.block = node, block
        self.grad_node, self.inter = grad_node, inter
        self.quantize_weights, self.quantize_gradients = quantize_weights, quantize_gradients
        self.secondary: dict[FlatUnit, torch.Tensor] = {}  # hpZ: this rank's node shard

    def gather_params(self, unit: FlatUnit, full: torch.Tensor, shard: torch.Tensor, *,
                      phase: str, async_op: bool = True) -> Handle:
        """full [padded] <- every rank's shard. With hpZ a backward gather runs inside the
        node, from the secondary shard that the unit's last forward gather kept (none for a
        unit not gathered for backward: cost/units.py `backward_reads_params`)."""
        if phase == "backward" and self.node is not None:
            return self.node.all_gather(full, self.secondary[unit], tag="param:hpz",
                                        async_op=async_op)

        def job() -> None:
            if self.quantize_weights:  # from the fp32 shard: int8 on the wire either way
                quantized_all_gather(self.comm, full, shard, block=self.block)
            else:
                self.comm.all_gather(full, on_wire(shard, full), tag="param")
            if self.node is not None and phase == "forward" \
                    and backward_reads_params(unit.key):
                # [s, padded / s]: row i is node member i's part
                self.secondary[unit] = full.view(self.node.size, -1)[self.node.rank].clone()

        return self.comm.composite(job, async_op=async_op)

    def reduce_grads(self, shard: torch.Tensor, full: torch.Tensor, *,
                     async_op: bool = True) -> Handle:
        """shard [n] <- this rank's chunk of the dp average of full [dp * n]."""
        if self.quantize_gradients and self.inter is not None:
            return hierarchical_reduce_scatter(self.grad_node, self.inter, shard, full, "avg",
                                               block=self.block, async_op=async_op)
        if self.quantize_gradients:
            return quantized_reduce_scatter(self.comm, shard, full, "avg", block=self.block,
                                            async_op=async_op)
        return super().reduce_grads(shard, full, async_op=async_op)

    @property
    def held_param_bytes(self) -> int:
        """hpZ's secondary shards: full parameters / (dp ranks per node) of the units gathered
        for backward, once every unit has been through a forward."""
        return sum(t.numel() * t.element_size() for t in self.secondary.values())


def build_unit_comm(mesh: ParallelMesh, parallel: ParallelConfig, *, block: int,
                    dim: str | None = None, grad_scale: float = 1.0) -> UnitComm:
    """The UnitComm over the mesh's `dim` group (default: the replica group) the config
    asks for: ZeRO++'s when any of its options is on (hpZ's node groups are those of
    `dim`; qgZ's hierarchical path when the group spans nodes). Collective with hpZ or a
    hierarchical qgZ (creates the node groups)."""
    dim = dim or mesh.replica_dim
    comm = mesh.comm(dim)
    if not (parallel.zero_quantized_weights or parallel.zero_hpz
            or parallel.zero_quantized_gradients):
        return UnitComm(comm, grad_scale=grad_scale)
    two_hop = parallel.zero_quantized_gradients and spans_nodes(mesh, dim)
    node = node_comm(mesh, dim) if parallel.zero_hpz or two_hop else None
    return ZeroPlusPlusComm(comm, quantize_weights=parallel.zero_quantized_weights,
                            quantize_gradients=parallel.zero_quantized_gradients,
                            node=node if parallel.zero_hpz else None, block=block,
                            grad_scale=grad_scale, grad_node=node if two_hop else None,
                            inter=inter_node_comm(mesh, dim) if two_hop else None)
