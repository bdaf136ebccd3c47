"""Every byte goes through here: a Communicator per process group, the algorithms it runs,
the ledger that records each call, and gradient compression. The cost model `auto` prices
with lives in shardtrain.cost (torch-free, shared with the planner).
"""

from shardtrain.comm.communicator import Communicator
from shardtrain.comm.lane import Handle
from shardtrain.comm.ledger import CommLedger, CommRecord
from shardtrain.comm.p2p import CommError

__all__ = ["CommError", "CommLedger", "CommRecord", "Communicator", "Handle"]
