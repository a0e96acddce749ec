"""The control channel between endpoints: length-prefixed messages over one stream connection per
(destination, source) pair, plus the server threads each endpoint runs.

Transport: TCP; between two processes of one host (Linux, one network namespace), an abstract
Unix socket named in the descriptor instead (no file to clean up; a peer in another namespace
fails to connect to it at once and uses TCP). Measured on a 2-core host with Python: a small
message costs 2.4 us of sendall and 10 us one way over the Unix socket, 17 and 35 us over
loopback TCP, and a pull exchanges two.

A message is a frame `!II` (header length, payload length), a UTF-8 JSON header (a dict with
an "op" for requests, "ok" for replies) and an optional binary payload (block ids as int64).
JSON rather than pickle: a server must never execute what a peer sends. Requests on one
connection are answered in order; a source that fails after accepting a request sends one
unsolicited error message, which the destination sees while it waits for its data. A backend
may take a connection over once its pair is built (nccl: binary pulls answered by a thread of
the library, see nccl.py); the endpoint's thread then stops reading it.

The destination never waits for a reply before it starts receiving data.
"""

import array
import json
import logging
import select
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .base import Deadline, MigrationError

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!II")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 30
# A send without a deadline of its own (a server's reply) gives up after this long.
_SEND_TIMEOUT_S = 30.0
# TCP keepalive on control connections: a peer whose host crashed or was cut off (no FIN ever
# arrives) is noticed after about IDLE + INTERVAL * COUNT seconds, and what was built for it
# is released (the server's thread or the pull server sees the connection fail).
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 30, 10, 3
# After a failed accept() (out of file descriptors, say), the server tries again this much later.
_ACCEPT_RETRY_S = 0.1
# join_serving() waits this long in all for the threads serving connections to end.
_CLOSE_JOIN_S = 5.0
# Abstract Unix socket names (a leading NUL byte) exist on Linux only.
LOCAL_SOCKETS = sys.platform.startswith("linux")


def encode_ids(ids: List[int]) -> bytes:
    """int64 little-endian bytes of a list of ids."""
    a = array.array("q", ids)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little endian
        a.byteswap()
    return a.tobytes()


def decode_ids(payload: bytes, count: int, name: str) -> List[int]:
    if len(payload) != 8 * count:
        raise ValueError(f"{name}: payload of {len(payload)} bytes for {count} ids")
    a = array.array("q")
    a.frombytes(payload)
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tolist()


