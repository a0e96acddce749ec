"""The contract every migration backend implements, and what backends share: the peer
descriptor, pull statistics, the narrow context a backend gets, and the staging helpers.

Roles. Two endpoints take part in a pull: the *destination* (the one whose `pull` was called;
it drives) and the *source* (it serves its blocks). Each endpoint runs a control server
(control.py); a backend adds its own data path beside it. A backend never sees the endpoint:
it gets a BackendContext (the cache, the endpoint id, the fault hooks of tests). Who calls what:

  Destination side, on the thread that called MigrationEndpoint.pull (or .connect):
    connect(link, deadline) -> Pair     once per peer (and again after a failure): build the
                                        pair's data path over `link` (its authenticated
                                        control connection and what the source said in hello).
    Pair.pull(src_ids, dst_ids, deadline) -> PullStats
                                        move the blocks; MigrationError on any failure of the
                                        transfer (a bug keeps its own exception type).
    Pair.close()                        orderly end (disconnect, a peer that left, the
                                        endpoint closing); bounded.
    Pair.abort()                        after a failed pull: end at once, never block.
  Source side, on the control server's thread for that peer's connection:
    serve(session, request, payload) -> bool
                                        one request (a protocol.Message) of the peer's
                                        destination side: answer on session.conn, move this
                                        side's half of the data. True when the backend served
                                        the connection to its end (nccl hands it to the
                                        library's pull server); the endpoint then stops reading.
    session_closed(session)             the peer's connection ended: close session.pair.
  Either side:
    close()                             the endpoint is closing.
    is_available() (classmethod)        (True, "") or (False, why): checked before construction.

Peer rules are class attributes: `same_host_only`, `other_process_only`,
`uses_control_channel` (rayrpc talks through Ray), `supports_tls`, `can_grant` (whether the
source can serve granted blocks only: ipc maps the whole cache, so it cannot),
`moves_head_ranges` (Pair.pull takes `heads`: a KV head range of each block, for caches of
other head counts, i.e. tensor parallelism of unequal sizes).
"""

import abc
import array
import ctypes
import dataclasses
import math
import threading
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from ..errors import MigrationError
from . import protocol
from .control import check_reply
from .timing import Deadline, poll_until

__all__ = [
    "PeerDescriptor",
    "PullStats",
    "BackendContext",
    "Faults",
    "Link",
    "Session",
    "Pair",
    "MigrationBackend",
    "IdStaging",
]


@dataclasses.dataclass(frozen=True)
class PeerDescriptor:
    """How peers reach an endpoint: small and picklable; pass it to the other instance by any
    means (a Ray call, a scheduler message) and hand it to that instance's `pull`.

    `secret` (hex) is set only for an endpoint without a deployment secret: the descriptor is
    then a capability, and must travel only to the peers meant to pull (see auth.py)."""

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
    # before TCP.
    local: str = ""
    secret: str = dataclasses.field(default="", repr=False)
    # Bytes from one KV head to the next in a slice (KVCache.head_stride; 0: no head ranges).
    head_stride: int = 0

    def short(self) -> str:
        return f"{self.backend} endpoint {self.endpoint_id[:8]} at {self.host}:{self.port}"

    def without_secret(self) -> "PeerDescriptor":
        """The same descriptor with no capability in it (for peers holding the deployment
        secret, and for logs)."""
        return dataclasses.replace(self, secret="")


@dataclasses.dataclass
class PullStats:
    """What one pull moved and how long it took (seconds are wall time on the destination,
    from the call to the blocks being written and visible to the caller's streams)."""

    backend: str
    num_blocks: int
    nbytes: int
    seconds: float
    chunks: int = 1

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


class Faults:
    """The fault hooks a backend calls; this one injects nothing. Tests install their own
    object on an endpoint's context (a stalled source, a late join), never production code."""

    # {chunk, microseconds} the library's pull server reads at every request (nccl), or None.
    native_stall: Optional[ctypes.Array] = None

    def pause(self, step) -> None:
        """Source side: called before serving chunk `step` (an int) or a named step
        ("connect")."""


