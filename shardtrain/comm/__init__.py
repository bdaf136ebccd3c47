"""Every byte goes through here: a Communicator per process group, and the ledger."""

from shardtrain.comm.communicator import Communicator, Handle
from shardtrain.comm.ledger import CommLedger, CommRecord

__all__ = ["CommLedger", "CommRecord", "Communicator", "Handle"]
