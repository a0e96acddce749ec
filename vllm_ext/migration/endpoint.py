"""MigrationEndpoint: one per serving instance; owns the instance's KVCache for migration, serves
its blocks to peers and pulls blocks from them.

    ep = MigrationEndpoint(cache, backend="nccl")
    desc = ep.descriptor()                 # give this to other instances
    ep.connect(peer_desc)                  # optional: build the pair now, not at the first pull
    stats = ep.pull(peer_desc, src_block_ids, dst_block_ids, timeout=10.0)
    ep.disconnect(peer_desc)               # the peer left: release the pair built for it

Threads: `pull` and `connect` run on the caller's thread (several threads may pull from
different peers at once; pulls and connects for one peer are serialised). Serving runs on
the control server's threads, one per connected peer, so a stalled peer never delays the
others.
"""

import ctypes
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Dict, Optional, Tuple

from . import registry
from .base import (
    Deadline,
    MigrationError,
    PeerDescriptor,
    PullStats,
    check_block_ids,
    check_timeout,
    geometry_mismatch,
    poll_until,
)
from .control import Connection, ControlServer

logger = logging.getLogger(__name__)

__all__ = ["MigrationEndpoint", "PeerLink", "PROTOCOL"]

# The version of what the two sides of a pair must agree on (request formats, chunking). A
# destination and a source of different versions are refused at hello, never half-understood.
# 2: nccl chunks ramp 1, 2, 4, ... blocks; the nccl connect carries copy_ctas.
# 3: after nccl.connect, the connection carries binary pulls to the library's pull server.
# 4: an nccl pair has lanes, one communicator each (connect carries their uids); chunks follow
#    vllm_ext_ramp_bounds and alternate between the lanes.
PROTOCOL = 4
# After serving a pull, the server polls this long for the next request before it blocks
# (the stages of a migration come in bursts; other requests are rare and wait as usual).
_SERVE_SPIN_S = 2e-3
# How often the destination looks for peers that closed their end of an idle link (exited or
# closed their endpoint), to release what it built for them.
_REAP_INTERVAL_S = 1.0
# close() waits this long for each pull in progress before it leaves that link to the pull.
_CLOSE_WAIT_S = 30.0


class PeerLink:
    """The destination side's state for one source peer: its control connection and whatever
    the backend keeps for the pair (`state`). Used under `lock` only."""

    def __init__(self, peer: PeerDescriptor):
        self.peer = peer
        self.lock = threading.Lock()
        self.conn: Optional[Connection] = None
        self.hello: Dict[str, Any] = {}  # the source's answer to hello
        self.connected = False  # the backend's data path is built
        self.state: Dict[str, Any] = {}

    def request(self, header: Dict[str, Any], deadline: Deadline, payload: bytes = b"") -> None:
        assert self.conn is not None
        self.conn.send(header, payload, deadline)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.connected = False


