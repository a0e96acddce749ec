"""The migration wire protocol, in one place: its version, the frames, the block-id codec, one
typed class per control message, the authentication transcript and the binary pull frames of
the library's pull server (csrc/vllm_ext.h declares the same structs). It imports nothing from
vllm_ext, so both sides of a pair, the tests and other tools can use it alone.

A control message is a frame `!II` (header length, payload length), a UTF-8 JSON object (the
header: "op" names a request, "ok" marks a reply) and an optional binary payload (block ids as
int64 little endian). JSON, never pickle: a server must not execute what a peer sends. Every
header is checked once here, against its class: a missing, extra or mistyped field, or a value
out of its range, is a ProtocolError (a ValueError: the request is refused, nothing is done).

A connection starts with the authentication exchange (see `auth_proof`), before which a
server answers nothing but the version check: no endpoint id, backend, geometry or block count.
"""

import array
import dataclasses
import hashlib
import hmac
import json
import struct
import sys
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

# The version both sides of a pair must speak; a mismatch is refused at the first message.
# 2: nccl chunks ramp 1, 2, 4, ... blocks; the nccl connect carries copy_ctas.
# 3: after nccl.connect, the connection carries binary pulls to the library's pull server.
# 4: an nccl pair has lanes, one communicator each (connect carries their uids).
# 5: mutual HMAC authentication before any other message; typed messages; gloo's rendezvous
#    address is the control connection's (no address travels in a message); "closing".
# 6: the vLLM connector's lease messages (lease.*), served by a lease server of their own
#    (LEASE_REQUESTS): an endpoint's server accepts none of them, a lease server none of REQUESTS.
# 7: live migration's messages (migrate.*) on the lease server; a release answers whether the
#    blocks stayed the request's throughout (LeaseReleaseReply); an acquire carries the blocks'
#    digests.
# 8: a migration's last lease is a pre-copy's, taken while the request runs (migrate.stop and
#    migrate.take are gone).
# 9: migrate.trace: when a resumed request reached the destination's API server and scheduler.
# 10: an acquire's block digests are ops.block_digests (the library's weighted word sum).
# 11: lease.describe.reply says how the instance draws seeded requests' numbers (`sampler`);
#     migrate.trace.reply says whether the resume's load failed with a later step already in
#     flight (`unsafe`: the router discards that leg).
# 12: migrate.trace may wait (`wait_s`) until the resume's first step is settled (scheduled, and
#     the result of the KV load before it known); its reply says whether it is (`settled`).
# 13: lease.describe.reply says the output limits the instance's OpenAI server applies
#     (`default_max_tokens`, `max_tokens_cap`).
PROTOCOL = 13

FRAME = struct.Struct("!II")
MAX_HEADER_BYTES = 64 << 10  # a header is a small JSON object; refused past this, unread
# Bytes of a frame's payload a server takes before it knows the request: ids of one pull.
# Past the request's own bound (8 bytes per id, at most the source's block count) it is refused.
MAX_IDS_PER_PULL = 1 << 24
MAX_PAYLOAD_BYTES = 8 * MAX_IDS_PER_PULL

NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
_TRANSCRIPT = b"vllm-ext migration auth v1"

# Bounds of the pipeline parameters a destination asks a source for (a source refuses others).
MAX_STRIPES = 8  # gloo connections per pair
MAX_LANES = 8  # nccl communicators per pair (VLLM_EXT_MAX_LANES)
MAX_SLOT_BYTES = 1 << 30  # one staging slot; each side allocates two per lane or stripe set
MAX_COPY_CTAS = (1 << 31) - 1
MAX_TIMEOUT_S = 1e6
# Lease messages (the vLLM connector): how long an acquire may hold a lease, and the size of the
# JSON objects a describe reply carries.
MAX_HOLD_S = 3600.0
MAX_DESCRIBE_BYTES = 16 << 10
# The server id a lease server authenticates as (it serves no endpoint of its own).
LEASE_SERVER_ID = "vllm-ext-lease"
MAX_WALL_CLOCK_S = 1e11  # a time.time() in a message (migrate.trace.reply)
MAX_TRACE_WAIT_S = 60.0  # how long a migrate.trace may wait for the resume's first step


