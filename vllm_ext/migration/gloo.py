"""gloo: blocks cross TCP through torch.distributed's gloo, staged in (pinned) host memory; for
hosts without a GPU interconnect, and for CPU caches.

Per pair, the destination creates a private TCPStore and `stripes` two-rank gloo process
groups (rank 0 = destination, 1 = source), each with its own device and so its own TCP
connection and I/O thread, so several streams run in parallel (benchmarks/TUNING.md). The
store listens only on the destination's address of the authenticated control connection, and
the source connects to that same peer address (no address travels in a message). A pull is
cut into chunks of about `chunk_bytes`; each chunk into `stripes` byte ranges, one per group.
Two staging slots per side pipeline the stages:

    source:       gather c+1, copy to host    | send c (stripes in parallel)
    destination:  receive c+1                 | copy to GPU, scatter c

A CUDA cache stages through its GPU: the kernel gathers into a device slot and the copy engine
moves the slot to pinned host memory (and back on the other side).

Both sides wait for their gloo operations on helper threads and watch the control connection
meanwhile, so a peer that dies, reports a failure or closes its endpoint ends the transfer
within _WATCH_S, not at its deadline. A pull's wait follows the source's progress: the source
sends `gloo.progress` at least every _PROGRESS_S while it serves, and each of those, its accept
and each chunk received moves the pull's deadline to the pull's timeout from then, up to
_PATIENCE times that timeout from its start; so a source slowed down by a busy host (a forward
beside it taking the cores) is waited for while it answers, and a silent one (stopped, hung) still
fails the pull one timeout after its last sign of life. A pair that failed midway is parked (a
gloo group's destructor can wait for its pending operations) and rebuilt on the next pull; an idle
pair that ends is freed at once.

Options: stripes (default: a quarter of the cores, 1..8), chunk_bytes (default 16 MiB).
"""

import concurrent.futures
import datetime
import logging
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from ..errors import MigrationError
from . import protocol
from .base import (
    IdStaging,
    MigrationBackend,
    Pair,
    PullStats,
    blocks_per_chunk,
    check_slot,
    chunk_ranges,
    follow_current_stream,
    wait_cuda_event,
    watch_closed,
)
from .control import check_reply
from .protocol import encode_ids
from .timing import MAX_TIMEOUT_S, Deadline

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20
_DST_RANK, _SRC_RANK = 0, 1
_STRIPE_ALIGN = 4096
_DRAIN_S = 1.0
_MAX_PARKED = 16  # failed pairs kept; the oldest is let go beyond this (its operations have timed out)
_WATCH_S = 0.05  # the longest wait between two looks at the peer's control connection
_PROGRESS_S = 1.0  # a serving source's longest silence (gloo.progress) while it has not failed
PATIENCE = 6.0  # a pull that makes progress is waited for at most this many times its timeout
_PATIENCE = PATIENCE


def default_stripes() -> int:
    return max(1, min(protocol.MAX_STRIPES, (os.cpu_count() or 1) // 4))


def _seconds(deadline: Deadline) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline.remaining(), 1e-3))


