"""Collective algorithms on point-to-point messages, by name and op.

`IMPLEMENTATIONS[name][op]` is the function; `serves(name, op)` says whether it exists.
The set matches what the cost model prices (`cost.supported`), so `auto` never picks an
algorithm the runtime lacks. `native` (the backend's own) is not here: the communicator
calls torch.distributed for it.
"""

from __future__ import annotations

from collections.abc import Callable

from shardtrain.comm.algorithms import hierarchical, mesh, torus
from shardtrain.comm.algorithms.flat import FLAT

IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {
    **FLAT,
    "hierarchical": {"all_reduce": hierarchical.all_reduce},
    "torus2d": torus.ops("torus2d"),
    "mesh2d": {"all_reduce": mesh.all_reduce},
    "torus3d": torus.ops("torus3d"),
    "ring_tree": {"all_reduce": hierarchical.ring_tree},
}


def serves(name: str, op: str) -> bool:
    return op in IMPLEMENTATIONS.get(name, {})
