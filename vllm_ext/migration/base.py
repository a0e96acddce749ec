"""The contract every migration backend implements, and what they share: errors, the peer
descriptor, pull statistics, block-id validation and deadlines.

Roles. Two endpoints take part in a pull: the *destination* (the one whose `pull` was called;
it drives) and the *source* (it serves its blocks). Each endpoint runs a small control server
(see control.py); a backend adds its own data path beside it. Who calls what:

  Destination side, on the thread that called MigrationEndpoint.pull (or .connect):
    connect(link, deadline)        once per peer (and again after a failure): build the pair's
                                   data path (communicator, IPC mapping, ...).
    pull(link, src_ids, dst_ids, deadline) -> PullStats
                                   move the blocks; raise MigrationError on any failure.
    discard(link)                  forget the pair's state after a failure; the next pull
                                   connects again.
  Source side, on the control server's thread for that peer's connection:
    serve(conn, op, header, payload)
                                   one request from a peer's destination side; answers on
                                   `conn` and moves the data of its half of the transfer.
                                   Per-pair state lives in `conn.state` (a destination that
                                   reconnects gets a new connection and fresh state). A backend
                                   that sets conn.state["handed_off"] has served the connection
                                   to its end when serve returns (nccl's pull server).
    connection_closed(conn)        the peer's control connection ended: free conn.state.
  Either side:
    close()                        the endpoint is closing.
    is_available() (classmethod)   (True, "") or (False, why): checked before construction.
"""

import abc
import array
import ctypes
import dataclasses
import math
import threading
import time
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

from .._ids import check_id_values

__all__ = [
    "MigrationError",
    "PeerDescriptor",
    "PullStats",
    "MigrationBackend",
    "PairedBackend",
    "Deadline",
    "check_block_ids",
    "IdStaging",
]


class MigrationError(RuntimeError):
    """A pull (or connect) failed: the peer died, stalled past the deadline, refused the
    request, or the data path broke. The destination blocks `dst_block_ids` hold undefined
    data (some may have been partly written); `dst_block_ids` is None for connect and
    disconnect. The source's cache was only read. The endpoint stays usable: the failed
    pair's data path is discarded and rebuilt on the next pull or connect.

    Bad arguments found before any transfer raise ValueError or TypeError instead; a request
    the *source* refuses arrives here as MigrationError with `remote_type` set to the name
    of the exception the source raised ("ValueError", ...).
    """

    def __init__(self, message: str, *, peer: Optional[str] = None,
                 dst_block_ids: Optional[Sequence[int]] = None,
                 remote_type: Optional[str] = None):
        if dst_block_ids is not None:
            message = (f"{message} [destination blocks not written: "
                       f"{_short_list(list(dst_block_ids))}]")
        super().__init__(message)
        self.peer = peer
        self.dst_block_ids = None if dst_block_ids is None else list(dst_block_ids)
        self.written = False
        self.remote_type = remote_type


def _short_list(values: List[int], limit: int = 16) -> str:
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} ids)]"


@dataclasses.dataclass(frozen=True)
class PeerDescriptor:
    """How peers reach an endpoint: small and picklable; pass it to the other instance by any
    means (a Ray call, a scheduler message) and hand it to that instance's `pull`."""

    endpoint_id: str  # unique per endpoint (uuid hex)
    backend: str
    host: str  # control channel address
    port: int
    hostname: str  # socket.gethostname() of the process, for same-host checks
    pid: int
    geometry: Dict[str, Any]  # KVCache.geometry() of the endpoint's cache
    num_blocks: int
    layout: str
    device: str  # "cpu" or "cuda:N"
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # backend-specific
    # The control server's abstract Unix socket ("" = none): peers on the same host try it
    # before TCP (a few us per message instead of tens).
    local: str = ""

    def short(self) -> str:
        return f"{self.backend} endpoint {self.endpoint_id[:8]} at {self.host}:{self.port}"


