"""The control channel between endpoints: one stream connection per (destination, source) pair,
carrying protocol.py's frames, and the server threads each endpoint runs.

Transport: TCP (optionally TLS); between two processes of one host and one network namespace,
an abstract Unix socket named in the descriptor instead (a few us per message instead of tens;
a peer in another namespace fails to connect to it at once and uses TCP). The server accepts
a local connection only from a process of its own user (SO_PEERCRED), and every connection,
local or not, must authenticate (protocol.auth_proof) before it learns anything.

Bounds: a frame's sizes are checked before its body is read; once a frame has started, the rest
must arrive within _FRAME_S; an unauthenticated connection is dropped after _AUTH_S; at most
_MAX_CONNECTIONS connections are served at once, and at most _MAX_UNAUTHENTICATED of them are
still authenticating.
"""

import logging
import os
import secrets
import select
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import MigrationError
from . import protocol
from .protocol import FRAME, ProtocolError
from .timing import Deadline

logger = logging.getLogger(__name__)

# A send without a deadline of its own (a server's reply) gives up after this long.
_SEND_TIMEOUT_S = 30.0
# TCP keepalive on control connections: a peer whose host crashed or was cut off is noticed
# after about IDLE + INTERVAL * COUNT seconds.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 30, 10, 3
_ACCEPT_RETRY_S = 0.1  # after a failed accept() (out of descriptors, say)
_CLOSE_JOIN_S = 5.0  # join_serving() waits this long in all for the serving threads
_AUTH_S = 10.0  # an unauthenticated connection has this long to authenticate
_FIRST_FRAME_S = 2.0  # and this long to send its first frame (a client sends it as it connects)
_FRAME_S = 10.0  # the rest of a frame, once its first byte arrived
_MAX_CONNECTIONS = 256
_MAX_UNAUTHENTICATED = 16
_REFUSAL_LOG_S = 10.0  # at most one log line per cause and this many seconds
LOCAL_SOCKETS = sys.platform.startswith("linux")  # abstract Unix socket names: Linux only
_AUTH_FAILED = "authentication failed"


class TlsOptions:
    """TLS for TCP control connections between hosts: this endpoint's certificate and key, and
    the CA that signs its peers' certificates (both sides check each other). Local (Unix
    socket) connections stay plain: only processes of the same user reach them."""

    def __init__(self, certfile: str, keyfile: str, cafile: str):
        for name, path in (("certfile", certfile), ("keyfile", keyfile), ("cafile", cafile)):
            if not isinstance(path, str) or not os.path.isfile(path):
                raise ValueError(f"tls: {name} {path!r} is not a file")
        self.server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
        self.server.load_cert_chain(certfile, keyfile)
        self.server.verify_mode = ssl.CERT_REQUIRED
        self.client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
        self.client.load_cert_chain(certfile, keyfile)
        self.client.check_hostname = False  # peers are named by address; the CA decides


