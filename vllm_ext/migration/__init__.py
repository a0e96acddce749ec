"""KV-cache migration between serving instances.

    from vllm_ext.migration import MigrationEndpoint
    ep = MigrationEndpoint(cache, backend="nccl")          # "ipc", "nccl", "gloo", "rayrpc"
    desc = ep.descriptor()                                  # picklable; give it to peers
    stats = ep.pull(peer_desc, src_block_ids, dst_block_ids, timeout=10.0)

The destination drives: it asks the peer for `src_block_ids` and writes them into its own
`dst_block_ids`. Every control connection authenticates first (auth.py says which secret).
Backends live one per file beside base.py and are imported only when asked for by name, so
importing this package loads neither ray nor NCCL; and the names below load on first use, so a
module of the transport's contract (protocol, control, auth, timing), imported by the lease
channel and the fronts, brings no endpoint with it.
"""

import importlib

from ..errors import ClosedError, MigrationError

_LAZY = {"MigrationBackend": "base", "PeerDescriptor": "base", "PullStats": "base", "TlsOptions": "control",
         "MigrationEndpoint": "endpoint", "BACKEND_NAMES": "registry", "available_backends": "registry",
         "get_backend_class": "registry"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value

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
