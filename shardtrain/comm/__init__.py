"""Every byte goes through here: a Communicator per process group, the algorithms it runs,
the ledger that records each call, gradient compression, and the shared cost model.

The names are imported lazily so that `shardtrain.comm.cost` (pure arithmetic, shared with
the planner) imports without loading torch.
"""

import importlib

_EXPORTS = {"Communicator": "communicator", "Handle": "lane", "CommLedger": "ledger",
            "CommRecord": "ledger", "CommError": "p2p"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"shardtrain.comm.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shardtrain.comm' has no attribute {name!r}")
