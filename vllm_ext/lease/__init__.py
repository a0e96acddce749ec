"""The contract between serving instances and the fronts before them: the lease channel (its
messages, their version, a server and a client) and the `kv_transfer_params` a request carries
from a producer to a consumer. It imports no torch, vllm or aiohttp: the connector serves it
inside vLLM, and the router and the P/D proxy speak it without loading either.

    from vllm_ext.lease import LeaseClient, RemoteKV
"""

from .channel import ChannelError, ChannelRefused, LeaseClient, LeaseServer, MigrationLease
from .kv_params import PROTOCOL as PARAMS_VERSION
from .kv_params import ParamsError, RemoteKV, prompt_hash
from .messages import LEASE_PROTOCOL, RequestEnded

__all__ = ["ChannelError", "ChannelRefused", "LEASE_PROTOCOL", "LeaseClient", "LeaseServer", "MigrationLease",
           "PARAMS_VERSION", "ParamsError", "RemoteKV", "RequestEnded", "prompt_hash"]