class Connection:
    """One end of a control connection. Not thread-safe: its owner serialises use."""

    def __init__(self, sock: socket.socket, peer: str = "", max_payload: int = 0):
        self.sock = sock
        self.peer = peer  # for messages
        self.local = sock.family == socket.AF_UNIX
        self.max_payload = max_payload  # the largest payload this side accepts
        self.peer_id: Optional[str] = None  # the authenticated peer's endpoint id
        if not self.local:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self._closed = False
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._ready = _readiness(sock)  # one poll object for the connection's life
        self.sent = 0  # messages sent (a server tells by it whether a request was answered)

    # ---- addresses: where a data path between the two ends meets ---------------------------
    def local_address(self) -> str:
        """This end's address on the connection (loopback for a local socket)."""
        return "127.0.0.1" if self.local else self.sock.getsockname()[0]

    def peer_address(self) -> str:
        """The peer's address on the connection (loopback for a local socket)."""
        return "127.0.0.1" if self.local else self.sock.getpeername()[0]

    # ---- sending ---------------------------------------------------------------------------
    def send(self, header: Dict[str, Any], payload: bytes = b"",
             deadline: Optional[Deadline] = None) -> None:
        self.send_bytes(protocol.encode_frame(header, payload), deadline)
        self.sent += 1

    def send_message(self, message: protocol.Message, payload: bytes = b"",
                     deadline: Optional[Deadline] = None) -> None:
        self.send(message.header(), payload, deadline)

    def send_bytes(self, data: bytes, deadline: Optional[Deadline] = None) -> None:
        """Raw bytes. MigrationError when the peer has not taken them by the deadline (without
        one, after _SEND_TIMEOUT_S): a peer that stopped reading must not hold the sender. A
        send cut short leaves the connection unusable; its owner closes it."""
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

    def reply_ok(self, message: Optional[protocol.Message] = None, **fields) -> None:
        self.send(dict(protocol.ok_reply(message), **fields))

    def reply_error(self, exc: BaseException, asynchronous: bool = False) -> None:
        self.send(protocol.error_reply(type(exc).__name__, str(exc), asynchronous))

    # ---- receiving -------------------------------------------------------------------------
    def recv(self, deadline: Optional[Deadline] = None) -> Tuple[Dict[str, Any], bytes]:
        """The next message. Without a deadline it waits for the frame's first byte forever
        (a server between requests; EOFError on a clean close), then for the rest _FRAME_S.
        MigrationError on EOF inside a frame, a broken connection or the deadline;
        ProtocolError for a frame out of bounds (nothing of its body is read)."""
        if deadline is None:
            first = self._recv_exact(1, None, allow_eof=True)
            deadline = Deadline(_FRAME_S)
            head = first + self._recv_exact(FRAME.size - 1, deadline)
        else:
            head = self._recv_exact(FRAME.size, deadline)
        header_len, payload_len = FRAME.unpack(head)
        protocol.check_frame(header_len, payload_len, self.max_payload)
        header = protocol.decode_header(self._recv_exact(header_len, deadline))
        payload = self._recv_exact(payload_len, deadline) if payload_len else b""
        return header, payload

    def recv_reply(self, deadline: Deadline, what: str, expect: Optional[type] = None):
        """The next message as a reply: the typed message `expect` (else the header); MigrationError
        when it is a refusal, a report of a failure or closing, or malformed."""
        header, _ = self.recv(deadline)
        message = check_reply(header, self.peer, what, expect)
        return header if expect is None else message

    def recv_bytes(self, n: int, deadline: Deadline) -> bytes:
        """Exactly n raw bytes; MigrationError on EOF, a broken connection or the deadline."""
        return self._recv_exact(n, deadline)

    def readable(self) -> bool:
        """True when a message (or EOF) is waiting: never blocks."""
        if self._tls and self.sock.pending():
            return True
        try:
            return self._ready()
        except (OSError, ValueError):
            return True

    def spin_until_readable(self, seconds: float) -> bool:
        """Polls, without sleeping, for up to `seconds` until a message (or EOF) waits: the next
        request of a burst (a migration's stages) is then read without the ~40 us of waking a
        blocked thread."""
        end = time.monotonic() + seconds
        while not self.readable():
            if time.monotonic() >= end:
                return False
        return True

    def closed_by_peer(self) -> bool:
        """True when the peer closed the connection (EOF or reset); never blocks and leaves
        any waiting message in place."""
        if not _poll_readable(self.sock) or isinstance(self.sock, ssl.SSLSocket):
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

    def shutdown(self) -> None:
        """From another thread: ends the connection both ways, which wakes its reader (its
        owner then closes it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def check_reply(header: Dict[str, Any], peer: str, what: str,
                expect: Optional[type] = None) -> Optional[protocol.Message]:
    """The message of a positive reply; MigrationError for a refusal, an asynchronous failure,
    the source closing, or a malformed reply."""
    if header.get("op") == protocol.Closing.op:
        raise MigrationError(f"{what}: the peer ({peer}) is closing: {str(header.get('reason'))[:200]}",
                             remote_type="ClosedError")
    if header.get("ok") is True:
        try:
            return protocol.parse_reply(header, expect)
        except ProtocolError as e:
            raise MigrationError(f"{what}: a malformed reply from the peer ({peer}): {e}") from None
    kind = str(header.get("type") or "error")[:64]
    raise MigrationError(f"{what}: the peer ({peer}) refused: {kind}: "
                         f"{str(header.get('error', header))[:4096]}", remote_type=kind)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", _KEEPALIVE_COUNT)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _readiness(sock: socket.socket) -> Callable[[], bool]:
    """A repeatable non-blocking check of whether `sock` has data or EOF waiting. poll(), not
    select(): select() cannot watch descriptors above 1023, common in a serving process."""
    if not hasattr(select, "poll"):  # pragma: no cover - every supported host has poll()
        return lambda: bool(select.select([sock], [], [], 0)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return lambda: bool(poller.poll(0))


def _poll_readable(sock: socket.socket) -> bool:
    try:
        return _readiness(sock)()
    except (OSError, ValueError):
        return True


def _peer_uid(sock: socket.socket) -> Optional[int]:
    """The user id of the process at the other end of a local socket (Linux), else None."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)[1]


