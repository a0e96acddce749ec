"""nccl: blocks cross GPU-to-GPU (NVLink, PCIe or the network) through NCCL send/recv, staged in
GPU memory.

Pairwise communicators: the destination makes NCCL unique ids and sends them over the
authenticated control channel; both sides join two-rank communicators (rank 0 = destination,
1 = source), cached per peer and used for pulls in that direction only. No global group: instances
join and leave freely. A pair's `lanes` communicators are set up in one NCCL group, so their
set-ups overlap.

Pipeline: each lane has two staging slots, a copy stream and a comm stream. Chunks grow 1, 2,
4, ... blocks up to `chunk_bytes` (vllm_ext_ramp_bounds: the first send starts after one block's
gather) and alternate between the lanes, so one chunk's start-up and tail overlap the next one's
transfer:

    source:       gather c+1 (copy stream)     | ncclSend c (comm stream)
    destination:  ncclRecv c+1 (comm stream)   | scatter c (copy stream)

The destination's copies first wait for the work queued on the caller's current stream; the
source reads its blocks at once (it offers blocks whose writes are complete). Each side enqueues
a whole request with one call into the library (vllm_ext_staged_transfer, which calls
ncclSend/ncclRecv through their addresses), then polls one event against the deadline.

The source side runs without Python: once the pair is built its control connection carries
binary pull requests (protocol.PULL_REQUEST), which a library thread reads, checks, enqueues and
answers (vllm_ext_pull_server_*), so a source whose Python is busy does not delay pulls. The
connection's Python thread only waits for that thread to end, then aborts the communicators.

Failures: NCCL kernels wait forever for a peer that is gone, so at the deadline, or when the
control connection reports the peer's failure or exit, a side aborts its communicators
(ncclCommAbort ends the kernels), drains its streams and drops the pair; the next pull builds a
new one. Set-up runs on a helper thread joined with the deadline; a set-up that never completes
is abandoned (it holds host memory and a thread in NCCL's bootstrap, no GPU buffers) and its
communicators are aborted if it ever returns. The communicators are blocking ones.
NOTE: non-blocking communicators (whose set-up could be aborted) answer ncclInProgress to every
later send and receive, which a transfer enqueued in one call cannot use.

A pull is one request unless it holds more than 128 slots' worth of blocks (request_segments):
neither side ever queues more than the pull server's 256 chunks, since a full CUDA launch queue
would block a thread inside a launch, out of any deadline's reach.

Options (the destination's values apply to a pair): chunk_bytes (largest chunk, default 32 MiB),
lanes (1 to 8, default 2; staging per side and pair: lanes x 2 x chunk_bytes), copy_ctas (grid
cap of the staging copies, so NCCL keeps SM room; default one CTA per 2 SMs, 0 = the whole GPU).
benchmarks/TUNING.md has the measurements behind these defaults.
"""

import array
import ctypes
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _lib
from ..errors import MigrationError
from . import protocol
from ._nccl_lib import NCCL_UINT8
from .base import (
    MigrationBackend,
    Pair,
    PullStats,
    blocks_per_chunk,
    check_slot,
    chunk_ranges,
    wait_cuda_event,
)
from .timing import Deadline, poll_until

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_LANES = 2
_COPY_SMS_PER_CTA = 2  # default grid of a staging copy: one CTA per 2 SMs
_MAX_CTAS = (1 << 31) - 1  # the C ABI's int32
_DST_RANK, _SRC_RANK = 0, 1
_DRAIN_GRACE_S = 5.0
_SEGMENT_SLOTS = 128  # full slots per request: ramp chunks + 128 stay under PULL_MAX_CHUNKS
_ABANDONED: List["_Lanes"] = []  # pairs whose abort or drain gave up: their buffers stay alive
_WARMUP_BYTES = 4096


def _lib_nccl():
    from . import _nccl_lib

    return _nccl_lib.library()