class Grants:
    """The blocks a source serves when it serves only what it granted (serve="granted"): a count
    per block, raised by grant and lowered by revoke (two leases may share a block). The
    library's pull server reads the same counts (`counts`) at every request."""

    def __init__(self, num_blocks: int):
        self.counts = (ctypes.c_int32 * max(num_blocks, 1))()
        self._lock = threading.Lock()

    def grant(self, ids: List[int]) -> None:
        with self._lock:
            for i in ids:
                self.counts[i] += 1

    def revoke(self, ids: List[int]) -> None:
        with self._lock:
            need: Dict[int, int] = {}
            for i in ids:
                need[i] = need.get(i, 0) + 1
            bad = [i for i, n in need.items() if self.counts[i] < n]
            if bad:
                raise ValueError(f"block_ids: block {bad[0]} revoked more often than granted (nothing revoked)")
            for i in ids:
                self.counts[i] -= 1

    def check(self, ids: List[int]) -> None:
        """ValueError (a refusal, sent to the peer) naming the first block not granted."""
        counts = self.counts
        for i in ids:
            if counts[i] <= 0:
                raise ValueError(f"src_block_ids: block {i} is not granted by the source")


@dataclasses.dataclass
class BackendContext:
    """What a backend may know of its endpoint."""

    cache: Any  # vllm_ext.KVCache
    endpoint_id: str
    faults: Faults = dataclasses.field(default_factory=Faults)
    grants: Optional[Grants] = None  # serve="granted": the blocks peers may pull; None: every block


class Link:
    """The destination side's view of one source peer, as a backend sees it: the authenticated
    control connection and the source's answer to hello."""

    def __init__(self, peer: PeerDescriptor, conn, num_blocks: int):
        self.peer = peer
        self.conn = conn  # control.Connection, or None (rayrpc)
        self.num_blocks = num_blocks

    def request(self, message: protocol.Message, deadline: Deadline, payload: bytes = b"") -> None:
        self.conn.send_message(message, payload, deadline)


class Session:
    """The source side's state for one authenticated destination connection: the connection
    and the pair the backend built for it (None until then)."""

    def __init__(self, conn):
        self.conn = conn
        self.pair: Any = None
        self.peer_geometry: Dict[str, Any] = {}  # the destination's cache, from its hello


class Pair(abc.ABC):
    """A destination's data path to one source peer, built by MigrationBackend.connect."""

    @abc.abstractmethod
    def pull(self, src_ids: List[int], dst_ids: List[int], deadline: Deadline) -> PullStats:
        """Moves blocks src_ids of the peer into dst_ids of the local cache (ids checked).
        A backend with `moves_head_ranges` also takes `heads=(src_part, dst_part)`, two
        cache.HeadPart (checked and paired by ops.pair_head_parts): only those KV heads move."""

    def close(self) -> None:
        """Orderly end; bounded."""
        self.abort()

    @abc.abstractmethod
    def abort(self) -> None:
        """End after a failure: never blocks."""


class MigrationBackend(abc.ABC):
    """One way of moving blocks between two endpoints (see the module docstring)."""

    name: ClassVar[str] = ""
    same_host_only: ClassVar[bool] = False  # the two endpoints must live on one host (ipc)
    other_process_only: ClassVar[bool] = False  # ... in two processes (ipc)
    uses_control_channel: ClassVar[bool] = True  # rayrpc talks through Ray
    supports_tls: ClassVar[bool] = True  # nccl: the library's pull server reads the raw socket
    can_grant: ClassVar[bool] = True  # ipc maps the whole cache: it cannot serve granted blocks only
    moves_head_ranges: ClassVar[bool] = False  # Pair.pull takes heads= (a KV head range)

    def __init__(self, context: BackendContext, **options):
        self.context = context
        if options:
            raise TypeError(f"{self.name} backend: unknown options {sorted(options)}")

    @property
    def cache(self):
        return self.context.cache

    @classmethod
    def is_available(cls) -> Tuple[bool, str]:
        return True, ""

    def check_cache(self, cache) -> None:
        """ValueError when the backend cannot serve this cache (ipc on a CPU cache)."""
        return  # optional hook: every cache by default

    def descriptor_extra(self) -> Dict[str, Any]:
        """Backend-specific fields peers need (PeerDescriptor.extra)."""
        return {}

    @abc.abstractmethod
    def connect(self, link: Link, deadline: Deadline) -> Pair:
        """Destination side: build the pair's data path to link.peer."""

    def serve(self, session: Session, request: protocol.Message, payload: bytes) -> bool:
        """Source side: one request of the peer; raising before replying refuses it."""
        raise protocol.ProtocolError(f"{self.name} backend: no request {request.op!r}")

    def session_closed(self, session: Session) -> None:
        if session.pair is not None:
            pair, session.pair = session.pair, None
            pair.close()

    def close(self) -> None:
        """The endpoint is closing."""
        return  # optional hook: nothing to release by default


