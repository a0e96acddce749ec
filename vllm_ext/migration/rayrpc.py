"""rayrpc: the instance runs as a Ray actor; blocks cross Ray's object store as raw bytes.

The source endpoint must be created inside a Ray actor (its handle goes into the descriptor).
The destination calls the source actor once per chunk through Ray's `__ray_call__` (no
method to add to the instance class): the source gathers the chunk's blocks into a uint8
array, Ray stores it in shared memory, and the destination maps it (zero-copy on one node)
and scatters it into its cache. The bytes are the cache's own: no dtype conversion (Llumnix
converts bf16 to fp32 for numpy and doubles the bytes). Up to `max_in_flight` chunk requests
are outstanding, so the source gathers chunk c+1 while the destination scatters chunk c.

The instance actor needs max_concurrency >= 2 (or the migration calls wait behind the
engine's long-running methods; two actors pulling from each other would deadlock).

Errors: a source actor that died raises RayActorError, a stalled one misses the deadline of
`ray.get`; both become MigrationError. Ray is optional: `pip install vllm-ext[ray]`.

Options: chunk_bytes (default 64 MiB), max_in_flight (default 2). Each chunk is one Ray call and
one object, each costing milliseconds of Ray's own work on a small host (benchmarks/TUNING.md).
"""

import ctypes
import threading
import warnings
import weakref
from typing import Any, Dict, List

import torch

from .._ids import block_id_list
from ..errors import MigrationError
from .base import MigrationBackend, Pair, PullStats, blocks_per_chunk, chunk_ranges
from .protocol import geometry_mismatch
from .timing import Deadline

DEFAULT_CHUNK_BYTES = 64 << 20

# Backends of this process by endpoint id, for the source-side call (runs in the actor's process).
_BACKENDS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_BACKENDS_LOCK = threading.Lock()


def _serves(actor, endpoint_id: str, geometry: Dict[str, Any]) -> bool:
    """Source side (runs in the source actor via __ray_call__; connect's round trip): True
    when this actor serves endpoint `endpoint_id` with a cache of `geometry`, else
    ValueError."""
    _serving_backend(actor, endpoint_id, geometry)
    return True


def _serving_backend(actor, endpoint_id: str, geometry: Dict[str, Any]):
    """Source side: the backend of endpoint `endpoint_id` of this actor, whose cache has
    `geometry`; ValueError otherwise."""
    del actor
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(endpoint_id)
    if backend is None:
        raise ValueError(f"rayrpc: no endpoint {endpoint_id!r} in this actor (closed?)")
    diff = geometry_mismatch(backend.cache.geometry(), geometry)
    if diff:
        raise ValueError(f"rayrpc: cache geometry differs ({diff})")
    return backend


def _serve_chunk(actor, endpoint_id: str, geometry: Dict[str, Any], src_ids: List[int],
                 chunk: int):
    """Source side (runs in the source actor via __ray_call__): the rows of blocks src_ids
    as a numpy uint8 array [len(src_ids), block_nbytes]."""
    from .. import ops

    backend = _serving_backend(actor, endpoint_id, geometry)
    cache = backend.cache
    ids = block_id_list(src_ids, "src_block_ids", cache.num_blocks, unique=False)
    if backend.context.grants is not None:
        backend.context.grants.check(ids)
    backend.context.faults.pause(chunk)
    if cache.device.type == "cuda":
        rows = ops.gather_blocks(cache, ids)  # on the GPU, then one copy to host
        return rows.cpu().numpy()
    return _slice_views(cache, ids)


def _slice_views(cache, ids: List[int]) -> list:
    """Zero-copy numpy views of a host cache's (block, layer, component) slices, in the wire
    order of gather_blocks. Ray copies each straight into its object store as it stores the
    result (one copy; a gather into a buffer first would be a second)."""
    import numpy as np

    chunk = cache.slice_nbytes
    start, end = cache.extents()[0]  # every layer spans the same bytes
    span = end - start
    layers = [np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(address))
              for address in cache.layer_addresses]
    views = []
    for b in ids:
        for layer in layers:
            for c in range(cache.num_components):
                offset = b * cache.block_stride + c * cache.component_stride
                views.append(layer[offset:offset + chunk])
    return views