class _Lanes:
    """One side of a pair: its lanes (each a two-rank communicator with two staging slots,
    a copy stream, a comm stream and their events) and the pull's entry and done events. The
    whole enqueue sequence of a pull (gathers or scatters, sends or receives, the events
    between them, over every lane) is one call into vllm_ext's library
    (vllm_ext_staged_transfer), which calls NCCL through the function's address: a few
    microseconds per chunk instead of tens in Python."""

    def __init__(self, comms: List[int], cache, chunk_blocks: int, copy_ctas: int, direction: int):
        from .. import ops

        self.comms = list(comms)
        self.cache = cache
        self.device = cache.device
        self.chunk_blocks = chunk_blocks
        lib = _lib_nccl()
        transfer = lib.address("ncclSend" if direction == _lib.STAGE_SEND else "ncclRecv")
        peer = _DST_RANK if direction == _lib.STAGE_SEND else _SRC_RANK
        self.entry = torch.cuda.Event()  # the caller's stream, when a pull starts
        self.done = torch.cuda.Event()  # the pull's last stage, over every lane
        self.slots: List[torch.Tensor] = []
        self.streams: List[torch.cuda.Stream] = []
        events = [self.entry, self.done]
        lanes = []
        for comm in self.comms:
            slots = [torch.empty((chunk_blocks, cache.block_nbytes), dtype=torch.uint8, device=cache.device)
                     for _ in range(2)]
            copy_stream = torch.cuda.Stream(cache.device)  # gathers or scatters
            # Sends or receives. High priority: when a chunk's transfer and another chunk's copy
            # become ready together, the GPU places the transfer's blocks first (the copy
            # kernel would otherwise fill every SM and the transfer would wait for it).
            comm_stream = torch.cuda.Stream(cache.device, priority=-1)
            copied, moved = [torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)]
            tail = torch.cuda.Event()
            for event in copied + moved + [tail]:
                event.record(copy_stream)  # torch creates an event's CUDA handle lazily
            events += copied + moved + [tail]
            self.slots += slots
            self.streams += [copy_stream, comm_stream]
            lanes.append(_lib.Staging(
                direction=direction, max_ctas=copy_ctas,  # grid cap of the copies (0 = whole GPU)
                slots=(ctypes.c_uint64 * 2)(*(slot.data_ptr() for slot in slots)),
                slot_blocks=chunk_blocks, copy_stream=copy_stream.cuda_stream,
                comm_stream=comm_stream.cuda_stream,
                copied=(ctypes.c_void_p * 2)(*(e.cuda_event for e in copied)),
                moved=(ctypes.c_void_p * 2)(*(e.cuda_event for e in moved)),
                tail=tail.cuda_event, transfer=transfer, comm=comm, peer=peer, datatype=NCCL_UINT8))
        for event in (self.entry, self.done):
            event.record(self.streams[0])
        self._events = events
        self.lanes = (_lib.Staging * len(lanes))(*lanes)
        self.side = ops._cache_side(cache, None, cache.device)
        self.alignment = min([cache.alignment] + [ops._buffer_alignment(s, cache) for s in self.slots])
        self._current_stream = ops._current_raw_stream
        self.aborted = False
        self._abort_lock = threading.Lock()
        self.server: Optional[_lib.PullServer] = None  # source side: the library thread serving pulls
        self.server_ended = threading.Event()  # set by the server's owner after destroying it
        self._server_lock = threading.Lock()
        self.retired = False  # no server may start any more

    def enqueue(self, ids: List[int], part=None) -> int:
        """Destination side: enqueues the whole pull of blocks `ids` over the lanes, after the
        work queued on the caller's current stream, with `done` recorded at its end. Returns
        the number of chunks (vllm_ext_ramp_bounds: the source derives the same from n).
        `part`: the head range (cache.HeadPart) the blocks receive; None: whole blocks."""
        from .. import ops

        bounds = _lib.ramp_bounds(len(ids), self.chunk_blocks)
        values = array.array("q", ids)
        cache = self.cache
        side, alignment, rows = self.side, self.alignment, ops._Rows(cache.slice_nbytes)
        if part is not None:
            rows = ops._Rows.of(cache, None, part)
            side = ops._cache_side(cache, None, cache.device, rows.dst)
            alignment = min(ops._part_alignment(self.alignment, part),
                            min(ops._buffer_alignment(s, cache, rows.slice_nbytes) for s in self.slots))
        _lib.staged_transfer(side, self.lanes, values.buffer_info()[0], bounds.buffer_info()[0], 0,
                             len(bounds) - 1, cache.num_layers, cache.num_components, rows.slice_nbytes,
                             alignment, self.device.index,
                             after_stream=self._current_stream(self.device.index),
                             after_event=self.entry.cuda_event, done=self.done.cuda_event, num_rows=rows.num_rows)
        return len(bounds) - 1

    def serve(self, conn, stall, grants, heads=None) -> None:
        """Source side: hands the connection's further requests (binary pulls) to a library
        thread, and returns when that thread has ended and is destroyed. `stall`: the fault
        hook of tests (Faults.native_stall), or None; `grants`: the Grants the server checks
        every request against, or None (every block); `heads`: _lib.PullHeads for head-range
        requests, or None (whole blocks only)."""
        cache = self.cache
        with self._server_lock:
            if self.retired:  # retired (the endpoint closing) before its server started
                self.server_ended.set()
                return
            conn.sock.setblocking(True)
            self.server = _lib.PullServer(os.dup(conn.sock.fileno()), self.side, self.lanes,
                                          cache.num_layers, cache.num_components, cache.slice_nbytes,
                                          self.alignment, self.device.index, self.done.cuda_event,
                                          None if grants is None else grants.counts, heads)
            if stall is not None:
                self.server.test_stall(stall)
        try:
            while True:
                ended = self.server.wait(1.0)
                if ended is not None:
                    break
            reason, message = ended
            if reason in (_lib.SERVER_FAILED, _lib.SERVER_DEADLINE):
                logger.warning("nccl: serving %s ended: %s", conn.peer, message)
        finally:
            self.server.destroy()
            self.server_ended.set()

    def stop_server(self) -> bool:
        """Any thread: ends the pull server (none may start after this) and waits, bounded,
        until it is gone. True when no server thread can use the communicator any more; False
        when it still runs, and its owner aborts the communicator once it has ended."""
        with self._server_lock:
            self.retired = True
            server = self.server
        if server is None or self.server_ended.is_set():
            return True
        server.stop()
        if self.server_ended.wait(_DRAIN_GRACE_S):
            return True
        logger.error("nccl: the pull server of %s still runs %g s after stop; its owner aborts "
                     "the communicator when it ends", self.device, _DRAIN_GRACE_S)
        return False

    def abort(self) -> None:
        """Ends the communicators' kernels, then waits (bounded) for the streams to drain."""
        end = time.monotonic() + _DRAIN_GRACE_S
        with self._abort_lock:
            first, self.aborted = not self.aborted, True
        if first:
            if not _abort_bounded(self.comms):
                logger.error("nccl: ncclCommAbort on %s still runs after %g s; abandoned (its "
                             "buffers stay allocated)", self.device, _DRAIN_GRACE_S)
                _ABANDONED.append(self)  # kernels may still write into its slots
                return
        for stream in self.streams:
            while not stream.query():
                if time.monotonic() > end:
                    logger.error("nccl: a stream of %s still runs %g s after the abort (its "
                                 "buffers stay allocated)", self.device, _DRAIN_GRACE_S)
                    _ABANDONED.append(self)
                    return
                time.sleep(1e-4)


