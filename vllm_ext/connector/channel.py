"""The lease side channel between instances: a consumer's worker asks a producer's scheduler for
a lease's blocks (and the producer's endpoint descriptor), and tells it to free them.

Wire: frames of a 4-byte big-endian length and that many bytes of UTF-8 JSON (at most
MAX_FRAME bytes; nothing is ever unpickled). Every connection starts with mutual
authentication over the deployment secret:

    server -> client  {"hello": "vllm-ext-lease", "version": V, "nonce": Ns}
    client -> server  {"nonce": Nc, "mac": HMAC(secret, "client" | Ns | Nc)}
    server -> client  {"ok": true, "mac": HMAC(secret, "server" | Nc | Ns)}   (or closes)

then requests `{"op": ..., ...}`, each answered `{"ok": true, ...}` or `{"ok": false, "error"}`.
Every read has a deadline; the server serves at most MAX_CONNECTIONS connections and drops one
idle past IDLE_TIMEOUT_S.
"""

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Optional

from ..migration import auth

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

VERSION = 1
MAX_FRAME = 1 << 20  # a lease of 64k block ids is ~0.5 MiB of JSON
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 600.0
HANDSHAKE_TIMEOUT_S = 5.0
_HELLO = "vllm-ext-lease"


class ChannelError(RuntimeError):
    """The peer could not be reached, failed authentication, broke the protocol, or refused."""


def deployment_secret() -> bytes:
    """The deployment's shared secret (VLLM_EXT_AUTH_SECRET, or the file VLLM_EXT_AUTH_SECRET_FILE
    names; read as the migration endpoints read it). The connector refuses to start without one:
    leases must not be readable by anyone who can reach the port."""
    secret = auth.deployment_secret()
    if secret is None:
        raise RuntimeError(f"VllmExtConnector needs the deployment secret on every instance: set {auth.ENV_SECRET} "
                           f"or {auth.ENV_SECRET_FILE}")
    return secret


def _mac(secret: bytes, role: bytes, first: str, second: str) -> str:
    return hmac.new(secret, role + b"|" + first.encode() + b"|" + second.encode(), hashlib.sha256).hexdigest()