class MigrationEndpoint:
    """Serves `cache` to peers and pulls peers' blocks into it over one backend.

    Args:
        cache: the instance's vllm_ext.KVCache (CPU or CUDA; ipc and nccl need CUDA).
        backend: "ipc", "nccl", "gloo" or "rayrpc".
        host: address the control server binds and advertises; the default (loopback)
            serves peers of this host only. Use the host's address for peers elsewhere.
            Peers on this host connect through an abstract Unix socket (Linux) when they
            share the network namespace, else through host:port.
        port: control server port (0 = any free port).
        **options: backend options (see each backend's class docstring).
    """

    def __init__(self, cache, backend: str = "gloo", *, host: str = "127.0.0.1", port: int = 0,
                 **options):
        from ..cache import KVCache

        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected vllm_ext.KVCache, got {type(cache).__name__}")
        if cache.layers is None:
            raise ValueError("cache: an imported peer view cannot be served; pass a cache that "
                             "owns its tensors")
        backend_class = registry.get_backend_class(backend)
        ok, why = backend_class.is_available()
        if not ok:
            raise RuntimeError(f"backend {backend!r} is not available in this process: {why}")
        self.cache = cache
        self.endpoint_id = uuid.uuid4().hex
        self.backend = backend_class(self, **options)
        self.backend.check_cache(cache)
        self._links: Dict[str, PeerLink] = {}
        self._links_lock = threading.Lock()
        self._closed = False
        self._reaper: Optional[threading.Thread] = None  # started with the first link
        self._reaper_stop = threading.Event()
        # Tests only: (chunk index, seconds) makes the source pause while serving; the library's
        # pull server (nccl) reads {chunk, microseconds} from test_stall_native.
        self.test_stall_native = (ctypes.c_int64 * 2)(-1, 0)
        self.test_stall: Optional[tuple] = None
        self._server = ControlServer(host, port, self._serve_connection,
                                     name=f"migration-{backend}",
                                     local=f"vllm-ext-migration-{self.endpoint_id}")

    # ---- description ---------------------------------------------------------------------
    def descriptor(self) -> PeerDescriptor:
        cache = self.cache
        return PeerDescriptor(
            endpoint_id=self.endpoint_id, backend=self.backend.name, host=self._server.host,
            port=self._server.port, hostname=socket.gethostname(), pid=os.getpid(),
            geometry=cache.geometry(), num_blocks=cache.num_blocks, layout=cache.layout,
            device=str(cache.device), extra=self.backend.descriptor_extra(),
            local=self._server.local)

    # ---- destination side ----------------------------------------------------------------
    def connect(self, peer: PeerDescriptor, timeout: float = 30.0) -> bool:
        """Builds what pulls from `peer` need, now, so that the first pull does not wait for
        it: the control connection and the backend's data path (nccl: the pair's
        communicators and staging memory, about 0.2 s for a new peer and more for a process's
        first; ipc: the mapping of the peer's cache; gloo: the process groups). The peer
        builds its side at the same time. rayrpc has nothing to build: its connect is one
        call to the peer's actor, which checks that it serves that endpoint. Call it when an
        instance learns of a peer it may pull from; a pull without it connects by itself.

        Returns True when it built the data path, False when it was already built and the
        peer's end of it still open (nothing is done then; a link whose peer closed its end
        is built again). Waits for a pull from `peer` in progress. Raises ValueError or
        TypeError for a bad peer or timeout, or a closed endpoint (as pull does), and
        MigrationError when the peer cannot be reached, refuses, the set-up is not done
        within `timeout` seconds, or a pull from `peer` holds it that long. A failed
        connect leaves nothing for `peer` behind (a pair that was built stays, when a pull
        held it past the timeout); a later connect or pull starts again. What is built stays
        until disconnect(peer), close(), a failed pull, or the peer closing its end.
        """
        deadline = Deadline(timeout)
        if self._closed:
            raise ValueError("connect: this endpoint is closed")
        self._check_peer(peer)
        link = self._locked_link(peer, None, deadline, "connect to")
        if link.connected and link.conn is not None and link.conn.readable():
            self._discard(link)  # the peer closed its end, or a late message waits: build again
        built, _ = self._use(link, deadline, "connect to")
        if self._closed:  # close() ran meanwhile: what was built is released already
            raise MigrationError(f"connect to {peer.short()}: this endpoint closed meanwhile",
                                 peer=peer.endpoint_id)
        return built

    def pull(self, peer: PeerDescriptor, src_block_ids, dst_block_ids,
             timeout: float = 10.0) -> PullStats:
        """Copies blocks `src_block_ids` of `peer`'s cache into blocks `dst_block_ids` of this
        endpoint's cache; returns when they are written (visible to every stream).

        Raises ValueError/TypeError for bad arguments (nothing moved), MigrationError when
        the transfer fails, the peer refuses, dies or stalls past `timeout` seconds.
        """
        deadline = Deadline(timeout)
        if self._closed:
            raise ValueError("pull: this endpoint is closed")
        link = self._links.get(getattr(peer, "endpoint_id", None))
        if link is None or link.peer is not peer:  # a descriptor object is checked once
            self._check_peer(peer)
        src = check_block_ids(src_block_ids, "src_block_ids", peer.num_blocks, unique=False)
        dst = check_block_ids(dst_block_ids, "dst_block_ids", self.cache.num_blocks, unique=True)
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids: lengths differ "
                             f"({len(src)} vs {len(dst)})")
        if not src:
            return PullStats(self.backend.name, 0, 0, 0.0, chunks=0)
        start = time.perf_counter()
        link = self._locked_link(peer, link, deadline, "pull from", dst)
        _, stats = self._use(link, deadline, "pull from", dst,
                             lambda: self.backend.pull(link, src, dst, deadline))
        stats.seconds = time.perf_counter() - start
        return stats

    def _use(self, link: PeerLink, deadline: Deadline, what: str, dst=None,
             action: Optional[Callable[[], Any]] = None) -> Tuple[bool, Any]:
        """With link.lock held (released here): builds the link's data path if it has none,
        then runs action() if given. Returns (whether it built the data path, action()'s
        value). A failure discards the link's connection and data path and unregisters the
        link (nothing stays behind for an unreachable peer): MigrationError naming the blocks
        `dst` that were not written."""
        peer = link.peer
        try:
            built = not link.connected
            if link.conn is None and self.backend.uses_control_channel:
                self._open(link, deadline)
            if built:
                self.backend.connect(link, deadline)
                link.connected = True
            return built, (action() if action is not None else None)
        except BaseException as e:  # KeyboardInterrupt too: the pair's buffers may be in use
            self._unregister(link)
            self._discard(link)
            if isinstance(e, MigrationError):
                raise MigrationError(f"{what} {peer.short()}: {e}", peer=peer.endpoint_id,
                                     dst_block_ids=dst, remote_type=e.remote_type) from e
            if isinstance(e, Exception):  # any failure mid-transfer is a MigrationError
                raise MigrationError(f"{what} {peer.short()}: {type(e).__name__}: {e}",
                                     peer=peer.endpoint_id, dst_block_ids=dst) from e
            raise
        finally:
            if self._closed:  # close() gave up waiting for this call: its link is released here
                self._discard(link)
            link.lock.release()

    def _check_peer(self, peer) -> None:
        if not isinstance(peer, PeerDescriptor):
            raise TypeError(f"peer: expected PeerDescriptor (from descriptor()), got "
                            f"{type(peer).__name__}")
        if peer.backend != self.backend.name:
            raise ValueError(f"peer: uses backend {peer.backend!r}, this endpoint uses "
                             f"{self.backend.name!r}")
        if peer.endpoint_id == self.endpoint_id:
            raise ValueError("peer: is this endpoint itself; copy within one cache with "
                             "vllm_ext.ops.copy_blocks")
        diff = geometry_mismatch(self.cache.geometry(), peer.geometry)
        if diff:
            raise ValueError(f"peer: cache geometry differs ({diff})")
        if self.backend.same_host_only and peer.hostname != socket.gethostname():
            raise ValueError(f"peer: on host {peer.hostname!r}, this is {socket.gethostname()!r};"
                             f" the {self.backend.name} backend works within one host")
        if (self.backend.other_process_only and peer.pid == os.getpid()
                and peer.hostname == socket.gethostname()):
            raise ValueError(f"peer: lives in this process (pid {peer.pid}); the "
                             f"{self.backend.name} backend maps another process's memory, which "
                             "CUDA refuses within one process (use ops.copy_blocks between the "
                             "two caches)")

    def _link(self, peer: PeerDescriptor, what: str) -> PeerLink:
        with self._links_lock:
            if self._closed:  # close() sets it before it takes this lock: no link outlives it
                raise ValueError(f"{what.split()[0]}: this endpoint is closed")
            link = self._links.get(peer.endpoint_id)
            if link is None:
                link = self._links[peer.endpoint_id] = PeerLink(peer)
            if self._reaper is None and self.backend.uses_control_channel:
                self._reaper = threading.Thread(target=self._reap, name="migration-reaper",
                                                daemon=True)
                self._reaper.start()
            return link

    def _reap(self) -> None:
        """Releases the links of peers that closed their end of the control connection (the
        process exited, or closed its endpoint) while no pull used it, as disconnect() would:
        their pairs would otherwise hold communicators and staging memory until this endpoint
        closes. An idle link where anything else waits is released too: between pulls no
        peer sends anything, so it is a late report of a failure, which the next pull would
        misread. A link in use is left to its pull, which notices by itself. Releasing is
        CUDA work for nccl (ncclCommAbort frees its buffers) and ipc (unmapping), done on
        this thread."""
        while not self._reaper_stop.wait(_REAP_INTERVAL_S):
            with self._links_lock:
                links = list(self._links.values())
            for link in links:
                if link.conn is None or not link.lock.acquire(blocking=False):
                    continue
                try:
                    if link.conn is None or not link.conn.readable():
                        continue
                    why = "closed its connection" if link.conn.closed_by_peer() else "sent a message between pulls"
                    if self._release(link):
                        logger.info("peer %s %s: released what was built for it", link.peer.short(), why)
                except Exception:  # noqa: BLE001 - the reaper must go on
                    logger.exception("releasing the link to %s failed", link.peer.short())
                finally:
                    link.lock.release()

    def _locked_link(self, peer: PeerDescriptor, link: Optional[PeerLink], deadline: Deadline,
                     what: str, dst=None) -> PeerLink:
        """The link to `peer`, its lock held. A link that was disconnected while this pull
        waited for its lock is left alone: the pull takes a new one."""
        while True:
            if link is None:
                link = self._link(peer, what)
            if not link.lock.acquire(timeout=max(deadline.remaining(), 0)):
                raise MigrationError(f"{what} {peer.short()}: another pull or connect for this "
                                     f"peer held it past the deadline ({deadline.timeout:g} s)",
                                     peer=peer.endpoint_id, dst_block_ids=dst)
            with self._links_lock:
                current = self._links.get(peer.endpoint_id) is link
            if current:
                return link
            link.lock.release()
            link = None

    def disconnect(self, peer: PeerDescriptor, timeout: float = 30.0) -> bool:
        """Releases what this endpoint holds for pulls from `peer`: the control connection and
        the backend's data path (nccl: the pair's communicators and staging memory; ipc: the
        mapped memory; gloo: the process groups). Call it when that instance leaves. (A peer
        that closes its end, its process exiting or its endpoint closing, is released within
        about a second without it; a live peer that will not be pulled from again is not.)
        The peer's side of the pair is released when it sees the connection close. A later
        pull from `peer` connects again.

        Returns False when nothing was held for `peer`. Waits up to `timeout` seconds for a
        pull or connect for `peer` that is in progress; MigrationError past that, with
        nothing released.
        """
        if not isinstance(peer, PeerDescriptor):
            raise TypeError(f"peer: expected PeerDescriptor (from descriptor()), got "
                            f"{type(peer).__name__}")
        check_timeout(timeout, zero_ok=True)
        with self._links_lock:
            link = self._links.get(peer.endpoint_id)
        if link is None:
            return False
        if not link.lock.acquire(timeout=timeout):
            raise MigrationError(f"disconnect from {peer.short()}: a pull or connect for it still "
                                 f"runs after {timeout:g} s", peer=peer.endpoint_id)
        try:
            return self._release(link)  # False: released meanwhile (close(), a departed peer)
        finally:
            link.lock.release()

    def _release(self, link: PeerLink) -> bool:
        """With link.lock held: unregisters the link and discards it, unless it is no longer
        the registered link of its peer (then False, and nothing is done)."""
        if not self._unregister(link):
            return False
        self._discard(link)
        return True

    def _unregister(self, link: PeerLink) -> bool:
        """Removes the link from the registry if it is still its peer's; True if it was."""
        with self._links_lock:
            if self._links.get(link.peer.endpoint_id) is not link:
                return False
            del self._links[link.peer.endpoint_id]
            return True

    def _open(self, link: PeerLink, deadline: Deadline) -> None:
        peer = link.peer
        same_host = peer.hostname == socket.gethostname()
        link.conn = Connection.open(peer.host, peer.port, deadline,
                                    local=peer.local if same_host else "")
        link.request({"op": "hello", "protocol": PROTOCOL, "peer_id": self.endpoint_id,
                      "backend": self.backend.name,
                      "geometry": self.cache.geometry(), "hostname": socket.gethostname(),
                      "pid": os.getpid(), "source_id": peer.endpoint_id}, deadline)
        link.hello = link.conn.recv_reply(deadline, "hello")

    def _discard(self, link: PeerLink) -> None:
        try:
            self.backend.discard(link)
        except Exception:  # noqa: BLE001
            logger.exception("discarding the data path to %s failed", link.peer.short())
        link.close()

    # ---- source side ---------------------------------------------------------------------
    def _serve_connection(self, conn: Connection) -> None:
        try:
            after_pull = False
            while True:
                if after_pull:
                    conn.spin_until_readable(_SERVE_SPIN_S)
                try:
                    header, payload = conn.recv()
                except EOFError:
                    return  # the destination closed the connection: the normal end
                except MigrationError as e:
                    # A reset or a broken frame: say so here, and to the peer if it listens.
                    logger.warning("control connection from %s: %s", conn.peer, e)
                    try:
                        conn.reply_error(e)
                    except MigrationError:
                        pass
                    return
                op = header.get("op")
                after_pull = isinstance(op, str) and op.endswith(".pull")
                sent_before = conn.sent
                try:
                    if op == "hello":
                        self._serve_hello(conn, header)
                    elif op == "ping":
                        conn.reply_ok()
                    elif conn.peer_id is None:
                        raise ValueError(f"request {op!r} before hello")
                    else:
                        self.backend.serve(conn, op, header, payload)
                        if conn.state.get("handed_off"):
                            return  # the backend served the connection to its end
                except Exception as e:  # noqa: BLE001 - reported to the peer
                    if conn.state.get("handed_off"):  # the peer no longer reads JSON here
                        logger.warning("serving %s: %s: %s", conn.peer, type(e).__name__, e,
                                       exc_info=True)
                        return
                    # Refused input is the peer's mistake (one line); anything else is ours and
                    # gets its traceback on this side's stderr.
                    refused = isinstance(e, (ValueError, TypeError)) and conn.sent == sent_before
                    logger.warning("serving %r to %s failed: %s: %s", op, conn.peer,
                                   type(e).__name__, e, exc_info=not refused)
                    if conn.sent == sent_before:
                        try:
                            conn.reply_error(e)
                        except MigrationError:
                            return
                    else:
                        # The request was accepted and failed later: one unsolicited error
                        # message, which the destination sees while waiting for data.
                        try:
                            conn.send({"ok": False, "async": True, "type": type(e).__name__,
                                       "error": str(e)})
                        except MigrationError:
                            return
        finally:
            try:
                self.backend.connection_closed(conn)
            except Exception:  # noqa: BLE001
                logger.exception("releasing the state of peer %s failed", conn.peer)

    def _serve_hello(self, conn: Connection, header: Dict[str, Any]) -> None:
        if header.get("protocol") != PROTOCOL:
            raise ValueError(f"hello: peer speaks migration protocol {header.get('protocol')!r}, "
                             f"this endpoint {PROTOCOL} (mixed vllm-ext versions: upgrade both)")
        if header.get("source_id") != self.endpoint_id:
            raise ValueError(f"hello: addressed to endpoint {header.get('source_id')!r}, this is "
                             f"{self.endpoint_id!r} (a stale descriptor?)")
        if header.get("backend") != self.backend.name:
            raise ValueError(f"hello: peer uses backend {header.get('backend')!r}, this endpoint "
                             f"uses {self.backend.name!r}")
        diff = geometry_mismatch(self.cache.geometry(), header.get("geometry") or {})
        if diff:
            raise ValueError(f"hello: cache geometry differs ({diff})")
        conn.peer_id = str(header.get("peer_id"))
        conn.reply_ok(num_blocks=self.cache.num_blocks, endpoint_id=self.endpoint_id)

    @property
    def test_stall(self) -> Optional[tuple]:
        return self._test_stall

    @test_stall.setter
    def test_stall(self, value: Optional[tuple]) -> None:
        self._test_stall = value
        chunk = value[0] if value is not None and isinstance(value[0], int) else -1
        self.test_stall_native[1] = int(value[1] * 1e6) if chunk >= 0 else 0
        self.test_stall_native[0] = chunk

    def test_pause(self, chunk) -> None:
        """Source side, tests only: pause at chunk `chunk` (or at a named step, such as nccl's
        "connect") when test_stall says so."""
        stall = self.test_stall
        if stall is not None and chunk == stall[0]:
            time.sleep(stall[1])

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stops serving, closes control connections and releases the backend's resources;
        returns once the threads that served peers have ended too (at most a few seconds
        for one still inside a transfer)."""
        if self._closed:
            return
        self._closed = True
        self._reaper_stop.set()
        self._server.close()
        with self._links_lock:
            links = list(self._links.values())
            self._links.clear()
            reaper = self._reaper
        if reaper is not None:
            reaper.join(timeout=30)  # it holds a link's lock only while releasing that link
        for link in links:
            # A pull in flight ends by its own deadline; do not wait for it forever (the pull
            # releases its link itself when it ends on a closed endpoint).
            if link.lock.acquire(timeout=_CLOSE_WAIT_S):
                try:
                    self._discard(link)
                finally:
                    link.lock.release()
        self.backend.close()  # ends the pairs served (nccl: their pull servers) ...
        self._server.join_serving()  # ... so that the threads serving them end now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"MigrationEndpoint(backend={self.backend.name!r}, "
                f"at={self._server.host}:{self._server.port}, cache={self.cache!r})")


def wait_for_data(link: PeerLink, done: Callable[[], bool], deadline: Deadline, what: str,
                  expect_reply: bool = True) -> Optional[Dict[str, Any]]:
    """Destination side: waits until `done()` and (when `expect_reply`) the source's reply to
    the current request arrived. MigrationError when the source reports an error, the
    connection closes (the source exited), or the deadline passes."""
    conn = link.conn
    got: Dict[str, Any] = {}

    def check() -> None:
        if conn.readable():
            header = conn.recv_reply(deadline, what)  # raises on an error report or EOF
            if "reply" in got or not expect_reply:
                raise MigrationError(f"{what}: unexpected message from the peer: {header}")
            got["reply"] = header

    def finished() -> bool:
        return ("reply" in got or not expect_reply) and done()

    poll_until(finished, deadline, what, check)
    return got.get("reply")