def _abort_bounded(comms: List[int]) -> bool:
    """Aborts the communicators, each on its own helper thread, all at once: an abort may
    synchronise the device (freeing its buffers), which waits for the kernels of the other
    communicators too, so aborting them one after another would wait for a kernel that only
    the next abort ends. The helpers also keep an abort that waits on a dead peer from holding
    the caller past its deadline. False when one still runs after the grace period."""

    def abort(comm):
        try:
            _lib_nccl().abort(comm)
        except Exception:  # noqa: BLE001
            logger.exception("ncclCommAbort failed")

    threads = [threading.Thread(target=abort, args=(comm,), name="nccl-abort", daemon=True) for comm in comms]
    for thread in threads:
        thread.start()
    end = time.monotonic() + _DRAIN_GRACE_S
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0))
    return not any(thread.is_alive() for thread in threads)


def _run_bounded(fn, deadline: Deadline, what: str, on_abandoned=None):
    """Runs fn() on a helper thread; MigrationError when it is not done by the deadline. The
    thread is then abandoned (a blocking NCCL set-up cannot be interrupted); if it completes
    later after all, `on_abandoned(value)` releases what it built (a communicator whose peer
    joined late), so nothing leaks."""
    result: Dict[str, Any] = {}
    lock = threading.Lock()

    def target():
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e
            return
        with lock:
            if not result.get("abandoned"):
                result["value"] = value
                return
        if on_abandoned is not None:
            try:
                on_abandoned(value)
            except Exception:  # noqa: BLE001
                logger.exception("%s: releasing a set-up that completed after its deadline", what)

    thread = threading.Thread(target=target, name="nccl-setup", daemon=True)
    thread.start()
    thread.join(max(deadline.remaining(), 0))
    with lock:
        if "value" not in result and "error" not in result:
            result["abandoned"] = True
            raise MigrationError(f"{what}: not complete at the deadline of {deadline.timeout:g} s "
                                 "(peer gone?)")
    if "error" in result:
        raise MigrationError(f"{what}: {result['error']}") from result["error"]
    return result["value"]