# ---- the client's side of a connection ----------------------------------------------------------
def open_connection(host: str, port: int, local: str, deadline: Deadline, *, client_id: str,
                    server_id: str, secret: bytes, tls: Optional[TlsOptions] = None,
                    max_payload: int = 0, version: int = protocol.PROTOCOL) -> Connection:
    """An authenticated connection to the endpoint `server_id` at host:port, or at its abstract
    Unix socket `local` (tried first when given), speaking protocol `version` (the endpoint's, or
    another contract's carried on the same frames). MigrationError when it cannot be reached,
    when it fails to prove it holds `secret`, or refuses this side's proof."""
    conn = None
    if local and LOCAL_SOCKETS:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline.remaining(), 1e-3))
            sock.connect("\0" + local)
            conn = Connection(sock, f"{host}:{port}", max_payload)
        except OSError:
            sock.close()
    if conn is None:
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 1e-3))
            _refuse_self_connection(sock)
        except OSError as e:
            raise MigrationError(f"control channel: cannot connect to {host}:{port}: {e}") from e
        if tls is not None:
            try:
                sock = tls.client.wrap_socket(sock, server_hostname=host)
            except (OSError, ssl.SSLError) as e:
                sock.close()
                raise MigrationError(f"control channel: TLS with {host}:{port} failed: {e}") from e
        conn = Connection(sock, f"{host}:{port}", max_payload)
    try:
        _authenticate_client(conn, deadline, client_id, server_id, secret, version)
    except BaseException:
        conn.close()
        raise
    return conn


