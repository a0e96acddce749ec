"""The lease channel between instances: a consumer's worker asks a producer's scheduler for a
lease's blocks (and the producer's endpoint descriptor), and tells it to free them.

It is the migration control channel (vllm_ext/migration/control.py: bounded frames, deadlines,
connection caps, mutual HMAC authentication over the deployment secret before anything else)
carrying the typed lease messages of vllm_ext/migration/protocol.py (LeaseDescribe,
LeaseAcquire, LeaseRelease and their replies), from a registry of their own: a lease server
accepts none of an endpoint's requests and an endpoint none of these. What this module adds:
the server's request loop, and a client that serialises its requests and reconnects once.
"""

import logging
import threading
import uuid
from typing import Callable, List, Optional, Tuple

from ..errors import MigrationError
from . import auth, protocol
from .control import Connection, ControlServer, open_connection
from .protocol import ProtocolError
from .timing import Deadline

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

MAX_LEASE_BLOCKS = 1 << 20  # block ids in one acquire reply (8 bytes each)
IDLE_TIMEOUT_S = 600.0  # a lease connection silent this long is closed


class ChannelError(RuntimeError):
    """The peer could not be reached, failed authentication, broke the protocol, or refused."""


class ChannelRefused(ChannelError):
    """The peer answered, and refused (its message says why; `kind`: the refusal's type, e.g.
    protocol.RequestEnded's name)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


def deployment_secret() -> bytes:
    """The deployment's shared secret (VLLM_EXT_AUTH_SECRET, or the file VLLM_EXT_AUTH_SECRET_FILE
    names; read as the migration endpoints read it). The connector refuses to start without one:
    leases must not be readable by anyone who can reach the port."""
    secret = auth.deployment_secret()
    if secret is None:
        raise RuntimeError(f"VllmExtConnector needs the deployment secret on every instance: set {auth.ENV_SECRET} "
                           f"or {auth.ENV_SECRET_FILE}")
    return secret


# handler(request) -> (reply message or None for a plain ok, payload); ValueError refuses
Handler = Callable[[protocol.Message], Tuple[Optional[protocol.Message], bytes]]


class LeaseServer:
    """Serves `handler` to authenticated clients (control.ControlServer: one thread each)."""

    def __init__(self, secret: bytes, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self._handler = handler
        self._server = ControlServer(host, port, self._serve, endpoint_id=protocol.LEASE_SERVER_ID, secret=secret,
                                     max_payload=0, name="vllm-ext-lease")
        self.host, self.port = host, self._server.port

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                header, _ = conn.recv(Deadline(IDLE_TIMEOUT_S))
            except (EOFError, MigrationError, ProtocolError) as e:  # closed, idle, broken or oversized
                logger.debug("lease channel: connection from %s ended: %s", conn.peer, e)
                return
            try:
                request = protocol.parse_request(header, protocol.LEASE_REQUESTS)
                reply, payload = self._handler(request)
            except ValueError as e:  # ProtocolError too: refused, nothing done
                conn.reply_error(e)
                continue
            conn.send(protocol.ok_reply(reply), payload)

    def close(self) -> None:
        self._server.close()


class MigrationLease:
    """A source instance's lease for a migration: the reply's fields, its block ids and the
    request's token ids so far."""

    def __init__(self, reply: protocol.MigrateLeaseReply, block_ids: List[int], token_ids: List[int]):
        self.reply, self.block_ids, self.token_ids = reply, block_ids, token_ids

    def __getattr__(self, name):
        return getattr(self.reply, name)


