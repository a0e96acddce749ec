"""ipc: two GPUs of one host. The destination maps the source's cache memory through CUDA IPC
(once per peer) and pulls with one launch of the block-copy kernel on its own GPU that reads
the source over NVLink (or PCIe peer access): no staging buffer, no host copy, no send/recv.

A pull exchanges no control message: its fixed costs are one kernel launch, which carries
up to 448 block-id pairs in its parameters (a longer list goes through reused pinned and
device buffers first), and the completion poll, on the current stream of the destination's
GPU (so the copy follows the work already queued there). The
source is therefore not asked per pull, and must offer only blocks whose writes are complete
(a serving engine migrates blocks of finished steps).
Before each pull the destination checks that the source's control connection is still open
and silent; a source that exited or is closing is reported as MigrationError instead of read.

Source-side checks (same host, geometry, dtype) happen when the destination maps the cache;
ids are checked on the destination against the block count the source reported then.
"""

import array
import dataclasses
import logging
from typing import Any, Dict

import torch

from ..errors import Error, MigrationError
from . import protocol
from .base import IdStaging, MigrationBackend, Pair, PullStats, wait_cuda_event, watch_connection
from .protocol import heads_differ_only
from .timing import Deadline

logger = logging.getLogger(__name__)

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


class _IpcPair(Pair):
    """The mapping of one source's cache, and the two sides of every launch (built once)."""

    def __init__(self, backend: "IpcBackend", link, view):
        from .. import ops

        cache = backend.cache
        self.backend = backend
        self.conn = link.conn
        self.view = view
        self.ids = IdStaging(cache.device)
        self.done = torch.cuda.Event()
        self.sides = (ops._cache_side(view, None, cache.device), ops._cache_side(cache, None, cache.device),
                      min(view.alignment, cache.alignment))
        self._watch = watch_connection(link.conn, "ipc pull")

    def pull(self, src_ids, dst_ids, deadline: Deadline, heads=None) -> PullStats:
        """`heads`: (source part, destination part) of a head range (see Pair.pull)."""
        from .. import _lib, ops

        cache = self.backend.cache
        self._watch()  # an exited or closing source is reported, not read
        n = len(src_ids)
        view = self.view
        if heads is None and view.num_kv_heads != cache.num_kv_heads:  # a descriptor that lied about its heads
            raise ValueError(f"ipc pull: whole blocks of the mapped cache's {view.num_kv_heads} KV heads into "
                             f"{cache.num_kv_heads}; name a head range")
        if heads is not None:  # placed by the mapped cache itself, not by what its descriptor says
            src_part, dst_part = heads
            heads = ops.pair_head_parts(view.head_part((src_part.first, src_part.count), "src_heads"),
                                        view.num_kv_heads, dst_part, cache.num_kv_heads)
        rows = None if heads is None else ops._Rows.of(cache, *heads)
        if n <= _lib.MAX_INLINE_IDS:  # the ids travel in the launch itself
            src_side, dst_side, alignment = self.sides
            if heads is not None:  # the sides of this range (cheap: no upload)
                src_side = ops._cache_side(self.view, None, cache.device, rows.src)
                dst_side = ops._cache_side(cache, None, cache.device, rows.dst)
                alignment = ops._pair_alignment(self.view, cache, heads)
            ids = array.array("q", src_ids)
            ids.extend(dst_ids)
            address = ids.buffer_info()[0]
            ops._copy_inline(src_side, dst_side, address, address + n * ids.itemsize, n, cache, alignment,
                             cache.device, rows=rows)
        else:
            src, dst = self.ids.upload(src_ids, dst_ids, deadline=deadline)
            ops._copy_prechecked(self.view, src, cache, dst, cache.device, parts=heads)
        self.done.record(torch.cuda.current_stream(cache.device))
        wait_cuda_event(self.done, deadline, "ipc copy")
        row = cache.block_nbytes if rows is None else cache.num_layers * cache.num_components * rows.slice_nbytes
        return PullStats(self.backend.name, n, n * row, 0.0)

    def abort(self) -> None:
        if not self.done.query():
            # The copy is bounded, but it follows whatever else the caller's stream holds:
            # wait a while, and keep the mapping and ids alive rather than unmap under it.
            try:
                wait_cuda_event(self.done, Deadline(_DRAIN_S), "ipc copy before the unmap")
            except MigrationError:
                logger.error("ipc: a copy from %s still runs %g s after a failed pull; its mapping is kept",
                             self.conn.peer, _DRAIN_S)
                self.backend.keep_until_done(self)
                return
        self.view.close()


class IpcBackend(MigrationBackend):
    name = "ipc"
    same_host_only = True
    other_process_only = True
    can_grant = False  # the destination maps the whole cache
    moves_head_ranges = True  # the destination's copy reads the range it names

    def __init__(self, context):
        super().__init__(context)
        self._export = None  # the source's handle, made once
        self._unfinished = []  # pairs whose copy outlived an abort

    @classmethod
    def is_available(cls):
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        return True, ""

    def check_cache(self, cache) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"cache: on {cache.device}; the ipc backend shares CUDA caches")

    def keep_until_done(self, pair: _IpcPair) -> None:
        self._unfinished.append(pair)

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> Pair:
        from .. import ops
        from ..cache import KVCache

        cache = self.cache
        link.request(protocol.IpcExport(), deadline)
        reply = link.conn.recv_reply(deadline, "ipc export", protocol.IpcExportReply)
        try:
            handle = handle_from_json(reply.handle)
        except (KeyError, TypeError, ValueError) as e:
            raise MigrationError(f"ipc connect: bad handle from the peer: {e}") from e
        if handle.num_blocks != link.num_blocks:
            raise MigrationError(f"ipc connect: handle of {handle.num_blocks} blocks, the peer said {link.num_blocks}")
        try:
            view = KVCache.import_ipc(handle, device=cache.device)
        except (Error, ValueError) as e:
            raise MigrationError(f"ipc connect: mapping the peer's cache failed: {e}") from e
        try:
            mapped, mine = view.geometry(), cache.geometry()
            if mapped != mine and not heads_differ_only(mapped, mine):
                raise MigrationError("ipc connect: the mapped cache's geometry differs")
            if (view.head_stride or 0) != link.peer.head_stride:  # head ranges are placed by the descriptor's
                raise MigrationError(f"ipc connect: the mapped cache's head stride {view.head_stride} is not the "
                                     f"{link.peer.head_stride} of the peer's descriptor")
            # The per-pull launches skip the checks of ops.copy_blocks: make them here, once.
            ops._placement(view.device, view.pinned, "the peer's cache", cache.device, cache.pinned, "cache")
            view.prepare(cache.device)
            return _IpcPair(self, link, view)
        except BaseException:
            view.close()
            raise

    # ---- source side ---------------------------------------------------------------------
    def serve(self, session, request, payload) -> bool:
        if not isinstance(request, protocol.IpcExport):
            return super().serve(session, request, payload)
        if self._export is None:
            self._export = handle_to_json(self.cache.export_ipc())
        session.conn.reply_ok(protocol.IpcExportReply(self._export))
        return False

    def close(self) -> None:
        still = []
        for pair in self._unfinished:
            if not pair.done.query():
                still.append(pair)  # unmapping under a running copy: never
            else:
                pair.view.close()
        self._unfinished = still