def _refuse_self_connection(sock: socket.socket) -> None:
    """A TCP connect to a local port nobody listens on can pick that same port as its own and
    connect to itself (a simultaneous open). Retrying clients (a consumer whose producer is not
    up yet) would then hold the port the producer is about to bind, and, closed the usual way,
    keep it in TIME-WAIT for a minute (which SO_REUSEADDR does not get past): reset and refused."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return
    if local == peer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
        sock.close()
        raise ConnectionRefusedError(f"connected to itself ({local[0]}:{local[1]}): nothing listens there")


def _authenticate_client(conn: Connection, deadline: Deadline, client_id: str, server_id: str,
                         secret: bytes, version: int = protocol.PROTOCOL) -> None:
    nonce = secrets.token_bytes(protocol.NONCE_BYTES)
    conn.send_message(protocol.AuthHello(version, client_id, server_id, nonce.hex()), b"", deadline)
    challenge = conn.recv_reply(deadline, "authentication", protocol.AuthChallenge)
    server_nonce = bytes.fromhex(challenge.nonce)
    expected = protocol.auth_proof(secret, "server", client_id, server_id, nonce, server_nonce)
    if not protocol.proofs_match(expected, bytes.fromhex(challenge.proof)):
        raise MigrationError(f"authentication: the peer at {conn.peer} did not prove it holds the "
                             "secret (a wrong secret, or not the endpoint of this descriptor)")
    proof = protocol.auth_proof(secret, "client", client_id, server_id, nonce, server_nonce)
    conn.send_message(protocol.AuthProof(proof.hex()), b"", deadline)
    conn.recv_reply(deadline, "authentication")
    conn.peer_id = server_id


# ---- the server ------------------------------------------------------------------------------
class ControlServer:
    """Accepts control connections, authenticates each on its own thread and then runs
    `handle(conn)` there (one slow or dead peer never delays another). Listens on TCP at
    host:port and, when `local` names one, on that abstract Unix socket (`self.local`: the
    name, or "" where there is none). `version`: the protocol its peers must speak, of
    `contract` (the endpoint's, or another carried on the same frames, such as the lease
    channel's; both are all a peer learns before it authenticates)."""

    def __init__(self, host: str, port: int, handle: Callable[[Connection], None], *, endpoint_id: str,
                 secret: bytes, max_payload: int, name: str = "migration", local: str = "",
                 tls: Optional[TlsOptions] = None, version: int = protocol.PROTOCOL, contract: str = "migration"):
        self._handle = handle
        self._version, self._contract = version, contract
        self._endpoint_id = endpoint_id
        self._secret = secret
        self._max_payload = max_payload
        self._tls = tls
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
        self._authenticated: List[Connection] = []
        self._serving: List[threading.Thread] = []
        # connections still authenticating, oldest first -> whether they sent their hello yet
        self._pending: Dict[Connection, bool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._logged: Dict[str, float] = {}
        self._threads = [threading.Thread(target=self._accept_loop, args=(listener,),
                                          name=f"{name}-accept", daemon=True)
                         for listener in self._listeners]
        for thread in self._threads:
            thread.start()

    def _log_once(self, cause: str, message: str, *args) -> None:
        """A warning per cause at most every _REFUSAL_LOG_S (a flood must not flood the log)."""
        now = time.monotonic()
        with self._lock:
            if now - self._logged.get(cause, -_REFUSAL_LOG_S) < _REFUSAL_LOG_S:
                return
            self._logged[cause] = now
        logger.warning(message, *args)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except OSError as e:
                if self._closed:
                    return
                logger.warning("control server: accept failed (%s); retrying", e)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "local peer"
            with self._lock:
                full = len(self._connections) >= _MAX_CONNECTIONS
                evicted = None if full else self._evict_for(peer)
                closed = self._closed
            if evicted is not None:
                self._log_once("evict", "control server: %d connections authenticating (limit %d): closed "
                               "the oldest%s, from %s, for %s", _MAX_UNAUTHENTICATED, _MAX_UNAUTHENTICATED,
                               "" if evicted[1] else " silent one", evicted[0].peer, peer)
                evicted[0].shutdown()
            if closed or full:
                if full:
                    self._log_once("full", "control server: refusing %s: %d connections served (limit %d)",
                                   peer, len(self._connections), _MAX_CONNECTIONS)
                sock.close()
                if closed:
                    return
                continue
            try:
                conn = Connection(sock, peer, self._max_payload)
            except OSError as e:
                logger.warning("control server: connection from %s unusable (%s)", peer, e)
                sock.close()
                continue
            thread = threading.Thread(target=self._run, args=(conn,), name="migration-serve", daemon=True)
            with self._lock:
                self._connections.append(conn)
                self._pending[conn] = False
                self._serving.append(thread)
            try:
                thread.start()
            except RuntimeError as e:  # no thread to serve it: the peer sees the close
                logger.warning("control server: cannot serve %s (%s)", peer, e)
                self._forget(conn, thread, counted=True)
                conn.close()

    def _evict_for(self, peer: str) -> Optional[Tuple[Connection, bool]]:
        """(Under the lock) when _MAX_UNAUTHENTICATED connections are authenticating, makes room
        for `peer`'s: drops the oldest of the source holding the most of them, a silent one
        (no hello yet) before one that spoke, and returns it (to be shut down) with whether it
        spoke. An unauthenticated flood thus evicts its own connections, and a peer that
        authenticates at once gets in while it lasts."""
        if len(self._pending) < _MAX_UNAUTHENTICATED:
            return None
        by_source: Dict[str, List[Connection]] = {}
        for conn in self._pending:  # oldest first
            by_source.setdefault(conn.peer.rsplit(":", 1)[0], []).append(conn)
        crowd = max(by_source.values(), key=len)
        # silent: no hello read, and none waiting (a peer sends it as it connects, maybe before
        # its serving thread first reads)
        victim = next((c for c in crowd if not self._pending[c] and not c._ready()), crowd[0])
        return victim, self._pending.pop(victim)

    def _forget(self, conn: Connection, thread: threading.Thread, counted: bool) -> None:
        """Drops a connection from the books; `counted`: it is still counted as authenticating."""
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
            if conn in self._authenticated:
                self._authenticated.remove(conn)
            if counted:
                self._pending.pop(conn, None)
            if thread in self._serving:
                self._serving.remove(thread)

    def _run(self, conn: Connection) -> None:
        authenticated = False
        try:
            try:
                authenticated = self._authenticate(conn)
            finally:
                with self._lock:
                    self._pending.pop(conn, None)
                    if authenticated:
                        self._authenticated.append(conn)
            if authenticated and not self._closed:
                self._handle(conn)
        except Exception as e:  # noqa: BLE001 - logged and reported, never a silent close
            if not self._closed:
                logger.exception("migration control connection from %s failed", conn.peer)
                if authenticated:  # the peer reads why instead of a bare "connection closed"
                    try:
                        conn.reply_error(MigrationError(f"the source's server failed: {type(e).__name__}: {e}"),
                                        asynchronous=True)
                    except Exception:  # noqa: BLE001 - the connection itself is what broke
                        pass
        finally:
            conn.close()
            self._forget(conn, threading.current_thread(), counted=False)

    def _authenticate(self, conn: Connection) -> bool:
        """The server's half of the exchange; False (logged, connection to be closed) when the
        peer fails it. Before it succeeds the peer learns the protocol version, nothing else."""
        deadline = Deadline(_AUTH_S)
        if conn.local:
            uid = _peer_uid(conn.sock)
            if uid != os.getuid():
                self._log_once("uid", "control server: refused a local connection from user id %s "
                               "(this endpoint runs as %d)", uid, os.getuid())
                return False
        elif self._tls is not None:
            try:
                conn.sock.settimeout(max(deadline.remaining(), 1e-3))
                conn.sock = self._tls.server.wrap_socket(conn.sock, server_side=True)
                conn._tls, conn._ready = True, _readiness(conn.sock)
            except (OSError, ssl.SSLError) as e:
                self._log_once("tls", "control server: TLS with %s failed: %s", conn.peer, e)
                return False
        try:
            conn.max_payload = 0  # nothing but headers until authenticated
            header, _ = conn.recv(Deadline(min(_FIRST_FRAME_S, deadline.remaining())))
            if header.get("op") != protocol.AuthHello.op:
                raise ProtocolError("authentication required first")
            with self._lock:
                if conn in self._pending:
                    self._pending[conn] = True  # it spoke: evicted after the silent ones
            protocol.check_int("protocol", header.get("protocol"), 0, 1 << 31)
            if header["protocol"] != self._version:
                conn.reply_error(ProtocolError(
                    f"{self._contract} protocol {header['protocol']} there, {self._version} here (mixed "
                    "vllm-ext versions: upgrade both)"))
                self._log_once("version", "control server: %s speaks %s protocol %s, this "
                               "server %d", conn.peer, self._contract, header["protocol"], self._version)
                return False
            hello = protocol.AuthHello.parse(header)
            if hello.server_id != self._endpoint_id:
                raise ProtocolError("not addressed to this endpoint")
            server_nonce = secrets.token_bytes(protocol.NONCE_BYTES)
            client_nonce = bytes.fromhex(hello.nonce)
            mine = protocol.auth_proof(self._secret, "server", hello.client_id, hello.server_id,
                                       client_nonce, server_nonce)
            conn.send(protocol.ok_reply(protocol.AuthChallenge(server_nonce.hex(), mine.hex())), b"", deadline)
            header, _ = conn.recv(deadline)
            if header.get("op") != protocol.AuthProof.op:
                raise ProtocolError("expected the client's proof")
            theirs = bytes.fromhex(protocol.AuthProof.parse(header).proof)
            expected = protocol.auth_proof(self._secret, "client", hello.client_id, hello.server_id,
                                           client_nonce, server_nonce)
            if not protocol.proofs_match(expected, theirs):
                raise ProtocolError("wrong proof")
            conn.reply_ok()
        except (ProtocolError, MigrationError, EOFError) as e:
            self._log_once(f"auth {conn.peer.rsplit(':', 1)[0]}", "control server: %s failed "
                           "authentication (%s); connection closed", conn.peer, e)
            try:
                conn.send(protocol.error_reply("MigrationError", _AUTH_FAILED), deadline=Deadline(0.5))
            except MigrationError:
                pass
            return False
        conn.peer_id = hello.client_id
        conn.max_payload = self._max_payload
        return True

    def notify_closing(self, reason: str) -> None:
        """Tells every authenticated peer that this endpoint is closing (best effort, bounded):
        a pull in flight fails at once instead of at its deadline."""
        with self._lock:
            connections = list(self._authenticated)
        for conn in connections:
            try:
                conn.send_message(protocol.Closing(reason[:1024]), b"", Deadline(0.05))
            except (MigrationError, OSError):
                pass

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

    def connection_count(self) -> Tuple[int, int]:
        """(connections served, of which still authenticating)."""
        with self._lock:
            return len(self._connections), len(self._pending)

    def join_serving(self, timeout: float = _CLOSE_JOIN_S) -> bool:
        """After close(): waits up to `timeout` seconds in all for the serving threads to end.
        They release what they served with (a backend's pairs), which must not be left to the
        interpreter's exit: gloo's threads abort the process then. False when one still runs."""
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
