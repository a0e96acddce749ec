"""nccl: blocks cross GPU-to-GPU (NVLink, PCIe or the network) through NCCL send/recv, staged in
GPU memory.

Pairwise communicators: the destination makes an NCCL unique id and sends it over the control
channel; both sides join a two-rank communicator (rank 0 = destination, 1 = source) used for
pulls in that direction only, cached per peer. No third instance and no global group are ever
involved, so instances join and leave freely (each communicator costs NCCL buffers, tens of
MB of GPU memory).

Pipeline, in chunks of about `chunk_bytes` with two staging slots per side, four streams:

    source:       gather c+1 (gather stream)   | ncclSend c (send stream)
    destination:  ncclRecv c+1 (recv stream)   | scatter c (scatter stream)

Everything is enqueued up front with events between the streams; the host then polls one
event against the deadline. NCCL kernels wait forever for a peer that is gone, so on the
deadline (or when the control connection reports the peer's failure or exit) the side aborts
its communicator (ncclCommAbort ends the kernels), drains its streams, discards the pair, and
the next pull builds a new one. Communicator set-up runs on a helper thread joined with the
deadline; a set-up that never completes is abandoned.

Options: chunk_bytes (default 32 MiB).
"""

import logging
import threading
import time
from typing import Any, Dict

import torch

from .base import (
    Deadline,
    MigrationBackend,
    MigrationError,
    PullStats,
    blocks_per_chunk,
    check_block_ids,
    chunk_ranges,
    wait_cuda_event,
)
from .control import decode_ids, encode_ids

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 32 << 20
_DST_RANK, _SRC_RANK = 0, 1
_DRAIN_GRACE_S = 5.0
_WARMUP_BYTES = 4096


def _lib():
    from . import _nccl_lib

    return _nccl_lib.library()


