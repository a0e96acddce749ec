"""KV-cache migration between serving instances.

    from vllm_ext.migration import MigrationEndpoint
    ep = MigrationEndpoint(cache, backend="nccl")          # "ipc", "nccl", "gloo", "rayrpc"
    desc = ep.descriptor()                                  # picklable; give it to peers
    stats = ep.pull(peer_desc, src_block_ids, dst_block_ids, timeout=10.0)

The destination drives: it asks the peer for `src_block_ids` and writes them into its own
`dst_block_ids`. Every control connection authenticates first (auth.py says which secret).
Backends live one per file beside base.py and are imported only when asked for by name, so
importing this package loads neither ray nor NCCL.
"""

from ..errors import ClosedError, MigrationError
from .base import MigrationBackend, PeerDescriptor, PullStats
from .control import TlsOptions
from .endpoint import MigrationEndpoint
from .registry import BACKEND_NAMES, available_backends, get_backend_class

__all__ = [
    "MigrationEndpoint",
    "MigrationError",
    "ClosedError",
    "PeerDescriptor",
    "PullStats",
    "TlsOptions",
    "MigrationBackend",
    "BACKEND_NAMES",
    "available_backends",
    "get_backend_class",
]
