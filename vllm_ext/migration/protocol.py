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
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple, Type

# The version both sides of a pair must speak; a mismatch is refused at the first message.
# 2: nccl chunks ramp 1, 2, 4, ... blocks; the nccl connect carries copy_ctas.
# 3: after nccl.connect, the connection carries binary pulls to the library's pull server.
# 4: an nccl pair has lanes, one communicator each (connect carries their uids).
# 5: mutual HMAC authentication before any other message; typed messages; gloo's rendezvous
#    address is the control connection's (no address travels in a message); "closing".
# 6-13: no change to the endpoint's messages: the number then also versioned the lease channel's
#    (vllm_ext/lease/messages.py has its own version and history since).
# 14: a gloo source sends gloo.progress while it serves a pull (the destination's wait follows it).
# 15: gloo.pull and the nccl pull request ("VXP2": first_head, num_heads) name a KV head range;
#     caches of other head counts pair for such pulls.
PROTOCOL = 15

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

class ProtocolError(ValueError):
    """A message that breaks the protocol: malformed, of the wrong version, or out of bounds."""


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
def check_int(name: str, value, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"{name}: expected an integer in [{lo}, {hi}], got {value!r}")


def check_number(name: str, value, lo: float, hi: float, zero: bool = False) -> None:
    """A number in (lo, hi] (`zero`: or exactly 0)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or not (lo < value <= hi or (zero and value == 0))):
        raise ProtocolError(f"{name}: expected {'0 or ' if zero else ''}a number in ({lo:g}, {hi:g}], got {value!r}")


def check_hex(name: str, value, nbytes: int) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        raise ProtocolError(f"{name}: expected {nbytes} bytes as hex, got {str(value)[:80]!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{name}: not hex: {value[:80]!r}") from None


def check_str(name: str, value, max_len: int = 256) -> None:
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{name}: expected a string of at most {max_len} characters, got "
                            f"{str(value)[:80]!r}")


FIELD_CHECKS = {
    "protocol": lambda v: check_int("protocol", v, 0, 1 << 31),
    "timeout": lambda v: check_number("timeout", v, 0, MAX_TIMEOUT_S),
    "n": lambda v: check_int("n", v, 1, MAX_IDS_PER_PULL),
    "stripes": lambda v: check_int("stripes", v, 1, MAX_STRIPES),
    "chunk_blocks": lambda v: check_int("chunk_blocks", v, 1, 1 << 31),
    "copy_ctas": lambda v: check_int("copy_ctas", v, 0, MAX_COPY_CTAS),
    "store_port": lambda v: check_int("store_port", v, 1, 65535),
    "num_blocks": lambda v: check_int("num_blocks", v, 0, 1 << 62),
    "pid": lambda v: check_int("pid", v, 0, 1 << 31),
    "nonce": lambda v: check_hex("nonce", v, NONCE_BYTES),
    "proof": lambda v: check_hex("proof", v, PROOF_BYTES),
    "client_id": lambda v: check_str("client_id", v, 64),
    "server_id": lambda v: check_str("server_id", v, 64),
    "backend": lambda v: check_str("backend", v, 32),
    "hostname": lambda v: check_str("hostname", v, 255),
    "gen": lambda v: check_str("gen", v, 64),
    "reason": lambda v: check_str("reason", v, 1024),
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
        check_hex("uids", uid, 128)


def _check_handle(value) -> None:
    if not isinstance(value, dict) or len(json.dumps(value)) > MAX_HEADER_BYTES // 2:
        raise ProtocolError("handle: expected an IPC handle object")


def _check_heads(value) -> None:
    """[] (whole blocks) or [first, count]: the source checks them against its own heads."""
    if (not isinstance(value, list) or len(value) not in (0, 2)
            or not all(type(v) is int and 0 <= v < 1 << 31 for v in value) or (value and value[1] < 1)):
        raise ProtocolError(f"heads: expected [] or [first, count] (count >= 1), got {str(value)[:80]}")


FIELD_CHECKS.update(geometry=_check_geometry, uids=_check_uids, handle=_check_handle, heads=_check_heads)


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name}: expected true or false, got {str(value)[:40]!r}")


@dataclasses.dataclass(frozen=True)
class Message:
    """A control message. Subclasses name their `op` and declare their fields; `parse` checks a
    received header against them (every field present, no other, each in its range)."""

    op: ClassVar[str] = ""
    # field name -> its check (a ProtocolError naming the field); another contract's messages
    # (vllm_ext/lease/messages.py) extend it with their own fields
    field_checks: ClassVar[Mapping[str, Callable[[Any], None]]] = FIELD_CHECKS

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
            cls.field_checks[name](header[name])
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
    """n source ids follow in the payload; `heads` [first, count] sends only those KV heads of
    each block (rows of the head range, ops.gather_blocks(heads=...)); [] whole blocks."""

    op: ClassVar[str] = "gloo.pull"
    n: int
    timeout: float
    heads: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class GlooProgress(Message):
    """Source -> destination, at least every second while it serves a gloo.pull: alive and
    serving (the destination's wait follows it)."""

    op: ClassVar[str] = "gloo.progress"


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


REQUESTS: Dict[str, Type[Message]] = {m.op: m for m in (Hello, Ping, IpcExport, GlooConnect, GlooPull,
                                                           NcclConnect)}


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


def geometry_mismatch(mine: Dict[str, Any], theirs: Dict[str, Any], where: str = "at the peer") -> Optional[str]:
    """None when two caches can exchange blocks, else a description of the difference: each
    field that differs, with its value here and `where` (the other side)."""
    if mine == theirs:
        return None
    keys = sorted(set(mine) | set(theirs))
    return ", ".join(f"{k} {mine.get(k)!r} here vs {theirs.get(k)!r} {where}"
                     for k in keys if mine.get(k) != theirs.get(k))


def heads_differ_only(mine: Dict[str, Any], theirs: Dict[str, Any]) -> bool:
    """Two cache geometries that differ in their KV head count alone (and so in the slice's
    bytes): caches of unequal tensor parallelism, which exchange head ranges."""
    skip = ("num_kv_heads", "slice_nbytes")
    return ("num_kv_heads" in mine and "num_kv_heads" in theirs
            and {k: v for k, v in mine.items() if k not in skip} == {k: v for k, v in theirs.items() if k not in skip})


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
# Request: magic, count, timeout_s, first_head, num_heads (0: whole blocks), then count int64
# ids. Reply: magic, kind, message length, 0, then the message.
PULL_REQUEST = struct.Struct("<IIdii")
PULL_REPLY = struct.Struct("<IIII")
PULL_REQUEST_MAGIC, PULL_REPLY_MAGIC = 0x32505856, 0x31525856
PULL_MAX_IDS = MAX_IDS_PER_PULL
PULL_MAX_CHUNKS = 256  # per request
PULL_ACCEPTED, PULL_REFUSED, PULL_FAILED = 0, 1, 2


def pull_request(ids: List[int], timeout: float, heads: Optional[Tuple[int, int]] = None) -> bytes:
    """`heads`: (first, count) of the source's KV heads to send; None: whole blocks."""
    first, count = heads or (0, 0)
    return PULL_REQUEST.pack(PULL_REQUEST_MAGIC, len(ids), timeout, first, count) + encode_ids(ids)


def pull_reply(kind: int, message: str = "") -> bytes:
    body = message.encode()[:4096]
    return PULL_REPLY.pack(PULL_REPLY_MAGIC, kind, len(body), 0) + body


def parse_pull_reply(head: bytes) -> Tuple[int, int]:
    """(kind, message length) of a reply header; ProtocolError when it is malformed."""
    magic, kind, length, _ = PULL_REPLY.unpack(head)
    if magic != PULL_REPLY_MAGIC or kind not in (PULL_ACCEPTED, PULL_REFUSED, PULL_FAILED) or length > 4096:
        raise ProtocolError("a malformed pull reply")
    return kind, length