def _as_rows(parts, nblocks: int, cache) -> torch.Tensor:
    """The slices of _slice_views, as Ray returned them, as uint8 rows [nblocks, block_nbytes]:
    a view of the object store's memory when Ray laid them out back to back (it does, for
    chunk sizes that are multiples of its alignment), else one copy into a new buffer."""
    chunk = cache.slice_nbytes
    expected = nblocks * cache.num_layers * cache.num_components
    if len(parts) != expected or any(p.dtype.itemsize != 1 or p.nbytes != chunk for p in parts):
        raise MigrationError(f"rayrpc: got {len(parts)} chunks, expected {expected} of {chunk} "
                             "bytes")
    base = parts[0].ctypes.data
    if all(p.ctypes.data == base + i * chunk for i, p in enumerate(parts)):
        import numpy as np

        # A view that spans all chunks, derived from the first: it keeps Ray's buffer alive.
        flat = np.lib.stride_tricks.as_strided(parts[0], shape=(expected * chunk,), strides=(1,),
                                               writeable=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the object store's memory is read-only
            return torch.from_numpy(flat).view(nblocks, cache.block_nbytes)
    rows = torch.empty((nblocks, cache.block_nbytes), dtype=torch.uint8)
    flat = rows.view(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, p in enumerate(parts):
            flat[i * chunk:(i + 1) * chunk].copy_(torch.from_numpy(p))
    return rows


class RayRpcBackend(MigrationBackend):
    name = "rayrpc"
    uses_control_channel = False

    def __init__(self, context, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_in_flight: int = 2):
        super().__init__(context)
        import ray

        if int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes!r}")
        if int(max_in_flight) < 1:
            raise ValueError(f"max_in_flight: must be at least 1, got {max_in_flight!r}")
        self.chunk_bytes = int(chunk_bytes)
        self.max_in_flight = int(max_in_flight)
        if not ray.is_initialized():
            raise RuntimeError("rayrpc: Ray is not initialised in this process (create the "
                               "endpoint inside a Ray actor)")
        try:
            self._actor = ray.get_runtime_context().current_actor
        except Exception as e:  # noqa: BLE001 - Ray raises a plain exception outside actors
            raise RuntimeError(f"rayrpc: the endpoint must be created inside a Ray actor: {e}") \
                from e
        with _BACKENDS_LOCK:
            _BACKENDS[context.endpoint_id] = self

    @classmethod
    def is_available(cls):
        try:
            import ray  # noqa: F401
        except ImportError:
            return False, "ray is not installed (pip install vllm-ext[ray])"
        return True, ""

    def descriptor_extra(self) -> Dict[str, Any]:
        return {"actor": self._actor}

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> Pair:
        """One round trip to the peer's actor: it lives, and serves that endpoint with the same
        geometry (Ray has nothing to build ahead)."""
        actor = _actor_of(link.peer)
        _get(actor.__ray_call__.remote(_serves, link.peer.endpoint_id, self.cache.geometry()), deadline,
             "the connect")
        return _RayPair(self, link.peer, actor)

    def close(self) -> None:
        with _BACKENDS_LOCK:
            _BACKENDS.pop(self.context.endpoint_id, None)


class _RayPair(Pair):
    """Nothing is built: the peer's actor handle, and the calls of one pull."""

    def __init__(self, backend: RayRpcBackend, peer, actor):
        self.backend = backend
        self.peer = peer
        self.actor = actor

    def pull(self, src_ids, dst_ids, deadline: Deadline) -> PullStats:
        import ray

        from .. import ops

        actor, backend = self.actor, self.backend
        cache = backend.cache
        geometry = cache.geometry()
        n = len(src_ids)
        chunks = chunk_ranges(n, blocks_per_chunk(backend.chunk_bytes, cache.block_nbytes))
        refs: Dict[int, Any] = {}

        def submit(c: int) -> None:
            lo, hi = chunks[c]
            refs[c] = actor.__ray_call__.remote(_serve_chunk, self.peer.endpoint_id, geometry, src_ids[lo:hi], c)

        for c in range(min(backend.max_in_flight, len(chunks))):
            submit(c)
        try:
            for c, (lo, hi) in enumerate(chunks):
                rows = _get(refs.pop(c), deadline, f"chunk {c}")
                if c + backend.max_in_flight < len(chunks):
                    submit(c + backend.max_in_flight)
                if isinstance(rows, list):  # a host source's chunk views
                    buf = _as_rows(rows, hi - lo, cache)
                elif rows.dtype.itemsize != 1 or rows.shape != (hi - lo, cache.block_nbytes):
                    raise MigrationError(f"rayrpc: chunk {c} has shape {rows.shape} dtype {rows.dtype}, expected "
                                         f"({hi - lo}, {cache.block_nbytes}) uint8")
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the object store's arrays are read-only
                        buf = torch.from_numpy(rows)
                if cache.device.type == "cuda":
                    buf = buf.to(cache.device)
                ops.scatter_blocks(buf, cache, dst_ids[lo:hi])
            if cache.device.type == "cuda":
                torch.cuda.current_stream(cache.device).synchronize()
        finally:
            for ref in refs.values():  # a failure leaves later chunks in flight
                try:
                    ray.cancel(ref)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        return PullStats(backend.name, n, n * cache.block_nbytes, 0.0, chunks=len(chunks))

    def abort(self) -> None:
        """Nothing to end: calls still in flight were cancelled by the pull."""


def _actor_of(peer):
    actor = peer.extra.get("actor")
    if actor is None:
        raise MigrationError("rayrpc: the peer descriptor carries no actor handle")
    return actor


def _get(ref, deadline: Deadline, what: str):
    """ray.get of a call to the source actor, bounded by the deadline; MigrationError when it
    is late, the source refused or failed (remote_type: its exception's name), or the actor
    is gone."""
    import ray
    from ray import exceptions as rex

    try:
        return ray.get(ref, timeout=max(deadline.remaining(), 0))
    except rex.GetTimeoutError as e:
        raise MigrationError(f"rayrpc: {what} not received at the deadline of "
                             f"{deadline.timeout:g} s") from e
    except rex.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise MigrationError(f"rayrpc: the source refused or failed: "
                             f"{type(cause).__name__}: {cause}",
                             remote_type=type(cause).__name__) from e
    except rex.RayError as e:  # actor died, object lost, ...
        raise MigrationError(f"rayrpc: {type(e).__name__}: {e}") from e