@dataclasses.dataclass
class PullStats:
    """What one pull moved and how long it took (seconds are wall time on the destination,
    from the call to the blocks being written and visible to the caller's streams)."""

    backend: str
    num_blocks: int
    nbytes: int
    seconds: float
    chunks: int = 1
    stages: Dict[str, float] = dataclasses.field(default_factory=dict)  # per-stage seconds

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


MAX_TIMEOUT_S = 1e6  # 11.6 days: "no timeout" in practice, and within every wait's range


def check_timeout(timeout, zero_ok: bool = False) -> None:
    """ValueError unless `timeout` is a number of seconds in (0, MAX_TIMEOUT_S] (with
    `zero_ok`, [0, MAX_TIMEOUT_S]); NaN and inf are refused."""
    if (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            and (0 <= timeout if zero_ok else 0 < timeout) and timeout <= MAX_TIMEOUT_S):
        return
    if zero_ok:
        raise ValueError(f"timeout: must be 0 to {MAX_TIMEOUT_S:g} seconds, got {timeout!r}")
    raise ValueError(f"timeout: must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, "
                     f"got {timeout!r}")


class Deadline:
    """An absolute point in time.monotonic(); every blocking wait takes its remaining time."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float):
        check_timeout(timeout)
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def check_block_ids(ids, name: str, num_blocks: int, *, unique: bool) -> List[int]:
    """Validated ids as a list of Python ints; raises TypeError/ValueError naming `name`."""
    if type(ids) is list and all(type(v) is int for v in ids):  # the common case, at C speed
        check_id_values(ids, name, num_blocks, unique)
        return list(ids)
    import torch

    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of ids, got shape {list(ids.shape)}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name}: dtype {ids.dtype}, expected an integer dtype")
        values = ids.tolist()
    else:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"{name}: expected a list or 1-D tensor of ints, got "
                            f"{type(ids).__name__}")
        values = []
        for v in ids:
            if isinstance(v, bool) or isinstance(v, float) or not hasattr(v, "__index__"):
                raise TypeError(f"{name}: {v!r} is not an int")
            values.append(v.__index__())
    check_id_values(values, name, num_blocks, unique)
    return values


def geometry_mismatch(mine: Dict[str, Any], theirs: Dict[str, Any]) -> Optional[str]:
    """None when two caches can exchange blocks, else a description of the difference."""
    if mine == theirs:
        return None
    keys = sorted(set(mine) | set(theirs))
    return ", ".join(f"{k} {mine.get(k)!r} here vs {theirs.get(k)!r} at the peer"
                     for k in keys if mine.get(k) != theirs.get(k))


class MigrationBackend(abc.ABC):
    """One way of moving blocks between two endpoints. Instances belong to one endpoint;
    `self.endpoint.cache` is the local KVCache. See the module docstring for who calls each
    method and on which thread."""

    name: ClassVar[str] = ""
    # Whether descriptors of two endpoints must come from one host (ipc).
    same_host_only: ClassVar[bool] = False
    # Whether the peer must be another process (ipc: CUDA cannot map a process's own memory).
    other_process_only: ClassVar[bool] = False
    # Whether pulls use the endpoints' TCP control channel (rayrpc talks through Ray).
    uses_control_channel: ClassVar[bool] = True

    def __init__(self, endpoint, **options):
        self.endpoint = endpoint
        if options:
            raise TypeError(f"{self.name} backend: unknown options {sorted(options)}")

    @classmethod
    def is_available(cls) -> Tuple[bool, str]:
        """(True, "") when this process can use the backend, else (False, why)."""
        return True, ""

    def check_cache(self, cache) -> None:
        """Raises ValueError when the backend cannot serve this cache (e.g. ipc on a CPU
        cache). Called by the endpoint's constructor."""
        return  # optional hook: nothing to do by default

    def descriptor_extra(self) -> Dict[str, Any]:
        """Backend-specific fields peers need (go into PeerDescriptor.extra)."""
        return {}

    # ---- destination side ----------------------------------------------------------------
    def connect(self, link, deadline: Deadline) -> None:
        """Build the data path to `link.peer` (called before the first pull to a peer and
        after a discard)."""
        return  # optional hook: nothing to do by default

    @abc.abstractmethod
    def pull(self, link, src_ids: List[int], dst_ids: List[int],
             deadline: Deadline) -> PullStats:
        """Move blocks src_ids of the peer into dst_ids of the local cache. Ids are already
        validated on this side. Raise MigrationError on failure."""

    def discard(self, link) -> None:
        """Forget the pair's data path after a failure (must not block)."""
        return  # optional hook: nothing to do by default

    # ---- source side ---------------------------------------------------------------------
    def serve(self, conn, op: str, header: Dict[str, Any], payload: bytes) -> None:
        """Handle request `op` from a peer's destination side; reply on `conn`. Raising before
        replying refuses the request (the endpoint sends the error back)."""
        raise ValueError(f"{self.name} backend: unknown request {op!r}")

    def connection_closed(self, conn) -> None:
        """A destination's control connection ended: release `conn.state`."""
        return  # optional hook: nothing to do by default

    def close(self) -> None:
        """The endpoint is closing: release communicators, buffers, mappings."""
        return  # optional hook: nothing to do by default