def _join(cache, uids: List[bytes], rank: int, deadline: Deadline) -> List[int]:
    """Joins the pair's two-rank communicators, one per uid, at once (one NCCL group: their
    set-ups overlap), then moves a few bytes source -> destination on each (one group too),
    so that the connections exist before the first pull. The peer joins the same uids in the
    same order. Returns the comms; on a failure the ones made are aborted."""
    device = cache.device

    def setup():
        torch.cuda.set_device(device)
        lib = _lib_nccl()
        comms = lib.init_ranks(2, uids, rank)
        try:
            buf = torch.zeros((len(comms), _WARMUP_BYTES), dtype=torch.uint8, device=device)
            stream = torch.cuda.current_stream(device)
            with lib.group("nccl warm-up"):
                for comm, row in zip(comms, buf):
                    if rank == _SRC_RANK:
                        lib.send(row.data_ptr(), row.numel(), _DST_RANK, comm, stream.cuda_stream)
                    else:
                        lib.recv(row.data_ptr(), row.numel(), _SRC_RANK, comm, stream.cuda_stream)
            event = torch.cuda.Event()
            event.record(stream)
            wait_cuda_event(event, deadline, "nccl warm-up")
        except BaseException:
            _abort_bounded(comms)
            raise
        return comms

    return _run_bounded(setup, deadline, "nccl communicator set-up", on_abandoned=_abort_bounded)


class _NcclPair(Pair):
    """The destination's pair: its lanes, over the link's connection to the pull server."""

    def __init__(self, backend: "NcclBackend", link, lanes: _Lanes):
        self.backend = backend
        self.conn = link.conn
        self.lanes = lanes

    def pull(self, src_ids, dst_ids, deadline: Deadline, heads=None) -> PullStats:
        """`heads`: (source part, destination part) of a head range (see Pair.pull)."""
        lanes = self.lanes
        n = len(src_ids)
        src_part, part = heads or (None, None)
        wanted = None if src_part is None else (src_part.first, src_part.count)
        cache = self.backend.cache
        row = cache.block_nbytes if part is None else cache.num_layers * cache.num_components * part.slice_nbytes
        chunks = 0
        for lo, hi in request_segments(n, lanes.chunk_blocks):  # one request unless very long
            remaining = deadline.remaining()
            if remaining <= 0:
                when = "while connecting" if lo == 0 else f"after {lo} of {n} blocks"
                raise MigrationError(f"nccl pull: the deadline of {deadline.timeout:g} s passed {when}")
            # The request goes first (to the source's pull server): the source gathers while
            # this side queues its receives.
            self.conn.send_bytes(protocol.pull_request(src_ids[lo:hi], remaining, wanted), deadline)
            chunks += lanes.enqueue(dst_ids[lo:hi], part)
            _wait_for_pull(self.conn, lanes.done.query, deadline)
            # The caller's streams see the blocks: the pull returns after `done` completed.
        return PullStats(self.backend.name, n, n * row, 0.0, chunks=chunks)

    def abort(self) -> None:
        self.lanes.abort()


