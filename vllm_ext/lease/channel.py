"""The lease channel between an instance and its peers: a consumer's worker asks a producer's
scheduler for a lease's blocks (and the producer's endpoint descriptor) and tells it to free
them; a router asks a migration's source for leases on a running request, and a destination how
a resume went.

It is the transport's control channel (vllm_ext/migration/control.py: bounded frames, deadlines,
connection caps, mutual HMAC authentication over the deployment secret before anything else)
carrying the typed messages of messages.py under their own protocol version. What this module
adds: the server's request loop, and a client that serialises its requests and reconnects once.
"""

import dataclasses
import logging
import threading
import uuid
from typing import Callable, List, Optional, Tuple

from ..errors import MigrationError
from ..migration import protocol
from ..migration.control import Connection, ControlServer, open_connection
from ..migration.protocol import ProtocolError
from ..migration.timing import Deadline
from . import messages
from .messages import LEASE_PROTOCOL, LEASE_REQUESTS, LEASE_SERVER_ID

logger = logging.getLogger(__name__)

MAX_LEASE_BLOCKS = 1 << 20  # block ids in one acquire reply (8 bytes each)
MAX_SOURCE_RANKS = 64  # producer ranks one consumer rank's acquire reply carries digests of
IDLE_TIMEOUT_S = 600.0  # a lease connection silent this long is closed


class ChannelError(RuntimeError):
    """The peer could not be reached, failed authentication, broke the protocol, or refused."""


class ChannelRefused(ChannelError):
    """The peer answered, and refused (its message says why; `kind`: the refusal's type, e.g.
    messages.RequestEnded's name)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


# handler(request) -> (reply message or None for a plain ok, payload); ValueError refuses
Handler = Callable[[protocol.Message], Tuple[Optional[protocol.Message], bytes]]


class LeaseServer:
    """Serves `handler` to authenticated clients (control.ControlServer: one thread each)."""

    def __init__(self, secret: bytes, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self._handler = handler
        self._server = ControlServer(host, port, self._serve, endpoint_id=LEASE_SERVER_ID, secret=secret,
                                     max_payload=0, name="vllm-ext-lease", version=LEASE_PROTOCOL,
                                     contract="lease channel")
        self.host, self.port = host, self._server.port

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                header, _ = conn.recv(Deadline(IDLE_TIMEOUT_S))
            except (EOFError, MigrationError, ProtocolError) as e:  # closed, idle, broken or oversized
                logger.debug("lease channel: connection from %s ended: %s", conn.peer, e)
                return
            try:
                request = protocol.parse_request(header, LEASE_REQUESTS)
                reply, payload = self._handler(request)
            except ValueError as e:  # ProtocolError too: refused, nothing done
                conn.reply_error(e)
                continue
            conn.send(protocol.ok_reply(reply), payload)

    def connection_count(self):
        """(connections served, of which still authenticating)."""
        return self._server.connection_count()

    def close(self) -> None:
        self._server.close()


@dataclasses.dataclass(frozen=True)
class MigrationLease:
    """A source instance's lease for a migration: its reply's fields, its block ids and the
    request's token ids so far (prompt, then output)."""

    lease: str
    num_tokens: int  # tokens whose KV the blocks hold
    num_prompt_tokens: int
    block_size: int
    prompt_hash: str
    fingerprint: str
    endpoint_id: str
    backend: str
    lease_s: float
    block_ids: List[int]
    token_ids: List[int]

    @property
    def n(self) -> int:
        return len(self.block_ids)

    @classmethod
    def of(cls, reply: messages.MigrateLeaseReply, block_ids: List[int], token_ids: List[int]) -> "MigrationLease":
        return cls(reply.lease, reply.num_tokens, reply.num_prompt_tokens, reply.block_size, reply.prompt_hash,
                   reply.fingerprint, reply.endpoint_id, reply.backend, reply.lease_s, block_ids, token_ids)