class _Staging:
    """One side's half of a pair: the gloo groups and the staging slots (host; for a CUDA cache
    also device slots, a stream and the events that order them)."""

    def __init__(self, store, groups, chunk_blocks: int, stripes: int, cache):
        self.store = store
        self.groups = groups
        self.chunk_blocks = chunk_blocks
        self.stripes = stripes
        cuda = cache.device.type == "cuda"
        shape = (chunk_blocks, cache.block_nbytes)
        self.slots = [torch.empty(shape, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(cache.device) if cuda else None
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # source: send threads
        self.ended = False
        # A transfer was started on the groups and has not completed: gloo may still have
        # operations pending on them, so an ended pair is parked rather than destroyed.
        self.busy = False
        self._lock = threading.Lock()
        if cuda:
            with torch.cuda.stream(self.stream):  # freed in the order of the stream that uses them
                self.dev_slots = [torch.empty(shape, dtype=torch.uint8, device=cache.device) for _ in range(2)]
            self.staged = [torch.cuda.Event() for _ in range(2)]  # host slot copied
            self.entry = torch.cuda.Event()  # the caller's stream, when a pull starts
            self.done = torch.cuda.Event()
            self.ids = IdStaging(cache.device)

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self.ended:
                raise MigrationError("gloo: the pair was closed (the peer left?)")
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * self.stripes,
                                                                  thread_name_prefix="gloo-stripe")
            return self.pool.submit(fn, *args)

    def send_stripes(self, slot: int, nblocks: int, tag: int, deadline: Deadline, row_nbytes: int) -> list:
        """Sends the stripes of a slot's first nblocks rows, each from its own thread: gloo
        writes a send inline when the receive is already posted, so sends posted from one
        thread would run one after the other. Returns futures."""
        def send(group, piece):
            group.send([piece], _DST_RANK, tag).wait(_seconds(deadline))

        pieces = self.pieces(slot, nblocks, row_nbytes)
        return [self._submit(send, g, piece) for g, piece in zip(self.groups, pieces)]

    def recv_stripes(self, slot: int, nblocks: int, tag: int, deadline: Deadline, row_nbytes: int) -> list:
        """Posts the receives of a slot's first nblocks rows; futures that complete with them.
        The waits run on helper threads: a gloo wait cut short by a timeout cancels its
        operation, so the caller polls the futures and watches the control connection."""
        pieces = self.pieces(slot, nblocks, row_nbytes)
        works = [g.recv([piece], _SRC_RANK, tag) for g, piece in zip(self.groups, pieces)]
        return [self._submit(work.wait, _seconds(deadline)) for work in works]

    def chunks(self, n: int):
        """The pull's chunks; both sides derive them from n alone."""
        return chunk_ranges(n, self.chunk_blocks)

    @staticmethod
    def rows(slots: List[torch.Tensor], slot: int, nblocks: int, row_nbytes: int) -> torch.Tensor:
        """The first nblocks rows of a slot, rows of row_nbytes (a block's, or a head range's:
        cache.buffer_row_nbytes; never more than the slot's row) laid end to end."""
        return slots[slot].view(-1)[:nblocks * row_nbytes].view(nblocks, row_nbytes)

    def pieces(self, slot: int, nblocks: int, row_nbytes: int) -> List[torch.Tensor]:
        """The stripe views of the first nblocks rows (of row_nbytes) of a slot."""
        flat = self.rows(self.slots, slot, nblocks, row_nbytes).view(-1)
        n = flat.numel()
        step = -(-n // self.stripes)
        step = -(-step // _STRIPE_ALIGN) * _STRIPE_ALIGN
        return [flat[lo:min(lo + step, n)] for lo in range(0, n, step)]

    def end(self) -> bool:
        """Stops the send threads (queued sends are dropped) and, once the GPU is done with
        them, frees the device slots. An idle pair also drops its groups, store and host slots
        (their connections, threads and pinned memory go at once); True then. A busy one keeps
        them (gloo may still write the host slots until its operations time out): False, and
        the owner parks it."""
        with self._lock:
            self.ended = True
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.stream is not None and getattr(self, "dev_slots", None) is not None:
            end = time.monotonic() + _DRAIN_S
            while not self.stream.query():
                if time.monotonic() > end:
                    return False  # still running: keep everything
                time.sleep(1e-4)
            self.dev_slots = None
            self.ids = None
        if self.busy:
            return False
        self.groups, self.store, self.slots = [], None, []
        return True


def _make_groups(store, rank: int, stripes: int, host: str, gen: str, deadline: Deadline):
    from torch.distributed import PrefixStore, ProcessGroupGloo

    groups = []
    for s in range(stripes):
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = _seconds(deadline)  # bounds the connection set-up
        groups.append(ProcessGroupGloo(PrefixStore(f"{gen}/{s}", store), rank, 2, options))
    return groups


def _listening_store(address: str, deadline: Deadline):
    """A TCPStore server listening on `address` only (never on all interfaces)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen()
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the listening descriptor from here on (it closes it).
    return TCPStore(address, port, 2, True, timeout=_seconds(deadline), wait_for_workers=False,
                    master_listen_fd=listener.detach())


class _Progress:
    """The destination's wait for a source that makes progress: `deadline` (the pull's) moves to
    its timeout from each sign of the source's life (`alive`), never past `hard` (_PATIENCE times
    the timeout from the start)."""

    def __init__(self, deadline: Deadline):
        self.deadline = deadline
        self.silence = deadline.timeout
        self.hard = Deadline(min(deadline.timeout * _PATIENCE, MAX_TIMEOUT_S))  # as the source's

    def alive(self) -> None:
        self.deadline.at = max(self.deadline.at, min(time.monotonic() + self.silence, self.hard.at))

    def watch(self, conn, what: str):
        """A check for _wait: a gloo.progress from the source is a sign of life; any other message
        (a failure's report, closing) or the connection's end raises, as watch_connection's."""
        def check() -> None:
            while conn.readable():
                header, _ = conn.recv(Deadline(1.0))  # EOF raises MigrationError
                if header.get("op") == protocol.GlooProgress.op:
                    self.alive()
                    continue
                check_reply(header, conn.peer, what)
                raise MigrationError(f"{what}: an unexpected message from the peer ({conn.peer})")

        return check


class _Heartbeat:
    """The source's side of _Progress: gloo.progress on the control connection, at most every
    _PROGRESS_S, from the thread that serves the pull."""

    def __init__(self, conn, deadline: Deadline):
        self.conn, self.deadline = conn, deadline
        self.last = time.monotonic()

    def beat(self) -> None:
        if time.monotonic() - self.last >= _PROGRESS_S:
            self.conn.send_message(protocol.GlooProgress(), b"", self.deadline)
            self.last = time.monotonic()


def _wait(futures, deadline: Deadline, what: str, watch) -> None:
    """Waits for the futures of gloo operations, running `watch` (a look at the peer's control
    connection) at least every _WATCH_S; MigrationError on a failure, the peer's report or exit,
    or the deadline. It sleeps on the futures (no spinning: a small host's cores belong to
    gloo's I/O threads) and wakes as soon as they are done."""
    pending = set(futures)
    while pending:
        watch()
        remaining = deadline.remaining()
        if remaining <= 0:
            raise MigrationError(f"{what}: not complete at the deadline of {deadline.timeout:g} s")
        _, pending = concurrent.futures.wait(pending, timeout=min(remaining, _WATCH_S))
    for future in futures:
        try:
            future.result(timeout=0)
        except MigrationError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            raise MigrationError(f"{what}: {e}") from e


class _GlooPair(Pair):
    """The destination's pair: receives chunks and scatters them."""

    def __init__(self, backend: "GlooBackend", link, staging: _Staging):
        self.backend = backend
        self.link = link
        self.staging = staging

    def pull(self, src_ids, dst_ids, deadline: Deadline, heads=None) -> PullStats:
        from .. import ops

        pair, conn = self.staging, self.link.conn
        cache = self.backend.cache
        n = len(src_ids)
        chunks = pair.chunks(n)
        src_part, part = heads or (None, None)  # a head range: rows of its heads alone
        row = cache.block_nbytes if part is None else cache.num_layers * cache.num_components * part.slice_nbytes
        pair.busy = True  # until the last chunk is in: a failure parks the pair
        progress = _Progress(deadline)
        wanted = [] if src_part is None else [src_part.first, src_part.count]
        self.link.request(protocol.GlooPull(n, deadline.remaining(), wanted), deadline, encode_ids(src_ids))
        cuda = pair.stream is not None
        if cuda:
            follow_current_stream(pair.stream, pair.entry, cache.device)
            with torch.cuda.stream(pair.stream):
                (dst_dev,) = pair.ids.upload(dst_ids, deadline=deadline)
        pending: Dict[int, list] = {}

        def post(c: int) -> None:
            lo, hi = chunks[c]
            slot = c % 2
            if cuda:  # the slot's previous chunk must have left for the GPU (done at once if none)
                wait_cuda_event(pair.staged[slot], deadline, "gloo copy to the GPU")
            pending[c] = pair.recv_stripes(slot, hi - lo, c, progress.hard, row)  # _wait holds `deadline`

        post(0)
        if len(chunks) > 1:
            post(1)
        conn.recv_reply(deadline, "gloo pull")  # accepted (or refused: raises)
        progress.alive()
        watch = progress.watch(conn, "gloo pull")
        for c, (lo, hi) in enumerate(chunks):
            _wait(pending.pop(c), deadline, f"gloo receive of chunk {c}", watch)
            progress.alive()
            slot = c % 2
            rows = pair.rows(pair.slots, slot, hi - lo, row)
            if cuda:
                with torch.cuda.stream(pair.stream):
                    dev = pair.rows(pair.dev_slots, slot, hi - lo, row)
                    dev.copy_(rows, non_blocking=True)
                    pair.staged[slot].record(pair.stream)
                    ops._scatter_prechecked(dev, cache, dst_dev[lo:hi], cache.device, part=part)
            else:
                ops.scatter_blocks(rows, cache, dst_ids[lo:hi],
                                   heads=None if part is None else (part.first, part.count))
            if c + 2 < len(chunks):
                post(c + 2)
        if cuda:
            pair.done.record(pair.stream)
            wait_cuda_event(pair.done, deadline, "gloo scatter")
        pair.busy = False
        return PullStats(self.backend.name, n, n * row, 0.0, chunks=len(chunks))

    def abort(self) -> None:
        self.backend.end(self.staging)


class _ServedPair:
    """The source's pair of one destination connection."""

    def __init__(self, backend: "GlooBackend", staging: _Staging):
        self.backend = backend
        self.staging = staging

    def close(self) -> None:
        self.backend.end(self.staging)

    abort = close


class GlooBackend(MigrationBackend):
    name = "gloo"
    moves_head_ranges = True  # a pull may name a KV head range (gloo.pull's heads)

    def __init__(self, context, stripes: Optional[int] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(context)
        self.stripes = default_stripes() if stripes is None else int(stripes)
        if not 1 <= self.stripes <= protocol.MAX_STRIPES:
            raise ValueError(f"stripes: must be in 1..{protocol.MAX_STRIPES}, got {stripes!r}")
        if int(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes!r}")
        self.chunk_bytes = int(chunk_bytes)
        check_slot(blocks_per_chunk(self.chunk_bytes, context.cache.block_nbytes),
                   context.cache.block_nbytes, "chunk_bytes")
        self._parked: List[Any] = []  # failed pairs, kept alive (see module docstring)
        self._gen = 0
        self._lock = threading.Lock()

    @classmethod
    def is_available(cls):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return False, "this torch build has no gloo (torch.distributed.is_gloo_available())"
        return True, ""

    def check_cache(self, cache) -> None:
        if cache.device.type not in ("cpu", "cuda"):
            raise ValueError(f"cache: device {cache.device} is not supported by gloo")

    def end(self, staging: _Staging) -> None:
        if not staging.end():  # a transfer failed midway: parked, not destroyed
            with self._lock:
                self._parked.append(staging)
                del self._parked[:-_MAX_PARKED]

    def parked_count(self) -> int:
        with self._lock:
            return len(self._parked)

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> Pair:
        cache = self.cache
        address = link.conn.local_address()
        try:
            store = _listening_store(address, deadline)
        except (OSError, RuntimeError) as e:
            raise MigrationError(f"gloo connect: no store on {address}: {e}") from e
        with self._lock:
            self._gen += 1
            gen = f"{self.context.endpoint_id[:8]}-{self._gen}"
        chunk_blocks = blocks_per_chunk(self.chunk_bytes, cache.block_nbytes)
        link.request(protocol.GlooConnect(store.port, gen, self.stripes, chunk_blocks, deadline.remaining()),
                     deadline)
        link.conn.recv_reply(deadline, "gloo connect")
        try:
            groups = _make_groups(store, _DST_RANK, self.stripes, address, gen, deadline)
        except RuntimeError as e:
            raise MigrationError(f"gloo connect: building the groups failed: {e}") from e
        return _GlooPair(self, link, _Staging(store, groups, chunk_blocks, self.stripes, cache))

    # ---- source side ---------------------------------------------------------------------
    def serve(self, session, request, payload) -> bool:
        if isinstance(request, protocol.GlooConnect):
            self._serve_connect(session, request)
        elif isinstance(request, protocol.GlooPull):
            self._serve_pull(session, request, payload)
        else:
            return super().serve(session, request, payload)
        return False

    def _serve_connect(self, session, request: protocol.GlooConnect) -> None:
        from torch.distributed import TCPStore

        check_slot(request.chunk_blocks, self.cache.block_nbytes, "gloo connect")
        deadline = Deadline(request.timeout)
        conn = session.conn
        self.session_closed(session)  # a reconnect replaces the old pair
        conn.reply_ok()
        try:
            # The authenticated peer's own address: never one a message names.
            store = TCPStore(conn.peer_address(), request.store_port, 2, False, timeout=_seconds(deadline))
            self.context.faults.pause("connect")
            groups = _make_groups(store, _SRC_RANK, request.stripes, conn.local_address(), request.gen, deadline)
        except RuntimeError as e:
            raise MigrationError(f"gloo connect: joining the peer's groups failed: {e}") from e
        session.pair = _ServedPair(self, _Staging(store, groups, request.chunk_blocks, request.stripes, self.cache))

    def _serve_pull(self, session, request: protocol.GlooPull, payload: bytes) -> None:
        from .._ids import check_id_values

        # the destination waits up to _PATIENCE times its timeout for a source that makes progress
        deadline = Deadline(min(request.timeout * _PATIENCE, MAX_TIMEOUT_S))
        src_ids = protocol.decode_ids(payload, request.n, "src_block_ids")
        check_id_values(src_ids, "src_block_ids", self.cache.num_blocks, False)
        if self.context.grants is not None:
            self.context.grants.check(src_ids)
        if session.pair is None:
            raise ValueError("gloo pull: no data path with this peer (connect first)")
        part = self._served_heads(session, request)
        staging = session.pair.staging
        session.conn.reply_ok()
        staging.busy = True  # until every send completed: a failure parks the pair
        try:
            self._send_blocks(staging, src_ids, deadline, session.conn, part)
        except BaseException:
            self.session_closed(session)
            raise
        staging.busy = False

    def _served_heads(self, session, request: protocol.GlooPull):
        """The head range a pull names (cache.HeadPart), None for whole blocks; ValueError (a
        refusal) for a range outside this cache's heads, or whole blocks for a destination of
        another head count (its rows would not be this cache's)."""
        if request.heads:
            return self.cache.head_part(tuple(request.heads), "gloo pull: heads")
        theirs = session.peer_geometry.get("num_kv_heads", self.cache.num_kv_heads)
        if theirs != self.cache.num_kv_heads:
            raise ValueError(f"gloo pull: whole blocks of {self.cache.num_kv_heads} KV heads for a cache of "
                             f"{theirs}; name a head range")
        return None

    def _send_blocks(self, pair: _Staging, src_ids: List[int], deadline: Deadline, conn, part=None) -> None:
        from .. import ops

        cache = self.cache
        row = cache.block_nbytes if part is None else cache.num_layers * cache.num_components * part.slice_nbytes
        chunks = pair.chunks(len(src_ids))
        cuda = pair.stream is not None
        if cuda:  # read at once: a source offers blocks whose writes are complete
            with torch.cuda.stream(pair.stream):
                (src_dev,) = pair.ids.upload(src_ids, deadline=deadline)
        in_flight: Dict[int, list] = {}
        closed, heartbeat = watch_closed(conn, "gloo send"), _Heartbeat(conn, deadline)

        def watch() -> None:
            closed()
            heartbeat.beat()

        for c, (lo, hi) in enumerate(chunks):
            slot = c % 2
            heartbeat.beat()
            if c >= 2:
                _wait(in_flight.pop(c - 2), deadline, f"gloo send of chunk {c - 2}", watch)
            rows = pair.rows(pair.slots, slot, hi - lo, row)
            if cuda:
                with torch.cuda.stream(pair.stream):
                    dev = pair.rows(pair.dev_slots, slot, hi - lo, row)
                    ops._gather_prechecked(cache, src_dev[lo:hi], dev, cache.device, part=part)
                    rows.copy_(dev, non_blocking=True)
                    pair.staged[slot].record(pair.stream)
                wait_cuda_event(pair.staged[slot], deadline, "gloo copy to the host")
            else:
                ops.gather_blocks(cache, src_ids[lo:hi], out=rows,
                                  heads=None if part is None else (part.first, part.count))
            self.context.faults.pause(c)
            in_flight[c] = pair.send_stripes(slot, hi - lo, c, deadline, row)
        for c in sorted(in_flight):
            _wait(in_flight[c], deadline, f"gloo send of chunk {c}", watch)

    def close(self) -> None:
        with self._lock:
            self._parked.clear()