class LeaseClient:
    """One authenticated connection to a producer's lease server, opened on first use and again
    (once) after a failure. Thread-safe: requests are serialised."""

    def __init__(self, secret: bytes, host: str, port: int):
        self._secret = secret
        self.host, self.port = host, port
        self._id = uuid.uuid4().hex
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def _request(self, message: protocol.Message, timeout: float, expect=None):
        """(reply message or header, payload); ChannelError when unreachable, unauthenticated,
        past `timeout`, or refused (with the server's message)."""
        deadline = Deadline(timeout)
        where = f"lease channel {self.host}:{self.port}"
        with self._lock:
            for attempt in (0, 1):  # a kept connection may have been closed by the peer meanwhile
                fresh = self._conn is None
                try:
                    if self._conn is None:
                        self._conn = open_connection(self.host, self.port, "", deadline, client_id=self._id,
                                                     server_id=protocol.LEASE_SERVER_ID, secret=self._secret,
                                                     max_payload=8 * MAX_LEASE_BLOCKS)
                    self._conn.send_message(message, b"", deadline)
                    header, payload = self._conn.recv(deadline)
                    break
                except (MigrationError, ProtocolError, EOFError, OSError) as e:
                    self._drop()
                    if fresh or attempt == 1 or deadline.remaining() <= 0:
                        raise ChannelError(f"{where}: {e}") from e
        if header.get("ok") is not True:
            raise ChannelRefused(f"{where} refused: {str(header.get('error', header))[:1000]}",
                                 str(header.get("type", ""))[:64])
        try:
            return protocol.parse_reply(header, expect), payload
        except ProtocolError as e:
            raise ChannelError(f"{where}: a malformed reply: {e}") from e

    def describe(self, timeout: float) -> protocol.LeaseDescribeReply:
        return self._request(protocol.LeaseDescribe(), timeout, protocol.LeaseDescribeReply)[0]

    def acquire(self, lease: str, hold_s: float, timeout: float) -> Tuple[List[int], int, str, List[int]]:
        """(block ids, num_tokens, prompt_hash, digests: [] or one per block) of a live lease,
        now taken by this pull."""
        reply, payload = self._request(protocol.LeaseAcquire(lease, float(hold_s)), timeout,
                                       protocol.LeaseAcquireReply)
        try:
            if reply.n_digests not in (0, reply.n):
                raise ProtocolError(f"n_digests: {reply.n_digests} for {reply.n} blocks")
            ids = protocol.decode_ids(payload, reply.n + reply.n_digests, "block_ids")
        except ProtocolError as e:
            raise ChannelError(f"lease channel {self.host}:{self.port}: a malformed reply: {e}") from e
        return ids[:reply.n], reply.num_tokens, reply.prompt_hash, ids[reply.n:]

    def release(self, lease: str, timeout: float) -> bool:
        """Ends the lease; True when its blocks stayed its request's throughout."""
        return self._request(protocol.LeaseRelease(lease), timeout, protocol.LeaseReleaseReply)[0].intact

    # ---- live migration (a router -> the source instance) ----------------------------------
    def precopy(self, migration_id: str, timeout: float) -> "MigrationLease":
        return self._lease(protocol.MigratePrecopy(migration_id), timeout)

    def end(self, migration_id: str, timeout: float) -> None:
        self._request(protocol.MigrateEnd(migration_id), timeout)

    def trace(self, migration_id: str, timeout: float, wait_s: float = 0.0) -> protocol.MigrateTraceReply:
        """(A destination) when the request carrying `migration_id` reached it; `wait_s`: the
        destination answers once the request's first step is settled, or after that long."""
        return self._request(protocol.MigrateTrace(migration_id, float(wait_s)), timeout + wait_s,
                             protocol.MigrateTraceReply)[0]

    def _lease(self, message: protocol.Message, timeout: float) -> "MigrationLease":
        reply, payload = self._request(message, timeout, protocol.MigrateLeaseReply)
        if len(payload) != 8 * (reply.n + reply.n_tokens):
            raise ChannelError(f"lease channel {self.host}:{self.port}: a malformed reply: payload of "
                               f"{len(payload)} bytes for {reply.n} + {reply.n_tokens} ids")
        ids = protocol.decode_ids(payload, reply.n + reply.n_tokens, "ids")
        return MigrationLease(reply, ids[:reply.n], ids[reply.n:])

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
