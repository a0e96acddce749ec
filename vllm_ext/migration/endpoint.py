"""MigrationEndpoint: one per serving instance; serves the instance's KVCache to authenticated
peers and pulls blocks from them. A thin facade over two halves:

  _Destination  pull/connect/disconnect: one link per source peer (its authenticated control
                connection and the backend's Pair), on the caller's thread; pulls and connects
                for one peer are serialised, pulls from different peers run at once.
  _Source       the control server's handler: one thread per connected destination, so a
                stalled peer never delays the others.

    ep = MigrationEndpoint(cache, backend="nccl")
    desc = ep.descriptor()                 # give this to other instances
    ep.connect(peer_desc)                  # optional: build the pair now, not at the first pull
    stats = ep.pull(peer_desc, src_block_ids, dst_block_ids, timeout=10.0)
    ep.disconnect(peer_desc)               # the peer left: release the pair built for it
"""

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Dict, Optional, Tuple

from .._ids import block_id_list
from ..errors import ClosedError, Error, MigrationError
from . import auth, protocol, registry
from .base import BackendContext, Grants, Link, PeerDescriptor, PullStats, Session
from .control import Connection, ControlServer, TlsOptions, open_connection
from .protocol import ProtocolError, geometry_mismatch, heads_differ_only
from .timing import Deadline, check_timeout

logger = logging.getLogger(__name__)

__all__ = ["MigrationEndpoint"]

# After serving a pull, the server polls this long for the next request before it blocks
# (the stages of a migration come in bursts).
_SERVE_SPIN_S = 2e-3
# How often the destination looks for peers that closed their end of an idle link.
_REAP_INTERVAL_S = 1.0
# close() waits this long for each pull in progress before it leaves that link to the pull.
_CLOSE_WAIT_S = 30.0


class _PeerLink:
    """The destination's state for one source peer. Used under `lock` only."""

    def __init__(self, peer: PeerDescriptor):
        self.peer = peer
        self.lock = threading.Lock()
        self.conn: Optional[Connection] = None
        self.view: Optional[Link] = None  # what the backend sees of the link
        self.pair = None  # the backend's Pair, once built

    def close(self, failed: bool) -> None:
        """Ends the pair (abort after a failure, else close) and the connection."""
        pair, self.pair = self.pair, None
        try:
            if pair is not None:
                pair.abort() if failed else pair.close()
        except Exception:  # noqa: BLE001 - the link is dropped either way
            logger.exception("ending the pair with %s failed", self.peer.short())
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.view = None