class PairedBackend(MigrationBackend):
    """A backend whose source side keeps one data-path "pair" per destination (a communicator,
    gloo groups, staging slots) in that connection's state: the bookkeeping nccl and gloo
    share. Subclasses implement `_serve_connect` and `_serve_pull` (the requests
    "<name>.connect" and "<name>.pull") and `retire(pair)`, which ends a pair that is replaced,
    whose connection closed, whose endpoint closes, or (destination side) whose pull failed;
    it must not block for long."""

    def __init__(self, endpoint, **options):
        super().__init__(endpoint, **options)
        self._serving: Dict[int, Any] = {}  # source side: live pairs (each in a conn.state)
        self._lock = threading.Lock()

    @abc.abstractmethod
    def retire(self, pair) -> None:
        """Ends a pair (see the class docstring); on the destination side too, after a failure."""

    @abc.abstractmethod
    def _serve_connect(self, conn, header: Dict[str, Any]) -> None:
        """Source side of "<name>.connect": build this side of the pair and adopt it."""

    @abc.abstractmethod
    def _serve_pull(self, conn, header: Dict[str, Any], payload: bytes) -> None:
        """Source side of "<name>.pull": send the requested blocks."""

    def serve(self, conn, op: str, header: Dict[str, Any], payload: bytes) -> None:
        if op == f"{self.name}.connect":
            self._serve_connect(conn, header)
        elif op == f"{self.name}.pull":
            self._serve_pull(conn, header, payload)
        else:
            super().serve(conn, op, header, payload)

    def discard(self, link) -> None:
        pair = link.state.pop("pair", None)
        if pair is not None:
            self.retire(pair)

    def adopt(self, conn, pair) -> None:
        """Makes `pair` the data path of `conn` (a reconnect replaces the old one)."""
        self.release(conn)
        with self._lock:
            self._serving[id(pair)] = pair
        conn.state["pair"] = pair

    def release(self, conn) -> None:
        pair = conn.state.pop("pair", None)
        if pair is not None:
            with self._lock:
                self._serving.pop(id(pair), None)
            self.retire(pair)

    def pull_request(self, conn, header: Dict[str, Any], payload: bytes):
        """A destination's pull request, checked: (deadline, src_ids, pair). Raises
        ValueError (sent back as a refusal) before anything moves."""
        from .control import decode_ids  # control imports this module

        deadline = Deadline(float(header["timeout"]))
        n = int(header["n"])
        src_ids = check_block_ids(decode_ids(payload, n, "src_block_ids"), "src_block_ids",
                                  self.endpoint.cache.num_blocks, unique=False)
        pair = conn.state.get("pair")
        if pair is None:
            raise ValueError(f"{self.name} pull: no data path with this peer (connect first)")
        return deadline, src_ids, pair

    def connection_closed(self, conn) -> None:
        self.release(conn)

    def close(self) -> None:
        with self._lock:
            pairs = list(self._serving.values())
            self._serving.clear()
        for pair in pairs:
            self.retire(pair)


