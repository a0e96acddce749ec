"""nccl: blocks cross GPU-to-GPU (NVLink, PCIe or the network) through NCCL send/recv, staged in
GPU memory.

Pairwise communicators: the destination makes an NCCL unique id and sends it over the control
channel; both sides join a two-rank communicator (rank 0 = destination, 1 = source) used for
pulls in that direction only, cached per peer. No third instance and no global group are ever
involved, so instances join and leave freely (each communicator costs NCCL buffers, tens of
MB of GPU memory).

Pipeline, in chunks that grow 1, 2, 4, ... blocks up to `chunk_bytes` (so the first send
starts after one block's gather, and long pulls need few NCCL calls), two staging slots per
side, two streams per side besides the caller's:

    source:       gather c+1 (copy stream)     | ncclSend c (comm stream)
    destination:  ncclRecv c+1 (comm stream)   | scatter c (copy stream)

The destination's copy stream first waits for the work queued on the caller's current stream;
the source reads its blocks at once (it offers blocks whose writes are complete, as for ipc).
Everything is enqueued up front with events between the streams; the host then polls one
event against the deadline. NCCL kernels wait forever for a peer that is gone, so on the
deadline (or when the control connection reports the peer's failure or exit) the side aborts
its communicator (ncclCommAbort ends the kernels), drains its streams, discards the pair, and
the next pull builds a new one. Communicator set-up runs on a helper thread joined with the
deadline; a set-up that never completes is abandoned.

The gathers and scatters run with a capped grid (`copy_ctas`, default 2 CTAs per SM): still
enough to stream HBM, and the NCCL kernel of the neighbouring chunk keeps room on every SM
(measured on two H200s: +10-20% at 232-544 MiB against a grid that fills the GPU).

The destination chooses the pair's parameters and sends them to the source at connect.
Options: chunk_bytes (largest chunk, default 64 MiB: two slots per side are 128 MiB of GPU
memory per pair), copy_ctas (None = 2 per SM, 0 = the whole GPU).
"""

import logging
import threading
import time
from typing import Any, Dict, Optional

import torch

from .base import (
    Deadline,
    IdStaging,
    MigrationError,
    PairedBackend,
    PullStats,
    blocks_per_chunk,
    chunk_ranges,
    follow_current_stream,
    wait_cuda_event,
)
from .control import encode_ids

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
_COPY_CTAS_PER_SM = 2
_MAX_CTAS = (1 << 31) - 1  # the C ABI's int32
_DST_RANK, _SRC_RANK = 0, 1
_DRAIN_GRACE_S = 5.0
_WARMUP_BYTES = 4096


def _lib():
    from . import _nccl_lib

    return _nccl_lib.library()