class ProtocolError(ValueError):
    """A message that breaks the protocol: malformed, of the wrong version, or out of bounds."""


class RequestEnded(ValueError):
    """A source's refusal of a migration's lease: the request ended there (or was never there).
    Its reply's `type` names this class; the router then lets the source's stream finish."""


# ---- ids ------------------------------------------------------------------------------------
def encode_ids(ids: List[int]) -> bytes:
    """int64 little-endian bytes of a list of ids (each already checked to fit)."""
    a = array.array("q", ids)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little endian
        a.byteswap()
    return a.tobytes()


def decode_ids(payload: bytes, count: int, name: str) -> List[int]:
    if len(payload) != 8 * count:
        raise ProtocolError(f"{name}: payload of {len(payload)} bytes for {count} ids")
    a = array.array("q")
    a.frombytes(payload)
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tolist()


# ---- frames ---------------------------------------------------------------------------------
def encode_frame(header: Dict[str, Any], payload: bytes = b"") -> bytes:
    data = json.dumps(header, separators=(",", ":")).encode()
    return FRAME.pack(len(data), len(payload)) + data + payload


def check_frame(header_len: int, payload_len: int, max_payload: int) -> None:
    """Refuses a frame before any of its body is read or allocated."""
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame: header of {header_len} bytes, at most {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"frame: payload of {payload_len} bytes, at most {max_payload} here")


def decode_header(data: bytes) -> Dict[str, Any]:
    try:
        header = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"frame: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame: the header is not a JSON object")
    return header


