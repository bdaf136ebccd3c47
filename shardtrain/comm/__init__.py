"""Every byte goes through here: a Communicator per process group, and the ledger.

The names are imported lazily so that `shardtrain.comm.cost` (pure arithmetic, shared with
the planner) can be imported without loading torch.
"""

import importlib

_EXPORTS = {"Communicator": "communicator", "Handle": "communicator",
            "CommLedger": "ledger", "CommRecord": "ledger"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"shardtrain.comm.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shardtrain.comm' has no attribute {name!r}")