class _ServedPair:
    """The source's lanes of one destination connection, served by the library's thread."""

    def __init__(self, lanes: _Lanes):
        self.lanes = lanes

    def close(self) -> None:
        if self.lanes.stop_server():
            self.lanes.abort()

    abort = close


class NcclBackend(MigrationBackend):
    name = "nccl"
    supports_tls = False  # the pull server reads binary requests on the raw socket
    moves_head_ranges = True  # a pull request names a KV head range (the pull server checks it)

    def __init__(self, context, chunk_bytes: int = DEFAULT_CHUNK_BYTES, copy_ctas: Optional[int] = None,
                 lanes: int = DEFAULT_LANES):
        super().__init__(context)
        if int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes!r}")
        if not 1 <= int(lanes) <= protocol.MAX_LANES:
            raise ValueError(f"lanes: must be 1 to {protocol.MAX_LANES}, got {lanes!r}")
        self.lanes = int(lanes)
        if copy_ctas is not None and not 0 <= int(copy_ctas) <= protocol.MAX_COPY_CTAS:
            raise ValueError(f"copy_ctas: must be 0 (the whole GPU) to {protocol.MAX_COPY_CTAS}, got {copy_ctas!r}")
        self.chunk_bytes = int(chunk_bytes)
        check_slot(blocks_per_chunk(self.chunk_bytes, context.cache.block_nbytes), context.cache.block_nbytes,
                   "chunk_bytes")
        self.copy_ctas = None if copy_ctas is None else int(copy_ctas)
        self._served: List[_ServedPair] = []
        self._lock = threading.Lock()

    @classmethod
    def is_available(cls):
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        try:
            _lib_nccl()
        except ImportError as e:
            return False, str(e)
        return True, ""

    def check_cache(self, cache) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"cache: on {cache.device}; the nccl backend moves CUDA caches "
                             "(use gloo for host caches)")

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> Pair:
        cache = self.cache
        uids = [_lib_nccl().unique_id() for _ in range(self.lanes)]
        chunk_blocks = blocks_per_chunk(self.chunk_bytes, cache.block_nbytes)
        copy_ctas = self.copy_ctas
        if copy_ctas is None:
            sms = torch.cuda.get_device_properties(cache.device).multi_processor_count
            copy_ctas = max(1, sms // _COPY_SMS_PER_CTA)
        link.request(protocol.NcclConnect([uid.hex() for uid in uids], chunk_blocks, copy_ctas,
                                          deadline.remaining()), deadline)
        link.conn.recv_reply(deadline, "nccl connect")
        comms = _join(cache, uids, _DST_RANK, deadline)
        try:
            return _NcclPair(self, link, _Lanes(comms, cache, chunk_blocks, copy_ctas, _lib.STAGE_RECV))
        except BaseException:
            _abort_bounded(comms)
            raise

    # ---- source side ---------------------------------------------------------------------
    def serve(self, session, request, payload) -> bool:
        if not isinstance(request, protocol.NcclConnect):
            return super().serve(session, request, payload)
        check_slot(request.chunk_blocks, self.cache.block_nbytes, "nccl connect")
        deadline = Deadline(request.timeout)
        uids = [bytes.fromhex(uid) for uid in request.uids]
        conn = session.conn
        conn.reply_ok()
        # From here on this connection carries binary pulls, served by the library's thread;
        # this thread waits for it to end, then the pair is released and the connection closes.
        # A failure is reported in the binary format the destination now reads.
        comms: List[int] = []
        try:
            self.context.faults.pause("connect")  # tests: a source that joins late
            comms = _join(self.cache, uids, _SRC_RANK, deadline)
            lanes = _Lanes(comms, self.cache, request.chunk_blocks, request.copy_ctas, _lib.STAGE_SEND)
        except Exception as e:  # noqa: BLE001 - reported to the peer in the binary format
            _abort_bounded(comms)
            _send_failed(conn, f"nccl connect: {e}")
            logger.warning("nccl: serving the connect of %s failed: %s", conn.peer, e)
            return True
        session.pair = served = _ServedPair(lanes)
        with self._lock:
            self._served.append(served)
        cache = self.cache
        heads = None
        if cache.head_stride:  # head-range requests; whole blocks only for a peer of the same heads
            peer_heads = session.peer_geometry.get("num_kv_heads", cache.num_kv_heads)
            heads = _lib.PullHeads(num_kv_heads=cache.num_kv_heads, whole_blocks=int(peer_heads == cache.num_kv_heads),
                                   head_stride=cache.head_stride)
        try:
            lanes.serve(conn, self.context.faults.native_stall, self.context.grants, heads)
        except Exception:  # noqa: BLE001 - the peer no longer reads JSON here: logged only
            logger.exception("nccl: serving %s failed", conn.peer)
        finally:
            with self._lock:
                self._served.remove(served)
            self.session_closed(session)
        return True

    def close(self) -> None:
        with self._lock:
            served = list(self._served)
        for pair in served:  # ends their pull servers; their threads then end
            pair.close()


def request_segments(n: int, chunk_blocks: int) -> List[Tuple[int, int]]:
    """[(lo, hi)]: the requests a pull of n blocks is sent as. Each holds at most
    _SEGMENT_SLOTS full slots and _SEGMENT_SLOTS launches' worth of inline ids, so that its
    chunks (ramp included) and its copy launches stay within the pull server's limits
    (PULL_MAX_CHUNKS, PULL_MAX_REQUEST_IDS): a side never queues more launches than that (a
    full CUDA launch queue would block its thread inside a launch, where no deadline reaches
    it). Only very long pulls split: more than 128 slots (4 GiB with the defaults and 8 MiB
    blocks) or more than 57344 blocks."""
    return chunk_ranges(n, min(chunk_blocks, _lib.MAX_INLINE_IDS) * _SEGMENT_SLOTS)


def _send_failed(conn, message: str) -> None:
    """A FAILED reply in the pull server's format (the peer may be gone: nothing raised)."""
    try:
        conn.send_bytes(protocol.pull_reply(protocol.PULL_FAILED, message))
    except MigrationError:
        pass


def _wait_for_pull(conn, done, deadline: Deadline) -> None:
    """Destination side: waits until done() and the source's pull server accepted the request;
    MigrationError when it refuses, reports a failure, the connection closes (the source
    exited) or the deadline passes."""
    accepted = []

    def check() -> None:
        if not conn.readable():
            return
        try:
            kind, length = protocol.parse_pull_reply(conn.recv_bytes(protocol.PULL_REPLY.size, deadline))
        except protocol.ProtocolError:
            raise MigrationError(f"nccl pull: a malformed reply from {conn.peer}") from None
        message = conn.recv_bytes(length, deadline).decode(errors="replace") if length else ""
        if kind == protocol.PULL_ACCEPTED and not accepted:
            accepted.append(True)
        elif kind == protocol.PULL_REFUSED:
            raise MigrationError(f"nccl pull: the peer ({conn.peer}) refused: ValueError: {message}",
                                 remote_type="ValueError")
        elif kind == protocol.PULL_FAILED:
            raise MigrationError(f"nccl pull: the peer ({conn.peer}) failed: {message}",
                                 remote_type="MigrationError")
        else:
            raise MigrationError(f"nccl pull: an unexpected reply (kind {kind}) from {conn.peer}")

    poll_until(lambda: bool(accepted) and done(), deadline, "nccl pull", check)
