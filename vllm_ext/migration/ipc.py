"""ipc: two GPUs of one host. The destination maps the source's cache memory through CUDA IPC
(once per peer) and pulls with one launch of the block-copy kernel on its own GPU that reads
the source over NVLink (or PCIe peer access): no staging buffer, no host copy, no send/recv.

A pull exchanges no control message: its fixed costs are one kernel launch, which carries
up to 448 block-id pairs in its parameters (a longer list goes through reused pinned and
device buffers first), and the completion poll, on the current stream of the destination's
GPU (so the copy follows the work already queued there). The
source is therefore not asked per pull, and must offer only blocks whose writes are complete
(a serving engine migrates blocks of finished steps).
Before each pull the destination checks that the source's control connection is still open;
a source that exited is reported as MigrationError instead of being read.

Source-side checks (same host, geometry, dtype) happen when the destination maps the cache;
ids are checked on the destination against the block count the source reported then.
"""

import array
import dataclasses
import logging
from typing import Any, Dict

import torch

from .base import Deadline, IdStaging, MigrationBackend, MigrationError, PullStats, wait_cuda_event

logger = logging.getLogger(__name__)

_HANDLE_BYTES_FIELDS = ("allocations",)
_DRAIN_S = 5.0


def handle_to_json(handle) -> Dict[str, Any]:
    """IpcCacheHandle -> JSON-safe dict (bytes as hex)."""
    d = dataclasses.asdict(handle)
    d["allocations"] = [[raw.hex(), int(nbytes)] for raw, nbytes in handle.allocations]
    d["layer_offsets"] = [[int(a), int(o)] for a, o in handle.layer_offsets]
    return d


def handle_from_json(d: Dict[str, Any]):
    from ..cache import IpcCacheHandle

    fields = {f.name for f in dataclasses.fields(IpcCacheHandle)}
    if set(d) != fields:
        raise ValueError(f"ipc handle: fields {sorted(d)} do not match {sorted(fields)}")
    d = dict(d)
    d["allocations"] = tuple((bytes.fromhex(raw), int(nbytes)) for raw, nbytes in d["allocations"])
    d["layer_offsets"] = tuple((int(a), int(o)) for a, o in d["layer_offsets"])
    return IpcCacheHandle(**d)


class IpcBackend(MigrationBackend):
    name = "ipc"
    same_host_only = True
    other_process_only = True

    def __init__(self, endpoint):
        super().__init__(endpoint)
        self._export = None  # the source's handle, made once
        self._unfinished = []  # (event, view, ids) of copies that outlived a discard

    @classmethod
    def is_available(cls):
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        return True, ""

    def check_cache(self, cache) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"cache: on {cache.device}; the ipc backend shares CUDA caches")

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> None:
        from .. import ops
        from ..cache import KVCache

        cache = self.endpoint.cache
        link.request({"op": "ipc.export"}, deadline)
        reply = link.conn.recv_reply(deadline, "ipc export")
        try:
            handle = handle_from_json(reply["handle"])
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(f"ipc connect: bad handle from the peer: {e}") from e
        if handle.num_blocks != link.hello.get("num_blocks"):
            raise MigrationError(f"ipc connect: handle of {handle.num_blocks} blocks, the peer "
                                 f"said {link.hello.get('num_blocks')}")
        view = KVCache.import_ipc(handle, device=cache.device)
        if view.geometry() != cache.geometry():
            view.close()
            raise MigrationError("ipc connect: the mapped cache's geometry differs")
        # The per-pull launches skip the checks of ops.copy_blocks: make them here, once.
        try:
            ops._placement(view.device, view.pinned, "the peer's cache", cache.device,
                           cache.pinned, "cache")
            view.prepare(cache.device)
        except Exception:
            view.close()
            raise
        link.state["view"] = view
        link.state["ids"] = IdStaging(cache.device)
        link.state["done"] = torch.cuda.Event()
        # The two sides of every launch, without ids: built once.
        link.state["sides"] = (ops._cache_side(view, None, cache.device),
                               ops._cache_side(cache, None, cache.device),
                               min(view.alignment, cache.alignment))

    def pull(self, link, src_ids, dst_ids, deadline: Deadline) -> PullStats:
        from .. import _lib, ops

        cache = self.endpoint.cache
        if link.conn.closed_by_peer():
            raise MigrationError("ipc pull: the source closed its control connection (exited?)")
        # Checked once at connect: same geometry, peer access; ids checked by the endpoint.
        n = len(src_ids)
        if n <= _lib.MAX_INLINE_IDS:  # the ids travel in the launch itself
            src_side, dst_side, alignment = link.state["sides"]
            ids = array.array("q", src_ids)
            ids.extend(dst_ids)
            address = ids.buffer_info()[0]
            ops._copy_inline(src_side, dst_side, address, address + n * ids.itemsize, n, cache,
                             alignment, cache.device)
        else:
            src, dst = link.state["ids"].upload(src_ids, dst_ids, deadline=deadline)
            ops._copy_prechecked(link.state["view"], src, cache, dst, cache.device)
        done = link.state["done"]
        done.record(torch.cuda.current_stream(cache.device))
        wait_cuda_event(done, deadline, "ipc copy")
        return PullStats(self.name, len(src_ids), len(src_ids) * cache.block_nbytes, 0.0)

    def discard(self, link) -> None:
        done = link.state.pop("done", None)
        view = link.state.pop("view", None)
        if done is not None and not done.query():
            # The copy is bounded, but it follows whatever else the caller's stream holds:
            # wait a while, and keep the mapping and ids alive rather than unmap under it.
            try:
                wait_cuda_event(done, Deadline(_DRAIN_S), "ipc copy before the unmap")
            except MigrationError:
                logger.error("ipc: a copy from %s still runs %g s after a failed pull; its "
                             "mapping is kept", link.peer.short(), _DRAIN_S)
                self._unfinished.append((done, view, link.state.pop("ids", None)))
                return
        link.state.pop("ids", None)
        link.state.pop("sides", None)
        if view is not None:
            view.close()

    # ---- source side ---------------------------------------------------------------------
    def serve(self, conn, op: str, header: Dict[str, Any], payload: bytes) -> None:
        if op != "ipc.export":
            return super().serve(conn, op, header, payload)
        if self._export is None:
            self._export = handle_to_json(self.endpoint.cache.export_ipc())
        conn.reply_ok(handle=self._export)

    def close(self) -> None:
        still = []
        for done, view, ids in self._unfinished:
            if not done.query():
                still.append((done, view, ids))  # unmapping under a running copy: never
            elif view is not None:
                view.close()
        self._unfinished = still