class Connection:
    """One end of a control connection. Not thread-safe: its owner serialises use."""

    def __init__(self, sock: socket.socket, peer: str = ""):
        self.sock = sock
        self.peer = peer  # for messages
        self.peer_id: Optional[str] = None  # endpoint id learned in the hello exchange
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self._closed = False
        self.sent = 0  # messages sent (the server uses it to know if a request was answered)
        self.state: Dict[str, Any] = {}  # the source-side backend's state for this pair

    @classmethod
    def open(cls, host: str, port: int, deadline: Deadline, local: str = "") -> "Connection":
        """A connection to the server at host:port, or at the abstract Unix socket `local`
        (tried first when given; a server in another network namespace is not reachable
        there, and TCP is used)."""
        if local and LOCAL_SOCKETS:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(deadline.remaining(), 1e-3))
                sock.connect("\0" + local)
                return cls(sock, f"{host}:{port}")
            except OSError:
                sock.close()
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 1e-3))
        except OSError as e:
            raise MigrationError(f"control channel: cannot connect to {host}:{port}: {e}") from e
        return cls(sock, f"{host}:{port}")

    # ---- sending ---------------------------------------------------------------------------
    def send(self, header: Dict[str, Any], payload: bytes = b"",
             deadline: Optional[Deadline] = None) -> None:
        data = json.dumps(header, separators=(",", ":")).encode()
        self.send_bytes(_FRAME.pack(len(data), len(payload)) + data + payload, deadline)
        self.sent += 1

    def send_bytes(self, data: bytes, deadline: Optional[Deadline] = None) -> None:
        """Raw bytes, no frame (a backend's own wire format after a hand-over). MigrationError
        when the peer has not taken them by the deadline (without one, after _SEND_TIMEOUT_S):
        a peer that stopped reading (frozen, cut off) must not hold the sender. A send cut
        short leaves the connection unusable; its owner discards it."""
        timeout = _SEND_TIMEOUT_S if deadline is None else deadline.remaining()
        if timeout <= 0:
            raise MigrationError(f"control channel to {self.peer}: the deadline of "
                                 f"{deadline.timeout:g} s passed before the send")
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(data)
        except socket.timeout as e:
            raise MigrationError(f"control channel to {self.peer}: the peer did not take "
                                 f"{len(data)} bytes within {timeout:.3g} s (it stopped "
                                 "reading?)") from e
        except OSError as e:
            raise MigrationError(f"control channel to {self.peer}: send failed: {e}") from e

    def reply_ok(self, **fields) -> None:
        fields["ok"] = True
        self.send(fields)

    def reply_error(self, exc: BaseException) -> None:
        self.send({"ok": False, "type": type(exc).__name__, "error": str(exc)})

    # ---- receiving -------------------------------------------------------------------------
    def recv(self, deadline: Optional[Deadline] = None) -> Tuple[Dict[str, Any], bytes]:
        """The next message. Raises MigrationError on EOF, a broken frame or the deadline;
        without a deadline waits forever (server side, between requests), and raises EOFError
        on a clean close."""
        head = self._recv_exact(_FRAME.size, deadline, allow_eof=deadline is None)
        header_len, payload_len = _FRAME.unpack(head)
        if header_len > _MAX_HEADER or payload_len > _MAX_PAYLOAD:
            raise MigrationError(f"control channel to {self.peer}: frame of {header_len}+"
                                 f"{payload_len} bytes exceeds the limits")
        body = self._recv_exact(header_len + payload_len, deadline)
        try:
            header = json.loads(body[:header_len])
        except ValueError as e:
            raise MigrationError(f"control channel to {self.peer}: bad header: {e}") from e
        if not isinstance(header, dict):
            raise MigrationError(f"control channel to {self.peer}: header is not an object")
        return header, body[header_len:]

    def recv_reply(self, deadline: Deadline, what: str) -> Dict[str, Any]:
        """The next message as a reply: raises MigrationError when it reports an error."""
        header, _ = self.recv(deadline)
        check_reply(header, self.peer, what)
        return header

    def recv_bytes(self, n: int, deadline: Deadline) -> bytes:
        """Exactly n raw bytes; MigrationError on EOF, a broken connection or the deadline."""
        return self._recv_exact(n, deadline)

    def readable(self) -> bool:
        """True when a message (or EOF) is waiting: never blocks."""
        return _poll_readable(self.sock)

    def spin_until_readable(self, seconds: float) -> bool:
        """Polls, without sleeping, for up to `seconds` until a message (or EOF) waits; True
        when one does. A server calls it after each request: the next request of a burst (a
        migration's stages) is then read at once, without the ~40 us of waking a blocked
        thread."""
        end = time.monotonic() + seconds
        ready = _readiness(self.sock)
        while not ready():
            if time.monotonic() >= end:
                return False
        return True

    def closed_by_peer(self) -> bool:
        """True when the peer closed the connection (EOF or reset); never blocks and leaves
        any waiting message in place."""
        if not _poll_readable(self.sock):
            return False
        # NOTE: MSG_DONTWAIT alone is not enough: on a socket with a timeout (every
        # _recv_exact leaves one) Python first waits up to that timeout for data.
        timeout = self.sock.gettimeout()
        try:
            self.sock.setblocking(False)
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            try:
                self.sock.settimeout(timeout)
            except OSError:
                pass

    def _recv_exact(self, n: int, deadline: Optional[Deadline], allow_eof: bool = False) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if deadline is None:
                self.sock.settimeout(None)
            else:
                remaining = deadline.remaining()
                if remaining <= 0:
                    raise MigrationError(f"control channel to {self.peer}: no answer within "
                                         f"the deadline ({deadline.timeout:g} s)")
                self.sock.settimeout(remaining)
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                continue  # the loop re-checks the deadline
            except OSError as e:
                raise MigrationError(f"control channel to {self.peer}: receive failed: {e}") from e
            if k == 0:
                if allow_eof and got == 0:
                    raise EOFError
                raise MigrationError(f"control channel to {self.peer}: connection closed by the "
                                     "peer (process exited?)")
            got += k
        return bytes(buf)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive with the probe timing above, where the platform has the options."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", _KEEPALIVE_COUNT)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _readiness(sock: socket.socket) -> Callable[[], bool]:
    """A check, repeatable without blocking, of whether `sock` has data or EOF waiting. poll(),
    not select(): select() cannot watch descriptors above 1023, common in a serving process."""
    if not hasattr(select, "poll"):  # pragma: no cover - every supported host has poll()
        return lambda: bool(select.select([sock], [], [], 0)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return lambda: bool(poller.poll(0))


def _poll_readable(sock: socket.socket) -> bool:
    """True when `sock` has data or EOF waiting (or is broken); never blocks."""
    try:
        return _readiness(sock)()
    except (OSError, ValueError):
        return True


def check_reply(header: Dict[str, Any], peer: str, what: str) -> None:
    if header.get("ok") is True:
        return
    kind = header.get("type") or "error"
    raise MigrationError(f"{what}: the peer ({peer}) refused: {kind}: "
                         f"{header.get('error', header)}", remote_type=kind)


class ControlServer:
    """Accepts control connections and runs `handle_connection(conn)` on a thread per
    connection (so one slow or dead peer never delays another). Listens on TCP at host:port
    and, when `local` names one, on that abstract Unix socket (`self.local`: the name, or ""
    where there is none)."""

    def __init__(self, host: str, port: int, handle_connection: Callable[[Connection], None],
                 name: str = "migration", local: str = ""):
        self._handle = handle_connection
        self._listeners = [socket.create_server((host, port), reuse_port=False)]
        self.host, self.port = self._listeners[0].getsockname()[:2]
        self.local = ""
        if local and LOCAL_SOCKETS:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind("\0" + local)
                listener.listen()
            except OSError as e:  # TCP still serves every peer
                listener.close()
                logger.warning("control server: no local socket %r (%s); peers use TCP", local, e)
            else:
                self._listeners.append(listener)
                self.local = local
        self._connections: List[Connection] = []
        self._serving: List[threading.Thread] = []  # one per connection being served
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept_loop, args=(listener,),
                                          name=f"{name}-accept", daemon=True)
                         for listener in self._listeners]
        for thread in self._threads:
            thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of descriptors or memory, an aborted handshake: this peer fails, the
                # next one is served (a dead accept thread would leave every later peer
                # waiting out its deadline on a backlog nobody reads).
                logger.warning("control server: accept failed (%s); retrying", e)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "local peer"
            try:
                conn = Connection(sock, peer)
            except OSError as e:
                logger.warning("control server: connection from %s unusable (%s)", peer, e)
                sock.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            thread = threading.Thread(target=self._run, args=(conn,), name="migration-serve",
                                      daemon=True)
            try:
                with self._lock:
                    self._serving.append(thread)
                    thread.start()
            except RuntimeError as e:  # no thread to serve it: the peer sees the close
                logger.warning("control server: cannot serve %s (%s)", peer, e)
                with self._lock:
                    self._connections.remove(conn)
                    self._serving.remove(thread)
                conn.close()

    def _run(self, conn: Connection) -> None:
        try:
            self._handle(conn)
        except Exception as e:  # noqa: BLE001 - logged and reported, never a silent close
            if not self._closed:
                logger.exception("migration control connection from %s failed", conn.peer)
                try:  # the peer reads why instead of a bare "connection closed"
                    conn.send({"ok": False, "async": True, "type": type(e).__name__,
                               "error": f"the source's server failed: {e}"})
                except Exception:  # noqa: BLE001 - the connection itself is what broke
                    pass
        finally:
            conn.close()
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
                if threading.current_thread() in self._serving:
                    self._serving.remove(threading.current_thread())

    def close(self) -> None:
        """Stops accepting and closes every connection; join_serving() then waits for the
        threads that served them."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone may not
            except OSError:
                pass
            listener.close()
        for conn in connections:
            conn.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def join_serving(self, timeout: float = _CLOSE_JOIN_S) -> bool:
        """After close(): waits up to `timeout` seconds in all for the threads that served
        connections to end. They release what they served with (a backend's pairs), which
        must not be left to the interpreter's exit: gloo's threads abort the process then.
        False (and a warning) when one still runs."""
        with self._lock:
            serving = [t for t in self._serving if t is not threading.current_thread()]
        end = time.monotonic() + timeout
        for thread in serving:
            thread.join(timeout=max(end - time.monotonic(), 0))
        still = [t for t in serving if t.is_alive()]
        if still:
            logger.warning("control server: %d connection(s) still being served %g s after "
                           "close (a transfer that ends by its deadline)", len(still), timeout)
        return not still