# ---- typed messages -------------------------------------------------------------------------
def _check_int(name: str, value, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{name}: expected an integer in [{lo}, {hi}], got {value!r}")


def _check_number(name: str, value, lo: float, hi: float, zero: bool = False) -> None:
    """A number in (lo, hi] (`zero`: or exactly 0)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or not (lo < value <= hi or (zero and value == 0))):
        raise ProtocolError(f"{name}: expected {'0 or ' if zero else ''}a number in ({lo:g}, {hi:g}], got {value!r}")


def _check_hex(name: str, value, nbytes: int) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise ProtocolError(f"{name}: expected {nbytes} bytes as hex, got {str(value)[:80]!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{name}: not hex: {value[:80]!r}") from None


def _check_str(name: str, value, max_len: int = 256) -> None:
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{name}: expected a string of at most {max_len} characters, got "
                            f"{str(value)[:80]!r}")


_FIELD_CHECKS = {
    "protocol": lambda v: _check_int("protocol", v, 0, 1 << 31),
    "timeout": lambda v: _check_number("timeout", v, 0, MAX_TIMEOUT_S),
    "n": lambda v: _check_int("n", v, 1, MAX_IDS_PER_PULL),
    "stripes": lambda v: _check_int("stripes", v, 1, MAX_STRIPES),
    "chunk_blocks": lambda v: _check_int("chunk_blocks", v, 1, 1 << 31),
    "copy_ctas": lambda v: _check_int("copy_ctas", v, 0, MAX_COPY_CTAS),
    "store_port": lambda v: _check_int("store_port", v, 1, 65535),
    "num_blocks": lambda v: _check_int("num_blocks", v, 0, 1 << 62),
    "pid": lambda v: _check_int("pid", v, 0, 1 << 31),
    "nonce": lambda v: _check_hex("nonce", v, NONCE_BYTES),
    "proof": lambda v: _check_hex("proof", v, PROOF_BYTES),
    "client_id": lambda v: _check_str("client_id", v, 64),
    "server_id": lambda v: _check_str("server_id", v, 64),
    "backend": lambda v: _check_str("backend", v, 32),
    "hostname": lambda v: _check_str("hostname", v, 255),
    "gen": lambda v: _check_str("gen", v, 64),
    "reason": lambda v: _check_str("reason", v, 1024),
    "sampler": lambda v: _check_str("sampler", v, 128),
}


def _check_geometry(value) -> None:
    if (not isinstance(value, dict) or len(value) > 32
            or not all(isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool)
                       for k, v in value.items())):
        raise ProtocolError(f"geometry: expected an object of integers and strings, got "
                            f"{str(value)[:120]}")


def _check_uids(value) -> None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_LANES:
        raise ProtocolError(f"uids: expected a list of 1 to {MAX_LANES} NCCL unique ids")
    for uid in value:
        _check_hex("uids", uid, 128)


def _check_handle(value) -> None:
    if not isinstance(value, dict) or len(json.dumps(value)) > MAX_HEADER_BYTES // 2:
        raise ProtocolError("handle: expected an IPC handle object")


def _check_object(name: str):
    def check(value) -> None:
        if not isinstance(value, dict) or len(json.dumps(value)) > MAX_DESCRIBE_BYTES:
            raise ProtocolError(f"{name}: expected a JSON object of at most {MAX_DESCRIBE_BYTES} bytes")
    return check


_FIELD_CHECKS.update(geometry=_check_geometry, uids=_check_uids, handle=_check_handle,
                     lease=lambda v: _check_hex("lease", v, 16),
                     hold_s=lambda v: _check_number("hold_s", v, 0, MAX_HOLD_S),
                     num_tokens=lambda v: _check_int("num_tokens", v, 1, 1 << 40),
                     prompt_hash=lambda v: _check_hex("prompt_hash", v, 32),
                     fingerprint=lambda v: _check_hex("fingerprint", v, 16),
                     descriptor=_check_object("descriptor"), fingerprint_fields=_check_object("fingerprint_fields"),
                     intact=lambda v: _check_bool("intact", v), running=lambda v: _check_bool("running", v),
                     unsafe=lambda v: _check_bool("unsafe", v), settled=lambda v: _check_bool("settled", v),
                     load_failed=lambda v: _check_bool("load_failed", v),
                     wait_s=lambda v: _check_number("wait_s", v, 0, MAX_TRACE_WAIT_S, zero=True),
                     migration_id=lambda v: _check_hex("migration_id", v, 16),
                     block_size=lambda v: _check_int("block_size", v, 1, 1 << 20),
                     n_digests=lambda v: _check_int("n_digests", v, 0, MAX_IDS_PER_PULL),
                     n_tokens=lambda v: _check_int("n_tokens", v, 0, MAX_IDS_PER_PULL),
                     num_prompt_tokens=lambda v: _check_int("num_prompt_tokens", v, 0, 1 << 40),
                     default_max_tokens=lambda v: _check_int("default_max_tokens", v, 0, 1 << 40),
                     max_tokens_cap=lambda v: _check_int("max_tokens_cap", v, 0, 1 << 40),
                     endpoint_id=lambda v: _check_str("endpoint_id", v, 64),
                     lease_s=lambda v: _check_number("lease_s", v, 0, MAX_HOLD_S),
                     arrival_s=lambda v: _check_number("arrival_s", v, 0, MAX_WALL_CLOCK_S),
                     seen_s=lambda v: _check_number("seen_s", v, 0, MAX_WALL_CLOCK_S),
                     scheduled_s=lambda v: _check_number("scheduled_s", v, 0, MAX_WALL_CLOCK_S))


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name}: expected true or false, got {str(value)[:40]!r}")


@dataclasses.dataclass(frozen=True)
class Message:
    """A control message. Subclasses name their `op` and declare their fields; `parse` checks a
    received header against them (every field present, no other, each in its range)."""

    op: ClassVar[str] = ""

    def header(self) -> Dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["op"] = self.op
        return fields

    @classmethod
    def parse(cls, header: Dict[str, Any]) -> "Message":
        names = {f.name for f in dataclasses.fields(cls)}
        got = set(header) - {"op"}
        if got != names:
            missing, extra = sorted(names - got), sorted(got - names)
            raise ProtocolError(f"{cls.op}: " + "; ".join(
                part for part in (f"missing {', '.join(missing)}" if missing else "",
                                  f"unexpected {', '.join(extra)}" if extra else "") if part))
        for name in names:
            _FIELD_CHECKS[name](header[name])
        return cls(**{name: header[name] for name in names})


@dataclasses.dataclass(frozen=True)
class AuthHello(Message):
    """Client -> server, the first message: the version, who speaks, to whom, and a nonce."""

    op: ClassVar[str] = "auth.hello"
    protocol: int
    client_id: str
    server_id: str
    nonce: str


@dataclasses.dataclass(frozen=True)
class AuthChallenge(Message):
    """Server -> client: the server's nonce and its proof (see auth_proof)."""

    op: ClassVar[str] = "auth.challenge"
    nonce: str
    proof: str


@dataclasses.dataclass(frozen=True)
class AuthProof(Message):
    """Client -> server: the client's proof. The server then answers ok, or closes."""

    op: ClassVar[str] = "auth.proof"
    proof: str


@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """After authentication: the destination's cache and backend, checked by the source,
    which answers with its block count (HelloReply)."""

    op: ClassVar[str] = "hello"
    backend: str
    geometry: Dict[str, Any]
    hostname: str
    pid: int


@dataclasses.dataclass(frozen=True)
class HelloReply(Message):
    op: ClassVar[str] = "hello.reply"
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Ping(Message):
    op: ClassVar[str] = "ping"


@dataclasses.dataclass(frozen=True)
class IpcExport(Message):
    """The source's CUDA IPC handle of its cache (IpcExportReply)."""

    op: ClassVar[str] = "ipc.export"


@dataclasses.dataclass(frozen=True)
class IpcExportReply(Message):
    op: ClassVar[str] = "ipc.export.reply"
    handle: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GlooConnect(Message):
    """The destination's TCPStore listens on its address of this control connection, at
    `store_port`; the source connects there (to the authenticated peer, never to an address a
    message names)."""

    op: ClassVar[str] = "gloo.connect"
    store_port: int
    gen: str
    stripes: int
    chunk_blocks: int
    timeout: float


@dataclasses.dataclass(frozen=True)
class GlooPull(Message):
    """n source ids follow in the payload."""

    op: ClassVar[str] = "gloo.pull"
    n: int
    timeout: float


@dataclasses.dataclass(frozen=True)
class NcclConnect(Message):
    """After its reply the connection carries binary pulls (PULL_REQUEST below)."""

    op: ClassVar[str] = "nccl.connect"
    uids: List[str]
    chunk_blocks: int
    copy_ctas: int
    timeout: float


@dataclasses.dataclass(frozen=True)
class Closing(Message):
    """Server -> client, unsolicited: the source's endpoint is closing (a pull in flight fails
    at once instead of at its deadline)."""

    op: ClassVar[str] = "closing"
    reason: str


# ---- the vLLM connector's lease messages (consumer -> producer's lease server) ------------------
@dataclasses.dataclass(frozen=True)
class LeaseDescribe(Message):
    """The producer's endpoint descriptor and KV layout (LeaseDescribeReply)."""

    op: ClassVar[str] = "lease.describe"


@dataclasses.dataclass(frozen=True)
class LeaseDescribeReply(Message):
    """`sampler`: how the instance draws a seeded request's random numbers (two instances that
    say the same, not empty, continue each other's seeded requests; connector/sampling.py).
    `default_max_tokens`: the output limit its OpenAI server gives a request that sets none (the
    generation config's max_new_tokens); `max_tokens_cap`: the limit it puts on every request
    (--override-generation-config's max_new_tokens, or a --generation-config folder's); 0: none."""

    op: ClassVar[str] = "lease.describe.reply"
    descriptor: Dict[str, Any]
    fingerprint: str
    fingerprint_fields: Dict[str, Any]
    sampler: str
    default_max_tokens: int
    max_tokens_cap: int


@dataclasses.dataclass(frozen=True)
class LeaseAcquire(Message):
    """Takes a live lease for one pull, holding it at least `hold_s` more (LeaseAcquireReply)."""

    op: ClassVar[str] = "lease.acquire"
    lease: str
    hold_s: float


@dataclasses.dataclass(frozen=True)
class LeaseAcquireReply(Message):
    """The lease's n block ids follow in the payload (encode_ids), then n_digests (0 or n)
    digests of those blocks as the producer's worker saw them when it served them."""

    op: ClassVar[str] = "lease.acquire.reply"
    n: int
    num_tokens: int
    prompt_hash: str
    n_digests: int


@dataclasses.dataclass(frozen=True)
class LeaseRelease(Message):
    """Ends a lease: the producer frees its blocks (LeaseReleaseReply)."""

    op: ClassVar[str] = "lease.release"
    lease: str


@dataclasses.dataclass(frozen=True)
class LeaseReleaseReply(Message):
    """`intact`: the lease's blocks were its request's from the acquire to the release (false
    when a running request's blocks were preempted meanwhile: what was pulled is not to be used)."""

    op: ClassVar[str] = "lease.release.reply"
    intact: bool


# ---- live migration (a router -> the source instance's lease server) ------------------------
# A request the router may move carries kv_transfer_params["migration_id"]; these messages name it.
@dataclasses.dataclass(frozen=True)
class MigratePrecopy(Message):
    """A lease on the complete blocks of a running request, made at the engine's next step
    (MigrateLeaseReply): the request keeps running; a release tells whether they stayed its
    blocks. A migration's stages and its last lease are all pre-copies."""

    op: ClassVar[str] = "migrate.precopy"
    migration_id: str


@dataclasses.dataclass(frozen=True)
class MigrateEnd(Message):
    """Ends every lease of a migration and forgets it (idempotent; a plain ok)."""

    op: ClassVar[str] = "migrate.end"
    migration_id: str


@dataclasses.dataclass(frozen=True)
class MigrateTrace(Message):
    """Asked of a destination about a resume: when the request carrying this migration id
    reached it (MigrateTraceReply). With `wait_s` > 0 the answer waits, at most that long, until
    the request's first step is settled; refused when no request here carried it lately (or,
    without waiting, when it is not scheduled yet)."""

    op: ClassVar[str] = "migrate.trace"
    migration_id: str
    wait_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class MigrateTraceReply(Message):
    """Wall-clock times (time.time()) of the request's arrival at vLLM's API server, of the
    scheduler's first look at it and of its first scheduling. `settled`: it is scheduled and, if
    KV was loaded before its first step, the load's result is in, so `load_failed` and `unsafe`
    are final. `load_failed`: that load failed (vLLM recomputes the blocks in place). `unsafe`:
    it failed while the engine had its next step in flight already (asynchronous scheduling):
    that step ran on the bad blocks, so the request's first tokens may be wrong."""

    op: ClassVar[str] = "migrate.trace.reply"
    arrival_s: float
    seen_s: float
    scheduled_s: float
    unsafe: bool
    settled: bool
    load_failed: bool


@dataclasses.dataclass(frozen=True)
class MigrateLeaseReply(Message):
    """A lease on the request's first `num_tokens` tokens: `n` block ids, then `n_tokens`
    token ids (the request's tokens so far: prompt, then output) follow in the payload."""

    op: ClassVar[str] = "migrate.lease.reply"
    lease: str
    n: int
    num_tokens: int
    n_tokens: int
    num_prompt_tokens: int
    block_size: int
    prompt_hash: str
    fingerprint: str
    endpoint_id: str
    backend: str
    lease_s: float


REQUESTS: Dict[str, Type[Message]] = {m.op: m for m in (Hello, Ping, IpcExport, GlooConnect, GlooPull,
                                                           NcclConnect)}
# A lease server's requests: a registry of their own, so that neither server accepts the other's.
LEASE_REQUESTS: Dict[str, Type[Message]] = {m.op: m for m in (LeaseDescribe, LeaseAcquire, LeaseRelease,
                                                                 MigratePrecopy, MigrateEnd, MigrateTrace)}


def parse_request(header: Dict[str, Any], registry: Optional[Dict[str, Type[Message]]] = None) -> Message:
    """The typed request of a header (after authentication) among `registry`'s (default: an
    endpoint's, REQUESTS); ProtocolError otherwise."""
    op = header.get("op")
    cls = (REQUESTS if registry is None else registry).get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown request {str(op)[:40]!r}")
    return cls.parse(header)


def ok_reply(message: Optional[Message] = None) -> Dict[str, Any]:
    header = {"ok": True}
    if message is not None:
        header.update(message.header())
    return header


def error_reply(kind: str, text: str, asynchronous: bool = False) -> Dict[str, Any]:
    """A refusal (or, `asynchronous`, the report of a failure after a request was accepted)."""
    header = {"ok": False, "type": kind[:64], "error": text[:4096]}
    if asynchronous:
        header["async"] = True
    return header


def parse_reply(header: Dict[str, Any], expect: Optional[Type[Message]] = None) -> Optional[Message]:
    """A positive reply's message (or None when `expect` is None); ProtocolError when it is
    malformed. A refusal is left to the caller (header["ok"] is False)."""
    if header.get("ok") is not True:
        raise ProtocolError("not a positive reply")
    if expect is None:
        return None
    fields = {k: v for k, v in header.items() if k != "ok"}
    if fields.get("op") != expect.op:
        raise ProtocolError(f"expected a {expect.op} reply, got {str(fields.get('op'))[:40]!r}")
    return expect.parse(fields)


# ---- authentication -------------------------------------------------------------------------
def auth_proof(secret: bytes, role: str, client_id: str, server_id: str, client_nonce: bytes,
               server_nonce: bytes) -> bytes:
    """HMAC-SHA256 of the exchange, keyed by the shared secret. `role` ("server" or "client")
    makes the two proofs differ, so neither side's proof can be replayed as the other's; both
    nonces make every connection's proofs fresh; both endpoint ids bind them to this pair."""
    transcript = b"\0".join((_TRANSCRIPT, role.encode(), client_id.encode(), server_id.encode(),
                             client_nonce, server_nonce))
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def proofs_match(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


# ---- binary pull frames (the library's pull server, csrc/pull_server.cpp) --------------------
# Request: magic, count, timeout_s, then count int64 ids. Reply: magic, kind, message length, 0,
# then the message.
PULL_REQUEST = struct.Struct("<IId")
PULL_REPLY = struct.Struct("<IIII")
PULL_REQUEST_MAGIC, PULL_REPLY_MAGIC = 0x31505856, 0x31525856
PULL_MAX_IDS = MAX_IDS_PER_PULL
PULL_MAX_CHUNKS = 256  # per request
PULL_ACCEPTED, PULL_REFUSED, PULL_FAILED = 0, 1, 2


def pull_request(ids: List[int], timeout: float) -> bytes:
    return PULL_REQUEST.pack(PULL_REQUEST_MAGIC, len(ids), timeout) + encode_ids(ids)


def pull_reply(kind: int, message: str = "") -> bytes:
    body = message.encode()[:4096]
    return PULL_REPLY.pack(PULL_REPLY_MAGIC, kind, len(body), 0) + body


def parse_pull_reply(head: bytes) -> Tuple[int, int]:
    """(kind, message length) of a reply header; ProtocolError when it is malformed."""
    magic, kind, length, _ = PULL_REPLY.unpack(head)
    if magic != PULL_REPLY_MAGIC or kind not in (PULL_ACCEPTED, PULL_REFUSED, PULL_FAILED) or length > 4096:
        raise ProtocolError("a malformed pull reply")
    return kind, length