class _Pair:
    """One side of a two-rank communicator plus its staging slots, streams and events."""

    def __init__(self, comm: int, cache, chunk_blocks: int):
        self.comm = comm
        self.device = cache.device
        self.chunk_blocks = chunk_blocks
        self.slots = [torch.empty((chunk_blocks, cache.block_nbytes), dtype=torch.uint8,
                                  device=cache.device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(cache.device)  # gather or scatter
        self.comm_stream = torch.cuda.Stream(cache.device)  # send or recv
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.moved = [torch.cuda.Event() for _ in range(2)]
        self.aborted = False

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


class NcclBackend(MigrationBackend):
    name = "nccl"

    def __init__(self, endpoint, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(endpoint)
        if int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes!r}")
        self.chunk_bytes = int(chunk_bytes)
        self._serving: Dict[int, _Pair] = {}  # source side: live pairs (each in a conn.state)
        self._lock = threading.Lock()

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
        link.request({"op": "nccl.connect", "uid": uid.hex(), "chunk_blocks": chunk_blocks,
                      "timeout": deadline.remaining()})
        link.conn.recv_reply(deadline, "nccl connect")
        comm = _join(cache, uid, _DST_RANK, deadline)
        link.state["pair"] = _Pair(comm, cache, chunk_blocks)

    def pull(self, link, src_ids, dst_ids, deadline: Deadline) -> PullStats:
        from .endpoint import wait_for_data

        pair: _Pair = link.state["pair"]
        cache = self.endpoint.cache
        lib = _lib()
        n = len(src_ids)
        chunks = chunk_ranges(n, pair.chunk_blocks)
        link.request({"op": "nccl.pull", "n": n, "timeout": deadline.remaining()},
                     encode_ids(src_ids))
        try:
            with torch.cuda.device(pair.device):
                ids = torch.tensor(dst_ids, dtype=torch.int64, pin_memory=True)
                ids = ids.to(pair.device, non_blocking=True)  # on the current stream
                pair.copy_stream.wait_stream(torch.cuda.current_stream(pair.device))
                for c, (lo, hi) in enumerate(chunks):
                    slot = c % 2
                    rows = pair.slots[slot][:hi - lo]
                    if c >= 2:  # the slot's previous chunk is scattered
                        pair.comm_stream.wait_event(pair.copied[slot])
                    lib.recv(rows.data_ptr(), rows.numel(), _SRC_RANK, pair.comm,
                             pair.comm_stream.cuda_stream)
                    pair.moved[slot].record(pair.comm_stream)
                    pair.copy_stream.wait_event(pair.moved[slot])
                    with torch.cuda.stream(pair.copy_stream):
                        _ops().scatter_blocks(rows, cache, ids[lo:hi], check_ids=False)
                    pair.copied[slot].record(pair.copy_stream)
                done = torch.cuda.Event()
                done.record(pair.copy_stream)
            wait_for_data(link, done.query, deadline, "nccl pull")
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
        chunk_blocks = int(header["chunk_blocks"])
        if len(uid) != 128 or chunk_blocks < 1:
            raise ValueError(f"nccl connect: uid of {len(uid)} bytes, chunk_blocks {chunk_blocks}")
        cache = self.endpoint.cache
        conn.reply_ok()
        comm = _join(cache, uid, _SRC_RANK, deadline)
        pair = _Pair(comm, cache, chunk_blocks)
        self._release(conn)
        with self._lock:
            self._serving[id(pair)] = pair
        conn.state["pair"] = pair

    def _serve_pull(self, conn, header, payload) -> None:
        cache = self.endpoint.cache
        deadline = Deadline(float(header["timeout"]))
        n = int(header["n"])
        src_ids = check_block_ids(decode_ids(payload, n, "src_block_ids"), "src_block_ids",
                                  cache.num_blocks, unique=False)
        pair = conn.state.get("pair")
        if pair is None:
            raise ValueError("nccl pull: no communicator with this peer (connect first)")
        conn.reply_ok()
        lib = _lib()
        try:
            with torch.cuda.device(pair.device):
                ids = torch.tensor(src_ids, dtype=torch.int64, pin_memory=True)
                ids = ids.to(pair.device, non_blocking=True)
                # Blocks written on this thread's stream before the request are gathered too.
                pair.copy_stream.wait_stream(torch.cuda.current_stream(pair.device))
                for c, (lo, hi) in enumerate(chunk_ranges(n, pair.chunk_blocks)):
                    slot = c % 2
                    rows = pair.slots[slot][:hi - lo]
                    if c >= 2:  # the slot's previous chunk is sent
                        pair.copy_stream.wait_event(pair.moved[slot])
                    with torch.cuda.stream(pair.copy_stream):
                        _ops().gather_blocks(cache, ids[lo:hi], out=rows, check_ids=False)
                    pair.copied[slot].record(pair.copy_stream)
                    pair.comm_stream.wait_event(pair.copied[slot])
                    self.endpoint.test_pause(c)
                    lib.send(rows.data_ptr(), rows.numel(), _DST_RANK, pair.comm,
                             pair.comm_stream.cuda_stream)
                    pair.moved[slot].record(pair.comm_stream)
                done = torch.cuda.Event()
                done.record(pair.comm_stream)

            def check() -> None:
                if conn.closed_by_peer():
                    raise MigrationError("nccl send: the destination closed the connection")

            wait_cuda_event(done, deadline, "nccl send", check)
        except BaseException:
            self._release(conn)
            raise

    def _release(self, conn) -> None:
        pair = conn.state.pop("pair", None)
        if pair is not None:
            with self._lock:
                self._serving.pop(id(pair), None)
            pair.abort()

    def connection_closed(self, conn) -> None:
        self._release(conn)

    def close(self) -> None:
        with self._lock:
            pairs = list(self._serving.values())
            self._serving.clear()
        for pair in pairs:
            pair.abort()


def _ops():
    from .. import ops

    return ops