class LeaseClient:
    """One authenticated connection to an instance's lease server, opened on first use and again
    (once) after a failure. Thread-safe: requests are serialised; blocking (a router runs them
    in a thread). `timeout_s`: a request's deadline where its call gives none."""

    def __init__(self, secret: bytes, host: str, port: int, timeout_s: float = 5.0):
        self._secret = secret
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._id = uuid.uuid4().hex
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def _request(self, message: protocol.Message, timeout: Optional[float], expect=None):
        """(reply message or header, payload); ChannelError when unreachable, unauthenticated,
        past `timeout` (None: timeout_s), or refused (with the server's message)."""
        deadline = Deadline(self.timeout_s if timeout is None else timeout)
        where = f"lease channel {self.host}:{self.port}"
        with self._lock:
            for attempt in (0, 1):  # a kept connection may have been closed by the peer meanwhile
                fresh = self._conn is None
                try:
                    if self._conn is None:
                        self._conn = open_connection(self.host, self.port, "", deadline, client_id=self._id,
                                                     server_id=LEASE_SERVER_ID, secret=self._secret,
                                                     max_payload=8 * MAX_LEASE_BLOCKS, version=LEASE_PROTOCOL)
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

    def describe(self, timeout: Optional[float] = None, rank: int = 0) -> messages.LeaseDescribeReply:
        """The instance's TP rank `rank`: its endpoint descriptor and KV layout."""
        return self._request(messages.LeaseDescribe(rank), timeout, messages.LeaseDescribeReply)[0]

    def acquire(self, lease: str, hold_s: float, timeout: float, num_tokens: int,
                prompt_hash: str, rank: int = 0, ranks: int = 1) -> Tuple[List[int], int, str, List[int]]:
        """(block ids, num_tokens, prompt_hash, digests: [] or one per block and producer rank)
        of a live lease, now taken by this pull of the KV of `num_tokens` tokens hashing to
        `prompt_hash` (the producer refuses a lease on other tokens), by the consumer's TP rank
        `rank` of `ranks` (the digests are those of the producer ranks holding its heads,
        kv_params.source_ranks, one rank's after the other)."""
        reply, payload = self._request(messages.LeaseAcquire(lease, float(hold_s), num_tokens, prompt_hash, rank,
                                                             ranks), timeout, messages.LeaseAcquireReply)
        try:
            if reply.n_digests % max(reply.n, 1) or reply.n_digests > reply.n * MAX_SOURCE_RANKS:
                raise ProtocolError(f"n_digests: {reply.n_digests} for {reply.n} blocks")
            ids = protocol.decode_ids(payload, reply.n + reply.n_digests, "block_ids")
        except ProtocolError as e:
            raise ChannelError(f"lease channel {self.host}:{self.port}: a malformed reply: {e}") from e
        return ids[:reply.n], reply.num_tokens, reply.prompt_hash, ids[reply.n:]

    def release(self, lease: str, timeout: float, rank: int = 0, ranks: int = 1) -> bool:
        """Ends the lease for the consumer's TP rank `rank` of `ranks` (it ends once every rank
        released it; `ranks` 1 ends it now); True when its blocks stayed its request's throughout."""
        return self._request(messages.LeaseRelease(lease, rank, ranks), timeout,
                             messages.LeaseReleaseReply)[0].intact

    # ---- live migration (a router -> a migration's source, or its destination) ------------------
    def precopy(self, migration_id: str, timeout: Optional[float] = None) -> MigrationLease:
        """A lease on the running request's complete blocks, made at the source's next step."""
        reply, payload = self._request(messages.MigratePrecopy(migration_id), timeout, messages.MigrateLeaseReply)
        if len(payload) != 8 * (reply.n + reply.n_tokens):
            raise ChannelError(f"lease channel {self.host}:{self.port}: a malformed reply: payload of "
                               f"{len(payload)} bytes for {reply.n} + {reply.n_tokens} ids")
        ids = protocol.decode_ids(payload, reply.n + reply.n_tokens, "ids")
        return MigrationLease.of(reply, ids[:reply.n], ids[reply.n:])

    def end(self, migration_id: str, timeout: Optional[float] = None) -> None:
        self._request(messages.MigrateEnd(migration_id), timeout)

    def trace(self, migration_id: str, timeout: Optional[float] = None,
              wait_s: float = 0.0) -> messages.MigrateTraceReply:
        """(A destination) when the request carrying `migration_id` reached it; `wait_s`: the
        destination answers once the request's first step is settled, or after that long."""
        timeout = self.timeout_s if timeout is None else timeout
        return self._request(messages.MigrateTrace(migration_id, float(wait_s)), timeout + wait_s,
                             messages.MigrateTraceReply)[0]

    def settled_trace(self, migration_id: str, wait_s: float) -> messages.MigrateTraceReply:
        """The trace once the resume's first step is settled (at most `wait_s`), asked on a
        connection of its own: this client's stays free meanwhile."""
        client = LeaseClient(self._secret, self.host, self.port, self.timeout_s)
        try:
            return client.trace(migration_id, None, wait_s)
        finally:
            client.close()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
