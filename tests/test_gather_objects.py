"""parallel/pipeline/state.py `all_gather_objects` (full state dicts over the pipeline,
checkpoint plans): a peer's tensors come back on this rank's device, not on the device the
peer saved them from. On a GPU each rank's tensors live on its own GPU; loaded as saved,
rank 0 would open a context on rank 1's GPU, or fail where only its own GPU is visible.

A CPU shows it through torch.serialization's device registry: a storage tagged as living on
"elsewhere:1" (another rank's GPU) restores there only if loading keeps saved locations,
which this test's deserializer refuses.
"""

from __future__ import annotations

import pytest
import torch
from torch import serialization

from shardtrain.parallel.pipeline.state import all_gather_objects

ELSEWHERE = "elsewhere:1"


class _TwoRanks:
    """The communicator API all_gather_objects uses, for two ranks that hold the same
    object: every rank's slot of an all-gather receives this rank's bytes."""

    size, device = 2, torch.device("cpu")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = "") -> None:
        output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))


@pytest.fixture
def peer_tensor():
    """A tensor whose storage serialises as living on another rank's device."""
    tensor = torch.arange(6.0).view(2, 3)
    ptr = tensor.untyped_storage().data_ptr()

    def tag(obj):
        return ELSEWHERE if hasattr(obj, "data_ptr") and obj.data_ptr() == ptr else None

    def restore(obj, location: str):
        if location == ELSEWHERE:
            raise RuntimeError(f"restored onto {location}: another rank's device")
        return None

    serialization.register_package(1, tag, restore)
    yield tensor
    serialization._package_registry[:] = [entry for entry in serialization._package_registry
                                          if entry[1] is not tag]


def test_peers_tensors_land_on_this_ranks_device(peer_tensor):
    parts = all_gather_objects(_TwoRanks(), {"w": peer_tensor, "step": 3})
    assert len(parts) == 2
    for part in parts:
        assert part["step"] == 3 and part["w"].device == torch.device("cpu")
        torch.testing.assert_close(part["w"], peer_tensor)