def check_slot(chunk_blocks: int, block_nbytes: int, what: str) -> None:
    """A source refuses pipeline parameters that would make it allocate past the bound."""
    if chunk_blocks * block_nbytes > protocol.MAX_SLOT_BYTES:
        raise protocol.ProtocolError(
            f"{what}: chunk_blocks {chunk_blocks} of {block_nbytes} bytes make a slot of "
            f"{chunk_blocks * block_nbytes} bytes, at most {protocol.MAX_SLOT_BYTES}")


def chunk_ranges(n: int, per_chunk: int) -> List[Tuple[int, int]]:
    """[(lo, hi)] covering range(n) in order, in pieces of per_chunk (the last may be
    shorter). The staged (nccl) pulls ramp their chunks instead: vllm_ext._lib.ramp_bounds."""
    per_chunk = max(1, int(per_chunk))
    return [(lo, min(lo + per_chunk, n)) for lo in range(0, n, per_chunk)]


def blocks_per_chunk(chunk_bytes: int, block_nbytes: int) -> int:
    """How many blocks a staging chunk of about chunk_bytes holds (at least one)."""
    return max(1, int(chunk_bytes) // int(block_nbytes))


def follow_current_stream(stream, event, device) -> None:
    """`stream` waits for the work already queued on the current stream of `device` (blocks
    written there before a pull are not overwritten out of order); `event` is reused."""
    import torch

    event.record(torch.cuda.current_stream(device))
    stream.wait_event(event)


def wait_cuda_event(event, deadline: Deadline, what: str, check=None) -> None:
    """Waits for a torch.cuda.Event against the deadline (a host-blocking synchronize could
    never time out)."""
    poll_until(event.query, deadline, what, check)


def watch_connection(conn, what: str):
    """A check for poll_until: MigrationError as soon as the peer's control connection reports
    a failure, says it is closing, or closes (the process exited). Within a transfer the peer
    sends nothing else."""
    def check() -> None:
        if conn.readable():
            header, _ = conn.recv(Deadline(1.0))  # EOF raises MigrationError
            check_reply(header, conn.peer, what)
            raise MigrationError(f"{what}: an unexpected message from the peer ({conn.peer})")

    return check


def watch_closed(conn, what: str):
    """A check for poll_until on the source side: MigrationError once the destination closed
    its connection (it may send its next request before this side's sends have completed)."""
    def check() -> None:
        if conn.closed_by_peer():
            raise MigrationError(f"{what}: the destination ({conn.peer}) closed its connection")

    return check


class IdStaging:
    """Block ids on their way to a GPU without an allocation per pull: one pinned host buffer
    and one device buffer per pair, reused and grown on demand. `upload` writes the ids into
    the pinned buffer and enqueues one host-to-device copy on the current stream of `device`;
    an event after each upload guards the pinned buffer (a pull interrupted between its upload
    and its wait must not have its ids rewritten under the copy)."""

    def __init__(self, device):
        self.device = device
        self._host = None  # pinned int64
        self._dev = None
        self._uploaded = None  # event after the last host-to-device copy

    def upload(self, *id_lists: List[int], deadline: Optional[Deadline] = None) -> List[Any]:
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