class _Destination:
    def __init__(self, backend, cache, endpoint_id: str, shared_secret: Optional[bytes],
                 tls: Optional[TlsOptions]):
        self._backend = backend
        self._cache = cache
        self._endpoint_id = endpoint_id
        self._shared_secret = shared_secret
        self._tls = tls
        self._links: Dict[str, _PeerLink] = {}
        self._lock = threading.Lock()
        self.closed = False
        self._reaper: Optional[threading.Thread] = None  # started with the first link
        self._reaper_stop = threading.Event()

    # ---- the public operations ---------------------------------------------------------------
    def connect(self, peer: PeerDescriptor, deadline: Deadline) -> bool:
        self._check_peer(peer)
        with self._locked(peer, deadline, "connect to") as link:
            if link.pair is not None and link.conn is not None and link.conn.readable():
                self._drop(link, failed=True)  # the peer closed its end, or a late message waits
                link = self._register(peer, "connect to")  # our lock is held on the old one only
                with self._hold(link, deadline, "connect to"):
                    built, _ = self._use(link, deadline, "connect to")
            else:
                built, _ = self._use(link, deadline, "connect to")
        if self.closed:  # close() ran meanwhile: what was built is released already
            raise MigrationError(f"connect to {peer.short()}: this endpoint closed meanwhile",
                                 peer=peer.endpoint_id)
        return built

    def pull(self, peer: PeerDescriptor, src_ids, dst_ids, deadline: Deadline, src_heads=None,
             dst_heads=None) -> PullStats:
        link = self._links.get(getattr(peer, "endpoint_id", None))
        if link is None or link.peer is not peer:  # a descriptor object is checked once
            self._check_peer(peer)
        heads = self._head_parts(peer, src_heads, dst_heads)
        src = block_id_list(src_ids, "src_block_ids", peer.num_blocks, unique=False)
        dst = block_id_list(dst_ids, "dst_block_ids", self._cache.num_blocks, unique=True)
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids: lengths differ ({len(src)} vs {len(dst)})")
        if not src:
            return PullStats(self._backend.name, 0, 0, 0.0, chunks=0)
        start = time.perf_counter()
        extra = {} if heads is None else {"heads": heads}

        def pull(pair) -> PullStats:
            step = max(peer.num_blocks, 1)
            if len(src) <= step:
                return pair.pull(src, dst, deadline, **extra)
            # A source takes at most as many ids per request as it has blocks (its frame bound):
            # a longer pull (ids repeated) goes as several.
            parts = [pair.pull(src[lo:lo + step], dst[lo:lo + step], deadline, **extra)
                     for lo in range(0, len(src), step)]
            return PullStats(self._backend.name, len(src), sum(p.nbytes for p in parts), 0.0,
                             chunks=sum(p.chunks for p in parts))

        with self._locked(peer, deadline, "pull from", dst) as link:
            _, stats = self._use(link, deadline, "pull from", dst, pull)
        stats.seconds = time.perf_counter() - start
        return stats

    def disconnect(self, peer: PeerDescriptor, timeout: float) -> bool:
        with self._lock:
            link = self._links.get(peer.endpoint_id)
        if link is None:
            return False
        if not link.lock.acquire(timeout=timeout):
            raise MigrationError(f"disconnect from {peer.short()}: a pull or connect for it still "
                                 f"runs after {timeout:g} s", peer=peer.endpoint_id)
        try:
            return self._drop(link, failed=False)  # False: released meanwhile
        finally:
            link.lock.release()

    def close(self) -> None:
        self.closed = True
        self._reaper_stop.set()
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
            reaper = self._reaper
        if reaper is not None:
            reaper.join(timeout=30)  # it holds a link's lock only while releasing that link
        for link in links:
            # A pull in flight ends by its own deadline; it releases its link itself then.
            if link.lock.acquire(timeout=_CLOSE_WAIT_S):
                try:
                    link.close(failed=False)
                finally:
                    link.lock.release()

    def link_count(self) -> int:
        with self._lock:
            return len(self._links)

    # ---- links ---------------------------------------------------------------------------------
    def _register(self, peer: PeerDescriptor, what: str) -> _PeerLink:
        with self._lock:
            if self.closed:  # close() sets it before it takes this lock: no link outlives it
                raise ClosedError(f"{what.split()[0]}: this endpoint is closed")
            link = self._links.get(peer.endpoint_id)
            if link is None:
                link = self._links[peer.endpoint_id] = _PeerLink(peer)
            if self._reaper is None and self._backend.uses_control_channel:
                self._reaper = threading.Thread(target=self._reap, name="migration-reaper", daemon=True)
                self._reaper.start()
            return link

    def _hold(self, link: _PeerLink, deadline: Deadline, what: str, dst=None) -> "_Held":
        """`with self._hold(link, ...)`: the block runs with link.lock held."""
        return _Held(self, link, deadline, what, dst)

    def _locked(self, peer: PeerDescriptor, deadline: Deadline, what: str, dst=None) -> "_Current":
        """`with self._locked(peer, ...) as link`: the current link to `peer`, its lock held
        for the block. A link that was dropped while this call waited for its lock is left
        alone: the call takes a new one."""
        return _Current(self, peer, deadline, what, dst)

    def _use(self, link: _PeerLink, deadline: Deadline, what: str, dst=None,
             action: Optional[Callable[[Any], Any]] = None) -> Tuple[bool, Any]:
        """With link.lock held: builds the link's pair if it has none, then runs
        action(pair). A failure drops the link (nothing stays behind for an unreachable peer);
        our own errors and the transport's become MigrationError naming the blocks `dst` left
        undefined; any other exception is a bug and keeps its type."""
        peer = link.peer
        try:
            built = link.pair is None
            if link.view is None:
                self._open(link, deadline)
            if built:
                link.pair = self._backend.connect(link.view, deadline)
            return built, (action(link.pair) if action is not None else None)
        except BaseException as e:  # KeyboardInterrupt too: the pair's buffers may be in use
            self._drop(link, failed=True)
            if isinstance(e, (Error, OSError)) and not isinstance(e, ClosedError):
                raise MigrationError(f"{what} {peer.short()}: {e}", peer=peer.endpoint_id, dst_block_ids=dst,
                                     remote_type=getattr(e, "remote_type", None)) from e
            raise

    def _open(self, link: _PeerLink, deadline: Deadline) -> None:
        peer = link.peer
        if not self._backend.uses_control_channel:
            link.view = Link(peer, None, peer.num_blocks)
            return
        secret = bytes.fromhex(peer.secret) if peer.secret else self._shared_secret
        same_host = peer.hostname == socket.gethostname()
        link.conn = open_connection(peer.host, peer.port, peer.local if same_host else "", deadline,
                                    client_id=self._endpoint_id, server_id=peer.endpoint_id, secret=secret,
                                    tls=self._tls)
        link.conn.send_message(protocol.Hello(self._backend.name, self._cache.geometry(), socket.gethostname(),
                                              os.getpid()), b"", deadline)
        reply = link.conn.recv_reply(deadline, "hello", protocol.HelloReply)
        link.view = Link(peer, link.conn, reply.num_blocks)

    def _drop(self, link: _PeerLink, failed: bool) -> bool:
        """With link.lock held: unregisters the link and ends it, unless it is no longer the
        registered link of its peer (then False, and nothing is done)."""
        with self._lock:
            if self._links.get(link.peer.endpoint_id) is not link:
                return False
            del self._links[link.peer.endpoint_id]
        link.close(failed)
        return True

    def _reap(self) -> None:
        """Releases the links of peers that closed their end (exited, or closed their endpoint)
        while no pull used them: their pairs would otherwise hold communicators and staging
        memory until this endpoint closes. An idle link where anything else waits is released
        too: between pulls no peer sends anything, so it is a late report of a failure, which
        the next pull would misread. A link in use is left to its pull."""
        while not self._reaper_stop.wait(_REAP_INTERVAL_S):
            with self._lock:
                links = list(self._links.values())
            for link in links:
                if link.conn is None or not link.lock.acquire(blocking=False):
                    continue
                try:
                    if link.conn is None or not link.conn.readable():
                        continue
                    why = "closed its connection" if link.conn.closed_by_peer() else "sent a message between pulls"
                    if self._drop(link, failed=True):
                        logger.info("peer %s %s: released what was built for it", link.peer.short(), why)
                except Exception:  # noqa: BLE001 - the reaper must go on
                    logger.exception("releasing the link to %s failed", link.peer.short())
                finally:
                    link.lock.release()

    def _head_parts(self, peer: PeerDescriptor, src_heads, dst_heads):
        """None for a whole-block pull (the caches must have the same heads), else the checked
        pair of head ranges (cache.HeadPart of the peer's cache and of this one)."""
        from ..cache import head_part
        from ..ops import pair_head_parts

        mine, theirs = self._cache.geometry(), peer.geometry
        if src_heads is None and dst_heads is None:
            if mine.get("num_kv_heads") != theirs.get("num_kv_heads"):
                raise ValueError(f"peer: cache geometry differs ({geometry_mismatch(mine, theirs)}); between "
                                 "caches of other head counts pull a head range (src_heads=, dst_heads=)")
            return None
        if not self._backend.moves_head_ranges:
            raise ValueError(f"src_heads and dst_heads: the {self._backend.name} backend moves whole blocks only "
                             f"(got {src_heads!r}, {dst_heads!r})")
        num_heads, slice_nbytes = theirs.get("num_kv_heads"), theirs.get("slice_nbytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (num_heads, slice_nbytes)):
            raise ValueError(f"peer: its geometry names no head count ({theirs})")
        stride = peer.head_stride if isinstance(peer.head_stride, int) and peer.head_stride > 0 else None
        sp = head_part(src_heads, "src_heads", layout=peer.layout, num_kv_heads=num_heads,
                       slice_nbytes=slice_nbytes, head_stride=stride, whose="the peer's")
        dp = self._cache.head_part(dst_heads, "dst_heads")
        return pair_head_parts(sp, num_heads, dp, self._cache.num_kv_heads)

    def _check_peer(self, peer) -> None:
        if not isinstance(peer, PeerDescriptor):
            raise TypeError(f"peer: expected PeerDescriptor (from descriptor()), got {type(peer).__name__}")
        backend = self._backend
        if peer.backend != backend.name:
            raise ValueError(f"peer: uses backend {peer.backend!r}, this endpoint uses {backend.name!r}")
        if peer.endpoint_id == self._endpoint_id:
            raise ValueError("peer: is this endpoint itself; copy within one cache with vllm_ext.ops.copy_blocks")
        diff = geometry_mismatch(self._cache.geometry(), peer.geometry)
        if diff and not (backend.moves_head_ranges and heads_differ_only(self._cache.geometry(), peer.geometry)):
            raise ValueError(f"peer: cache geometry differs ({diff})")
        if backend.same_host_only and peer.hostname != socket.gethostname():
            raise ValueError(f"peer: on host {peer.hostname!r}, this is {socket.gethostname()!r}; the "
                             f"{backend.name} backend works within one host")
        if backend.other_process_only and peer.pid == os.getpid() and peer.hostname == socket.gethostname():
            raise ValueError(f"peer: lives in this process (pid {peer.pid}); the {backend.name} backend maps "
                             "another process's memory, which CUDA refuses within one process (use "
                             "ops.copy_blocks between the two caches)")
        if backend.uses_control_channel and not peer.secret and self._shared_secret is None:
            raise ValueError("peer: its descriptor carries no secret and this endpoint has no deployment "
                             f"secret: give both endpoints the same one ({auth.ENV_SECRET} or secret=)")


class _Held:
    """A link's lock, held for a `with` block (taken in __enter__, released in __exit__)."""

    __slots__ = ("dest", "link", "deadline", "what", "dst")

    def __init__(self, dest: _Destination, link: _PeerLink, deadline: Deadline, what: str, dst):
        self.dest, self.link, self.deadline, self.what, self.dst = dest, link, deadline, what, dst

    def __enter__(self) -> _PeerLink:
        link = self.link
        if not link.lock.acquire(timeout=max(self.deadline.remaining(), 0)):
            raise MigrationError(f"{self.what} {link.peer.short()}: another pull or connect for this peer "
                                 f"held it past the deadline ({self.deadline.timeout:g} s)",
                                 peer=link.peer.endpoint_id, dst_block_ids=self.dst)
        return link

    def __exit__(self, *exc) -> None:
        if self.dest.closed:  # close() gave up waiting for this call: its link is released here
            self.link.close(failed=True)
        self.link.lock.release()


class _Current(_Held):
    """The current link to a peer, its lock held for a `with` block (see _Destination._locked)."""

    __slots__ = ("peer",)

    def __init__(self, dest: _Destination, peer: PeerDescriptor, deadline: Deadline, what: str, dst):
        super().__init__(dest, None, deadline, what, dst)
        self.peer = peer

    def __enter__(self) -> _PeerLink:
        dest, key = self.dest, self.peer.endpoint_id
        while True:
            self.link = dest._register(self.peer, self.what)
            link = super().__enter__()
            if dest._links.get(key) is link:  # a dict read: atomic; removals hold this lock
                return link
            link.lock.release()


class _Source:
    def __init__(self, backend, cache):
        self._backend = backend
        self._cache = cache
        self._sessions: Dict[int, Session] = {}
        self._lock = threading.Lock()

    def pair_count(self) -> int:
        with self._lock:
            return sum(session.pair is not None for session in self._sessions.values())

    def serve_connection(self, conn: Connection) -> None:
        """Serves one authenticated destination until it leaves (the control server's thread)."""
        session = Session(conn)
        with self._lock:
            self._sessions[id(session)] = session
        try:
            self._serve(session)
        finally:
            with self._lock:
                self._sessions.pop(id(session), None)
            try:
                self._backend.session_closed(session)
            except Exception:  # noqa: BLE001
                logger.exception("releasing the state of peer %s failed", conn.peer)

    def _serve(self, session: Session) -> None:
        conn = session.conn
        greeted, after_pull = False, False
        while True:
            if after_pull:
                conn.spin_until_readable(_SERVE_SPIN_S)
            try:
                header, payload = conn.recv()
            except EOFError:
                return  # the destination closed the connection: the normal end
            except (MigrationError, ProtocolError) as e:  # a reset, a broken or oversized frame
                logger.warning("control connection from %s: %s", conn.peer, e)
                try:
                    conn.reply_error(e)
                except MigrationError:
                    pass
                return
            sent_before = conn.sent
            try:
                request = protocol.parse_request(header)
                after_pull = request.op.endswith(".pull")
                if isinstance(request, protocol.Hello):
                    self._hello(session, request)
                    greeted = True
                elif isinstance(request, protocol.Ping):
                    conn.reply_ok()
                elif not greeted:
                    raise ProtocolError(f"request {request.op!r} before hello")
                elif self._backend.serve(session, request, payload):
                    return  # the backend served the connection to its end
            except Exception as e:  # noqa: BLE001 - reported to the peer
                # Refused input is the peer's mistake (one line); anything else is ours and
                # gets its traceback on this side's stderr.
                refused = isinstance(e, (ValueError, TypeError)) and conn.sent == sent_before
                logger.warning("serving %r to %s failed: %s: %s", header.get("op"), conn.peer,
                               type(e).__name__, e, exc_info=not refused)
                try:
                    # A request accepted that failed later gets one unsolicited error message,
                    # which the destination sees while it waits for its data.
                    conn.reply_error(e, asynchronous=conn.sent != sent_before)
                except MigrationError:
                    return

    def _hello(self, session: Session, hello: protocol.Hello) -> None:
        if hello.backend != self._backend.name:
            raise ValueError(f"hello: peer uses backend {hello.backend!r}, this endpoint uses "
                             f"{self._backend.name!r}")
        mine = self._cache.geometry()
        diff = geometry_mismatch(mine, hello.geometry)
        # Caches of other head counts pair for head-range pulls; the backend refuses their
        # whole-block pulls (Session.peer_geometry).
        if diff and not (self._backend.moves_head_ranges and heads_differ_only(mine, hello.geometry)):
            raise ValueError(f"hello: cache geometry differs ({diff})")
        session.peer_geometry = dict(hello.geometry)
        session.conn.reply_ok(protocol.HelloReply(self._cache.num_blocks))


class MigrationEndpoint:
    """Serves `cache` to authenticated peers and pulls peers' blocks into it over one backend.

    Args:
        cache: the instance's vllm_ext.KVCache (CPU or CUDA; ipc and nccl need CUDA).
        backend: "ipc", "nccl", "gloo" or "rayrpc".
        host: address the control server binds and advertises; the default (loopback) serves
            peers of this host only. Use the host's address for peers elsewhere. Peers on this
            host and user connect through an abstract Unix socket (Linux).
        port: control server port (0 = any free port).
        secret: the deployment's shared secret (bytes or str, 16 bytes or more); default:
            VLLM_EXT_AUTH_SECRET or the file named by VLLM_EXT_AUTH_SECRET_FILE, else a random
            secret of this endpoint's own that its descriptor carries (see auth.py).
        tls: control.TlsOptions for TCP control connections between hosts (None: plain TCP,
            still authenticated).
        serve: "all" (peers may pull any block) or "granted" (only blocks given to grant() and
            not yet revoked, e.g. those of live leases; not with ipc, which maps the whole cache).
        **options: backend options (see each backend's docstring).
    """

    def __init__(self, cache, backend: str = "gloo", *, host: str = "127.0.0.1", port: int = 0,
                 secret=None, tls: Optional[TlsOptions] = None, serve: str = "all", **options):
        from ..cache import KVCache

        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected vllm_ext.KVCache, got {type(cache).__name__}")
        if cache.layers is None:
            raise ValueError("cache: an imported peer view cannot be served; pass a cache that owns its tensors")
        if tls is not None and not isinstance(tls, TlsOptions):
            raise TypeError(f"tls: expected vllm_ext.migration.TlsOptions, got {type(tls).__name__}")
        if serve not in ("all", "granted"):
            raise ValueError(f"serve: 'all' or 'granted', got {serve!r}")
        backend_class = registry.get_backend_class(backend)
        if serve == "granted" and not backend_class.can_grant:
            raise ValueError(f"serve: 'granted' is not possible with the {backend} backend (a peer maps the "
                             "whole cache); use serve='all', whose peers hold the secret")
        if tls is not None and not backend_class.supports_tls:
            raise ValueError(f"tls: not supported by the {backend} backend (its pull requests are served by the "
                             "library on the raw socket); its control connections are authenticated, not encrypted")
        ok, why = backend_class.is_available()
        if not ok:
            raise RuntimeError(f"backend {backend!r} is not available in this process: {why}")
        self.cache = cache
        self.endpoint_id = uuid.uuid4().hex
        self._secret, own = auth.endpoint_secret(secret)
        self._context = BackendContext(cache, self.endpoint_id,
                                       grants=Grants(cache.num_blocks) if serve == "granted" else None)
        self.backend = backend_class(self._context, **options)
        self.backend.check_cache(cache)
        self._closed = False
        self._destination = _Destination(self.backend, cache, self.endpoint_id,
                                         None if own else self._secret, tls)
        self._source = _Source(self.backend, cache)
        self._advertised_secret = self._secret.hex() if own else ""
        self._server = ControlServer(host, port, self._source.serve_connection, endpoint_id=self.endpoint_id,
                                     secret=self._secret, max_payload=8 * max(cache.num_blocks, 1),
                                     name=f"migration-{backend}", local=f"vllm-ext-migration-{self.endpoint_id}",
                                     tls=tls)

    def descriptor(self) -> PeerDescriptor:
        """How peers reach this endpoint. Without a deployment secret it carries this endpoint's
        own secret: give it only to the peers meant to pull."""
        cache = self.cache
        return PeerDescriptor(
            endpoint_id=self.endpoint_id, backend=self.backend.name, host=self._server.host,
            port=self._server.port, hostname=socket.gethostname(), pid=os.getpid(),
            geometry=cache.geometry(), num_blocks=cache.num_blocks, layout=cache.layout,
            device=str(cache.device), extra=self.backend.descriptor_extra(), local=self._server.local,
            secret=self._advertised_secret, head_stride=cache.head_stride or 0)

    def connect(self, peer: PeerDescriptor, timeout: float = 30.0) -> bool:
        """Builds what pulls from `peer` need, now, so that the first pull does not wait for
        it: the authenticated control connection and the backend's pair (nccl: communicators
        and staging memory; ipc: the mapping of the peer's cache; gloo: the process groups;
        rayrpc: one call checking that the peer's actor serves that endpoint). The peer builds
        its side at the same time.

        Returns True when it built the pair, False when it was already built and the peer's
        end still open. Raises ValueError/TypeError for a bad peer or timeout, ClosedError on a
        closed endpoint, MigrationError when the peer cannot be reached, fails authentication,
        refuses, or the set-up is not done within `timeout` seconds. A failed connect leaves
        nothing behind. What is built stays until disconnect(peer), close(), a failed pull, or
        the peer closing its end.
        """
        check_timeout(timeout)
        deadline = Deadline(timeout)
        self._check_open("connect")
        return self._destination.connect(peer, deadline)

    def pull(self, peer: PeerDescriptor, src_block_ids, dst_block_ids, timeout: float = 10.0, *,
             src_heads=None, dst_heads=None) -> PullStats:
        """Copies blocks `src_block_ids` of `peer`'s cache into blocks `dst_block_ids` of this
        endpoint's cache; returns when they are written (visible to every stream).

        Head ranges (tensor parallelism of unequal sizes; backends with `moves_head_ranges`:
        gloo, ipc, nccl):
        `src_heads` = (a, n) and `dst_heads` = (b, n) move only KV heads [a, a + n) of each
        source block into heads [b, b + n) of the destination block (None: every head of that
        side), as ops.copy_blocks does; the source sends those heads alone. The caches may then
        differ in num_kv_heads (and only in that); a whole-block pull between them is refused.
        PullStats.nbytes counts the bytes of the range.

        Raises ValueError/TypeError for bad arguments (nothing moved), ClosedError on a closed
        endpoint, MigrationError when the transfer fails, the peer refuses, dies, closes or
        stalls past `timeout` seconds (its `dst_block_ids` are the blocks left undefined).
        """
        check_timeout(timeout)
        deadline = Deadline(timeout)
        self._check_open("pull")
        return self._destination.pull(peer, src_block_ids, dst_block_ids, deadline, src_heads, dst_heads)

    def disconnect(self, peer: PeerDescriptor, timeout: float = 30.0) -> bool:
        """Releases what this endpoint holds for pulls from `peer` (the control connection and
        the backend's pair); the peer releases its side when it sees the connection close. Call
        it when that instance leaves (a peer that closes its end is released within about a
        second without it). Returns False when nothing was held. Waits up to `timeout` seconds
        for a pull or connect for `peer` in progress; MigrationError past that, nothing released.
        """
        if not isinstance(peer, PeerDescriptor):
            raise TypeError(f"peer: expected PeerDescriptor (from descriptor()), got {type(peer).__name__}")
        check_timeout(timeout, zero_ok=True)
        return self._destination.disconnect(peer, timeout)

    def grant(self, block_ids) -> None:
        """serve="granted": peers may pull these blocks until they are revoked (as often as they
        were granted). ValueError for bad ids, or on an endpoint that serves every block."""
        ids = block_id_list(block_ids, "block_ids", self.cache.num_blocks, unique=False)
        self._grants("grant").grant(ids)

    def revoke(self, block_ids) -> None:
        """Withdraws one grant of each block; a pull already accepted finishes. ValueError (and
        nothing revoked) for a block revoked more often than granted."""
        ids = block_id_list(block_ids, "block_ids", self.cache.num_blocks, unique=False)
        self._grants("revoke").revoke(ids)

    def _grants(self, what: str) -> Grants:
        if self._context.grants is None:
            raise ValueError(f"{what}: this endpoint serves every block (serve='all')")
        return self._context.grants

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: this endpoint is closed")

    def close(self) -> None:
        """Tells connected peers it is closing, stops serving, releases every pair on both
        sides; returns once the threads that served peers have ended too (a few seconds at
        most for one still inside a transfer)."""
        if self._closed:
            return
        self._closed = True
        self._server.notify_closing("the source endpoint closed")
        self._destination.close()
        self._server.close()
        self.backend.close()  # ends the pairs served (nccl: their pull servers) ...
        self._server.join_serving()  # ... so that the threads serving them end now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"MigrationEndpoint(backend={self.backend.name!r}, at={self._server.host}:{self._server.port}, "
                f"cache={self.cache!r})")