def _deadline_socket(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelError("deadline passed")
    sock.settimeout(left)


def send_frame(sock: socket.socket, message: Dict[str, Any], deadline: float) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ChannelError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
    _deadline_socket(sock, deadline)
    try:
        sock.sendall(struct.pack(">I", len(data)) + data)
    except OSError as e:
        raise ChannelError(f"send failed: {e}") from e


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        _deadline_socket(sock, deadline)
        try:
            chunk = sock.recv(min(n - got, 1 << 16))
        except socket.timeout as e:
            raise ChannelError("read deadline passed") from e
        except OSError as e:
            raise ChannelError(f"receive failed: {e}") from e
        if not chunk:
            raise EOFError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, deadline: float) -> Dict[str, Any]:
    (length,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if length > MAX_FRAME:
        raise ChannelError(f"peer announced a frame of {length} bytes (limit {MAX_FRAME})")
    try:
        message = json.loads(_recv_exact(sock, length, deadline))
    except (UnicodeDecodeError, ValueError) as e:
        raise ChannelError(f"malformed frame: {e}") from e
    if not isinstance(message, dict):
        raise ChannelError(f"malformed frame: expected a JSON object, got {type(message).__name__}")
    return message


class LeaseServer:
    """Serves `handler(op, message) -> reply dict` (raise ValueError to refuse) to authenticated
    clients, one thread per connection."""

    def __init__(self, secret: bytes, handler: Callable[[str, Dict[str, Any]], Dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0):
        self._secret = secret
        self._handler = handler
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        self._active = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="vllm-ext-lease-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            if not self._active.acquire(blocking=False):
                logger.warning("lease channel: refusing %s: %d connections already", addr, MAX_CONNECTIONS)
                sock.close()
                continue
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock, addr), name="vllm-ext-lease-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            nonce_s = secrets.token_hex(16)
            send_frame(sock, {"hello": _HELLO, "version": VERSION, "nonce": nonce_s}, deadline)
            msg = recv_frame(sock, deadline)
            nonce_c, mac = msg.get("nonce"), msg.get("mac")
            if not (isinstance(nonce_c, str) and isinstance(mac, str) and 16 <= len(nonce_c) <= 128
                    and hmac.compare_digest(mac, _mac(self._secret, b"client", nonce_s, nonce_c))):
                logger.warning("lease channel: %s failed authentication (a different deployment secret?)", addr)
                send_frame(sock, {"ok": False, "error": "authentication failed"}, deadline)
                return
            send_frame(sock, {"ok": True, "mac": _mac(self._secret, b"server", nonce_c, nonce_s)}, deadline)
            while not self._closed:
                try:
                    msg = recv_frame(sock, time.monotonic() + IDLE_TIMEOUT_S)
                except EOFError:
                    return
                op = msg.get("op")
                try:
                    if not isinstance(op, str):
                        raise ValueError(f"op: expected a string, got {op!r}")
                    reply = {"ok": True, **self._handler(op, msg)}
                except ValueError as e:
                    reply = {"ok": False, "error": str(e)}
                send_frame(sock, reply, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except (ChannelError, EOFError, OSError) as e:
            logger.debug("lease channel: connection from %s ended: %s", addr, e)
        except Exception:  # noqa: BLE001 - one connection's bug must not end the server
            logger.exception("lease channel: serving %s failed", addr)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
            self._active.release()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)


class LeaseClient:
    """One authenticated connection to a producer's lease server, opened on first use and again
    after a failure. `request` is thread-safe (requests are serialised)."""

    def __init__(self, secret: bytes, host: str, port: int):
        self._secret = secret
        self.host, self.port = host, port
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def _open(self, deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port),
                                            timeout=max(0.001, deadline - time.monotonic()))
        except OSError as e:
            raise ChannelError(f"lease channel {self.host}:{self.port}: cannot connect: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv_frame(sock, deadline)
            if hello.get("hello") != _HELLO or hello.get("version") != VERSION:
                raise ChannelError(f"not a vllm-ext lease channel of version {VERSION}: {str(hello)[:200]}")
            nonce_s, nonce_c = hello.get("nonce"), secrets.token_hex(16)
            if not isinstance(nonce_s, str) or not 16 <= len(nonce_s) <= 128:
                raise ChannelError("malformed hello")
            send_frame(sock, {"nonce": nonce_c, "mac": _mac(self._secret, b"client", nonce_s, nonce_c)}, deadline)
            reply = recv_frame(sock, deadline)
            mac = reply.get("mac")
            if not reply.get("ok") or not isinstance(mac, str) or not hmac.compare_digest(
                    mac, _mac(self._secret, b"server", nonce_c, nonce_s)):
                raise ChannelError("authentication failed (the instances have different deployment secrets?)")
            return sock
        except BaseException:
            sock.close()
            raise

    def request(self, message: Dict[str, Any], timeout: float) -> Dict[str, Any]:
        """The reply's fields; ChannelError when unreachable, unauthenticated, past `timeout`,
        or when the server refuses (its message)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            for attempt in (0, 1):  # a kept connection may have been closed by the peer meanwhile
                fresh = self._sock is None
                try:
                    if self._sock is None:
                        self._sock = self._open(deadline)
                    send_frame(self._sock, message, deadline)
                    reply = recv_frame(self._sock, deadline)
                    break
                except (ChannelError, EOFError, OSError) as e:
                    self._drop()
                    if fresh or attempt == 1 or time.monotonic() >= deadline:
                        if isinstance(e, ChannelError) and str(e).startswith("lease channel"):
                            raise
                        raise ChannelError(f"lease channel {self.host}:{self.port}: {e}") from e
        if not reply.get("ok"):
            raise ChannelError(f"lease channel {self.host}:{self.port} refused: {reply.get('error')}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