class _Pair:
    """One side of a two-rank communicator plus its staging slots, streams and events."""

    def __init__(self, comm: int, cache, chunk_blocks: int, copy_ctas: int):
        self.comm = comm
        self.device = cache.device
        self.chunk_blocks = chunk_blocks
        self.copy_ctas = copy_ctas  # grid cap of the gathers and scatters (0 = the whole GPU)
        self.slots = [torch.empty((chunk_blocks, cache.block_nbytes), dtype=torch.uint8,
                                  device=cache.device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(cache.device)  # gather or scatter
        # send or recv. High priority: when a chunk's transfer and the previous chunk's copy
        # become ready together, the GPU places the transfer's blocks first (the copy kernel
        # would otherwise fill every SM and the transfer would wait for it).
        self.comm_stream = torch.cuda.Stream(cache.device, priority=-1)
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.moved = [torch.cuda.Event() for _ in range(2)]
        self.entry = torch.cuda.Event()  # the caller's stream, when a pull starts
        self.done = torch.cuda.Event()  # the pull's last stage
        self.ids = IdStaging(cache.device)
        self.aborted = False

    def chunks(self, n: int):
        """The pull's chunks; both sides derive them from n alone (protocol 2: ramped)."""
        return chunk_ranges(n, self.chunk_blocks, ramp=True)

    def abort(self) -> None:
        """Ends the communicator's kernels, then waits (bounded) for the streams to drain."""
        end = time.monotonic() + _DRAIN_GRACE_S
        if not self.aborted:
            self.aborted = True

            def abort():
                try:
                    _lib().abort(self.comm)
                except Exception:  # noqa: BLE001
                    logger.exception("ncclCommAbort failed")

            # An abort that waits on a dead peer must not hold the caller past its deadline.
            thread = threading.Thread(target=abort, name="nccl-abort", daemon=True)
            thread.start()
            thread.join(_DRAIN_GRACE_S)
            if thread.is_alive():
                logger.error("nccl: ncclCommAbort on %s still runs after %g s; abandoned",
                             self.device, _DRAIN_GRACE_S)
                return
        for stream in (self.comm_stream, self.copy_stream):
            while not stream.query():
                if time.monotonic() > end:
                    logger.error("nccl: a stream of %s still runs %g s after the abort",
                                 self.device, _DRAIN_GRACE_S)
                    return
                time.sleep(1e-4)


def _run_bounded(fn, deadline: Deadline, what: str):
    """Runs fn() on a helper thread; MigrationError when it is not done by the deadline (the
    thread is then abandoned: a blocking NCCL set-up cannot be interrupted)."""
    result: Dict[str, Any] = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=target, name="nccl-setup", daemon=True)
    thread.start()
    thread.join(max(deadline.remaining(), 0))
    if thread.is_alive():
        raise MigrationError(f"{what}: not complete at the deadline of {deadline.timeout:g} s "
                             "(peer gone?)")
    if "error" in result:
        raise MigrationError(f"{what}: {result['error']}") from result["error"]
    return result["value"]


def _join(cache, uid: bytes, rank: int, deadline: Deadline) -> int:
    """Joins the two-rank communicator and moves a few bytes source -> destination, so the
    connections exist before the first pull. Returns the comm."""
    device = cache.device

    def setup():
        torch.cuda.set_device(device)
        lib = _lib()
        comm = lib.init_rank(2, uid, rank)
        try:
            buf = torch.zeros(_WARMUP_BYTES, dtype=torch.uint8, device=device)
            stream = torch.cuda.current_stream(device)
            if rank == _SRC_RANK:
                lib.send(buf.data_ptr(), buf.numel(), _DST_RANK, comm, stream.cuda_stream)
            else:
                lib.recv(buf.data_ptr(), buf.numel(), _SRC_RANK, comm, stream.cuda_stream)
            event = torch.cuda.Event()
            event.record(stream)
            wait_cuda_event(event, deadline, "nccl warm-up")
        except BaseException:
            lib.abort(comm)
            raise
        return comm

    return _run_bounded(setup, deadline, "nccl communicator set-up")


class NcclBackend(PairedBackend):
    name = "nccl"

    def __init__(self, endpoint, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 copy_ctas: Optional[int] = None):
        super().__init__(endpoint)
        if int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes!r}")
        if copy_ctas is not None and not 0 <= int(copy_ctas) <= _MAX_CTAS:
            raise ValueError(f"copy_ctas: must be 0 (the whole GPU) to {_MAX_CTAS}, got {copy_ctas!r}")
        self.chunk_bytes = int(chunk_bytes)
        self.copy_ctas = None if copy_ctas is None else int(copy_ctas)

    @classmethod
    def is_available(cls):
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        try:
            _lib()
        except ImportError as e:
            return False, str(e)
        return True, ""

    def check_cache(self, cache) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"cache: on {cache.device}; the nccl backend moves CUDA caches "
                             "(use gloo for host caches)")

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> None:
        cache = self.endpoint.cache
        uid = _lib().unique_id()
        chunk_blocks = blocks_per_chunk(self.chunk_bytes, cache.block_nbytes)
        copy_ctas = self.copy_ctas
        if copy_ctas is None:
            sms = torch.cuda.get_device_properties(cache.device).multi_processor_count
            copy_ctas = _COPY_CTAS_PER_SM * sms
        link.request({"op": "nccl.connect", "uid": uid.hex(), "chunk_blocks": chunk_blocks,
                      "copy_ctas": copy_ctas,
                      "timeout": deadline.remaining()})
        link.conn.recv_reply(deadline, "nccl connect")
        comm = _join(cache, uid, _DST_RANK, deadline)
        link.state["pair"] = _Pair(comm, cache, chunk_blocks, copy_ctas)

    def pull(self, link, src_ids, dst_ids, deadline: Deadline) -> PullStats:
        from .. import ops
        from .endpoint import wait_for_data

        pair: _Pair = link.state["pair"]
        cache = self.endpoint.cache
        lib = _lib()
        n = len(src_ids)
        chunks = pair.chunks(n)
        # The request goes first: the source gathers while this side queues its receives.
        link.request({"op": "nccl.pull", "n": n, "timeout": deadline.remaining()},
                     encode_ids(src_ids))
        try:
            with torch.cuda.device(pair.device):
                follow_current_stream(pair.copy_stream, pair.entry, pair.device)
                with torch.cuda.stream(pair.copy_stream):
                    (ids,) = pair.ids.upload(dst_ids, deadline=deadline)
                    for c, (lo, hi) in enumerate(chunks):
                        slot = c % 2
                        rows = pair.slots[slot][:hi - lo]
                        if c >= 2:  # the slot's previous chunk is scattered
                            pair.comm_stream.wait_event(pair.copied[slot])
                        lib.recv(rows.data_ptr(), rows.numel(), _SRC_RANK, pair.comm,
                                 pair.comm_stream.cuda_stream)
                        pair.moved[slot].record(pair.comm_stream)
                        pair.copy_stream.wait_event(pair.moved[slot])
                        ops._scatter_prechecked(rows, cache, ids[lo:hi], pair.device, pair.copy_ctas)
                        pair.copied[slot].record(pair.copy_stream)
                    pair.done.record(pair.copy_stream)
            wait_for_data(link, pair.done.query, deadline, "nccl pull")
            # The caller's streams see the blocks: the pull returns after `done` completed.
        except BaseException:
            pair.abort()
            raise
        return PullStats(self.name, n, n * cache.block_nbytes, 0.0, chunks=len(chunks))

    def discard(self, link) -> None:
        pair = link.state.pop("pair", None)
        if pair is not None:
            pair.abort()

    # ---- source side ---------------------------------------------------------------------
    def serve(self, conn, op: str, header: Dict[str, Any], payload: bytes) -> None:
        if op == "nccl.connect":
            self._serve_connect(conn, header)
        elif op == "nccl.pull":
            self._serve_pull(conn, header, payload)
        else:
            super().serve(conn, op, header, payload)

    def _serve_connect(self, conn, header) -> None:
        deadline = Deadline(float(header["timeout"]))
        uid = bytes.fromhex(str(header["uid"]))
        chunk_blocks, copy_ctas = int(header["chunk_blocks"]), int(header["copy_ctas"])
        if len(uid) != 128 or chunk_blocks < 1 or not 0 <= copy_ctas <= _MAX_CTAS:
            raise ValueError(f"nccl connect: uid of {len(uid)} bytes, chunk_blocks {chunk_blocks}, "
                             f"copy_ctas {copy_ctas}")
        cache = self.endpoint.cache
        conn.reply_ok()
        comm = _join(cache, uid, _SRC_RANK, deadline)
        self.adopt(conn, _Pair(comm, cache, chunk_blocks, copy_ctas))

    def _serve_pull(self, conn, header, payload) -> None:
        from .. import ops

        cache = self.endpoint.cache
        deadline, src_ids, pair = self.pull_request(conn, header, payload)
        n = len(src_ids)
        lib = _lib()
        try:
            # No wait for other streams: like ipc, a source offers blocks whose writes are
            # complete (the engine's stream belongs to another thread anyway).
            with torch.cuda.device(pair.device):
                with torch.cuda.stream(pair.copy_stream):
                    (ids,) = pair.ids.upload(src_ids, deadline=deadline)
                    for c, (lo, hi) in enumerate(pair.chunks(n)):
                        slot = c % 2
                        rows = pair.slots[slot][:hi - lo]
                        if c >= 2:  # the slot's previous chunk is sent
                            pair.copy_stream.wait_event(pair.moved[slot])
                        ops._gather_prechecked(cache, ids[lo:hi], rows, pair.device, pair.copy_ctas)
                        pair.copied[slot].record(pair.copy_stream)
                        pair.comm_stream.wait_event(pair.copied[slot])
                        self.endpoint.test_pause(c)
                        lib.send(rows.data_ptr(), rows.numel(), _DST_RANK, pair.comm,
                                 pair.comm_stream.cuda_stream)
                        pair.moved[slot].record(pair.comm_stream)
                pair.done.record(pair.comm_stream)
            # Accepted: said after the launches, so the reply is off the data's path.
            conn.reply_ok()

            def check() -> None:
                if conn.closed_by_peer():
                    raise MigrationError("nccl send: the destination closed the connection")

            wait_cuda_event(pair.done, deadline, "nccl send", check)
        except BaseException:
            self.release(conn)
            raise

    def retire(self, pair) -> None:
        pair.abort()