def chunk_ranges(n: int, per_chunk: int) -> List[Tuple[int, int]]:
    """[(lo, hi)] covering range(n) in order, in pieces of per_chunk (the last may be
    shorter). The staged (nccl) pulls ramp their chunks instead: vllm_ext._lib.ramp_bounds."""
    per_chunk = max(1, int(per_chunk))
    return [(lo, min(lo + per_chunk, n)) for lo in range(0, n, per_chunk)]


def blocks_per_chunk(chunk_bytes: int, block_nbytes: int) -> int:
    """How many blocks a staging chunk of about chunk_bytes holds (at least one)."""
    return max(1, int(chunk_bytes) // int(block_nbytes))


def poll_until(done: Callable[[], bool], deadline: "Deadline", what: str,
               check: Optional[Callable[[], None]] = None, spin_s: float = 2e-3) -> None:
    """Polls done() until true; MigrationError at the deadline. `check` runs on every poll
    and may raise (a peer's error report or exit). Spins for `spin_s`, then sleeps in steps
    of 2% of the time waited so far (at most 1 ms): a small pull pays no scheduler latency,
    a long one costs little CPU, and completion is noticed late by ~2% of the wait plus the
    sleep's own overshoot (tens of us), where doubling steps cost up to half of it (a 5 ms
    pull finished up to 1 ms late)."""
    start = time.monotonic()
    while True:
        if check is not None:
            check()
        if done():
            return
        now = time.monotonic()
        if now >= deadline.at:
            raise MigrationError(f"{what}: not complete at the deadline of {deadline.timeout:g} s")
        waited = now - start
        if waited > spin_s:
            time.sleep(min(max(0.02 * waited, 20e-6), 1e-3, max(deadline.at - now, 0)))


def follow_current_stream(stream, event, device) -> None:
    """`stream` waits for the work already queued on the current stream of `device` (blocks
    written there before a pull are not overwritten out of order); `event` is reused."""
    import torch

    event.record(torch.cuda.current_stream(device))
    stream.wait_event(event)


def wait_cuda_event(event, deadline: "Deadline", what: str,
                    check: Optional[Callable[[], None]] = None) -> None:
    """Waits for a torch.cuda.Event against the deadline (a host-blocking synchronize could
    never time out)."""
    poll_until(event.query, deadline, what, check)


class IdStaging:
    """Block ids on their way to a GPU without an allocation per pull: one pinned host buffer
    and one device buffer per pair, reused and grown on demand. `upload` writes the ids into
    the pinned buffer and enqueues one host-to-device copy on the current stream of `device`.

    Every pull waits for its GPU work before it returns, and a failed pull discards its pair
    with its IdStaging, so the previous upload has normally finished; an event recorded after
    each upload guards the pinned buffer anyway (a pull interrupted between its upload and its
    wait must not have its ids rewritten under the copy)."""

    def __init__(self, device):
        self.device = device
        self._host = None  # pinned int64
        self._dev = None
        self._uploaded = None  # event after the last host-to-device copy

    def upload(self, *id_lists: List[int], deadline: Optional["Deadline"] = None) -> List[Any]:
        """Device int64 tensors holding each list, in order (views of one buffer)."""
        import torch

        if self._uploaded is not None:  # done at once, unless a pull was interrupted
            wait_cuda_event(self._uploaded, deadline or Deadline(60.0), "the previous id upload")
        total = sum(len(ids) for ids in id_lists)
        if self._host is None or self._host.numel() < total:
            capacity = max(256, 1 << max(total - 1, 0).bit_length())
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        values = array.array("q")
        for ids in id_lists:
            values.extend(ids)
        address, count = values.buffer_info()
        ctypes.memmove(self._host.data_ptr(), address, count * values.itemsize)
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event()
        self._uploaded.record(torch.cuda.current_stream(self.device))
        out, pos = [], 0
        for ids in id_lists:
            out.append(self._dev[pos:pos + len(ids)])
            pos += len(ids)
        return out
