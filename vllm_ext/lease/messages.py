"""The contract between serving instances and the fronts before them, on the wire: the lease
channel's messages, their version and its history. A consumer's worker asks a producer for a
lease's blocks (lease.*); a router asks a migration's source for leases on a running request
and a destination how its resume went (migrate.*). They travel in the transport's frames, after
its authentication (vllm_ext/migration/protocol.py: Message, the checks, the transcript), to a
lease server of their own: an endpoint's server accepts none of these, a lease server none of
an endpoint's. Imports nothing but that module, so a front can use it without torch or vLLM.
"""

import dataclasses
import json
from typing import Any, Callable, ClassVar, Dict, Mapping, Type

from ..migration.protocol import (
    FIELD_CHECKS,
    MAX_IDS_PER_PULL,
    Message,
    ProtocolError,
    check_bool,
    check_hex,
    check_int,
    check_number,
    check_str,
)

# The version a lease server and its clients must speak; a mismatch is refused at the first
# message. Until 13 it was the endpoint's number too (migration/protocol.py): the history starts
# where the lease messages came in.
# 6: the vLLM connector's lease messages (lease.*), served by a lease server of their own
#    (LEASE_REQUESTS): an endpoint's server accepts none of them, a lease server none of an
#    endpoint's.
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
# 14: lease.acquire names the tokens the consumer will load (its own request's first
#     `num_tokens`, their `prompt_hash`); the producer refuses a lease on other tokens (a
#     migration lease: a prefix of them may be loaded) before it hands out a block.
# 15: tensor parallelism: lease.describe names the producer's TP rank whose endpoint it wants
#     (its reply gives that rank's descriptor and the instance's `endpoint_id`, rank 0's);
#     lease.acquire and lease.release name the consumer's rank and its TP size (`rank`,
#     `ranks`): a lease is taken once per rank, its reply carries the digests of the producer
#     ranks holding that rank's heads (any TP sizes), and it ends once every rank released it
#     (a release with `ranks` 1, a router's, ends it at once).
LEASE_PROTOCOL = 15

# The server id a lease server authenticates as (it serves no endpoint of its own).
LEASE_SERVER_ID = "vllm-ext-lease"
MAX_HOLD_S = 3600.0  # how long an acquire may hold a lease
MAX_DESCRIBE_BYTES = 16 << 10  # the JSON objects a describe reply carries
MAX_WALL_CLOCK_S = 1e11  # a time.time() in a message (migrate.trace.reply)
MAX_TRACE_WAIT_S = 60.0  # how long a migrate.trace may wait for the resume's first step
MAX_TP_RANKS = 1024  # the tensor-parallel size a lease message may name


class NotThisPrompt(ValueError):
    """A producer's refusal of an acquire whose request is not the one the lease holds the
    tokens of (its reply's `type` names this class)."""


class RequestEnded(ValueError):
    """A source's refusal of a migration's lease: the request ended there (or was never there).
    Its reply's `type` names this class; the router then lets the source's stream finish."""


def _check_object(name: str) -> Callable[[Any], None]:
    def check(value) -> None:
        if not isinstance(value, dict) or len(json.dumps(value)) > MAX_DESCRIBE_BYTES:
            raise ProtocolError(f"{name}: expected a JSON object of at most {MAX_DESCRIBE_BYTES} bytes")
    return check


def _flag(name: str) -> Callable[[Any], None]:
    return lambda v: check_bool(name, v)


def _wall_clock(name: str) -> Callable[[Any], None]:
    return lambda v: check_number(name, v, 0, MAX_WALL_CLOCK_S)


def _count(name: str, hi: int) -> Callable[[Any], None]:
    return lambda v: check_int(name, v, 0, hi)


_LEASE_FIELD_CHECKS: Dict[str, Callable[[Any], None]] = dict(
    FIELD_CHECKS,
    lease=lambda v: check_hex("lease", v, 16),
    hold_s=lambda v: check_number("hold_s", v, 0, MAX_HOLD_S),
    num_tokens=lambda v: check_int("num_tokens", v, 1, 1 << 40),
    prompt_hash=lambda v: check_hex("prompt_hash", v, 32),
    fingerprint=lambda v: check_hex("fingerprint", v, 16),
    descriptor=_check_object("descriptor"), fingerprint_fields=_check_object("fingerprint_fields"),
    sampler=lambda v: check_str("sampler", v, 128),
    intact=_flag("intact"), unsafe=_flag("unsafe"), settled=_flag("settled"), load_failed=_flag("load_failed"),
    wait_s=lambda v: check_number("wait_s", v, 0, MAX_TRACE_WAIT_S, zero=True),
    migration_id=lambda v: check_hex("migration_id", v, 16),
    block_size=lambda v: check_int("block_size", v, 1, 1 << 20),
    n_digests=_count("n_digests", MAX_IDS_PER_PULL), n_tokens=_count("n_tokens", MAX_IDS_PER_PULL),
    num_prompt_tokens=_count("num_prompt_tokens", 1 << 40),
    default_max_tokens=_count("default_max_tokens", 1 << 40), max_tokens_cap=_count("max_tokens_cap", 1 << 40),
    endpoint_id=lambda v: check_str("endpoint_id", v, 64),
    rank=lambda v: check_int("rank", v, 0, MAX_TP_RANKS - 1), ranks=lambda v: check_int("ranks", v, 1, MAX_TP_RANKS),
    lease_s=lambda v: check_number("lease_s", v, 0, MAX_HOLD_S),
    arrival_s=_wall_clock("arrival_s"), seen_s=_wall_clock("seen_s"), scheduled_s=_wall_clock("scheduled_s"))


@dataclasses.dataclass(frozen=True)
class LeaseMessage(Message):
    """A message of the lease channel (its fields are checked by the lease contract's table)."""

    field_checks: ClassVar[Mapping[str, Callable[[Any], None]]] = _LEASE_FIELD_CHECKS


# ---- P/D: a consumer's worker -> the producer's lease server ------------------------------------
@dataclasses.dataclass(frozen=True)
class LeaseDescribe(LeaseMessage):
    """The endpoint descriptor and KV layout of the producer's TP rank `rank`
    (LeaseDescribeReply)."""

    op: ClassVar[str] = "lease.describe"
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class LeaseDescribeReply(LeaseMessage):
    """`sampler`: how the instance draws a seeded request's random numbers (two instances that
    say the same, not empty, continue each other's seeded requests; connector/sampling.py).
    `default_max_tokens`: the output limit its OpenAI server gives a request that sets none (the
    generation config's max_new_tokens); `max_tokens_cap`: the limit it puts on every request
    (--override-generation-config's max_new_tokens, or a --generation-config folder's); 0: none.
    `descriptor` and `fingerprint_fields` are the asked rank's; `endpoint_id` is the instance's
    (its rank 0 endpoint's: the one kv_transfer_params and migration leases name)."""

    op: ClassVar[str] = "lease.describe.reply"
    descriptor: Dict[str, Any]
    fingerprint: str
    fingerprint_fields: Dict[str, Any]
    sampler: str
    default_max_tokens: int
    max_tokens_cap: int
    endpoint_id: str = ""


@dataclasses.dataclass(frozen=True)
class LeaseAcquire(LeaseMessage):
    """Takes a live lease for one pull, holding it at least `hold_s` more (LeaseAcquireReply),
    for a consumer whose request's first `num_tokens` tokens hash to `prompt_hash`: refused
    unless the lease holds those tokens (all of a P/D lease's; a prefix of a migration lease's).
    `rank` of `ranks`: the consumer's TP rank and size (each rank takes the lease once)."""

    op: ClassVar[str] = "lease.acquire"
    lease: str
    hold_s: float
    num_tokens: int
    prompt_hash: str
    rank: int = 0
    ranks: int = 1


@dataclasses.dataclass(frozen=True)
class LeaseAcquireReply(LeaseMessage):
    """The lease's n block ids follow in the payload (encode_ids), then n_digests (0, or n per
    producer rank holding heads of the acquire's rank: kv_params.source_ranks) digests of those
    blocks as each such rank's worker saw them when it served them."""

    op: ClassVar[str] = "lease.acquire.reply"
    n: int
    num_tokens: int
    prompt_hash: str
    n_digests: int


@dataclasses.dataclass(frozen=True)
class LeaseRelease(LeaseMessage):
    """Ends a lease for the consumer's TP rank `rank` of `ranks`: the producer frees its blocks
    once every rank released it (LeaseReleaseReply); `ranks` 1 (a router's) ends it at once."""

    op: ClassVar[str] = "lease.release"
    lease: str
    rank: int = 0
    ranks: int = 1


@dataclasses.dataclass(frozen=True)
class LeaseReleaseReply(LeaseMessage):
    """`intact`: the lease's blocks were its request's from the acquire to the release (false
    when a running request's blocks were preempted meanwhile: what was pulled is not to be used)."""

    op: ClassVar[str] = "lease.release.reply"
    intact: bool


# ---- live migration (a router -> the source instance's lease server) ------------------------
# A request the router may move carries kv_transfer_params["migration_id"]; these messages name it.
@dataclasses.dataclass(frozen=True)
class MigratePrecopy(LeaseMessage):
    """A lease on the complete blocks of a running request, made at the engine's next step
    (MigrateLeaseReply): the request keeps running; a release tells whether they stayed its
    blocks. A migration's stages and its last lease are all pre-copies."""

    op: ClassVar[str] = "migrate.precopy"
    migration_id: str


@dataclasses.dataclass(frozen=True)
class MigrateEnd(LeaseMessage):
    """Ends every lease of a migration and forgets it (idempotent; a plain ok)."""

    op: ClassVar[str] = "migrate.end"
    migration_id: str


@dataclasses.dataclass(frozen=True)
class MigrateTrace(LeaseMessage):
    """Asked of a destination about a resume: when the request carrying this migration id
    reached it (MigrateTraceReply). With `wait_s` > 0 the answer waits, at most that long, until
    the request's first step is settled; refused when no request here carried it lately (or,
    without waiting, when it is not scheduled yet)."""

    op: ClassVar[str] = "migrate.trace"
    migration_id: str
    wait_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class MigrateTraceReply(LeaseMessage):
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
class MigrateLeaseReply(LeaseMessage):
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


# A lease server's requests: a registry of their own, so that neither server accepts the other's.
LEASE_REQUESTS: Dict[str, Type[Message]] = {m.op: m for m in (LeaseDescribe, LeaseAcquire, LeaseRelease,
                                                                 MigratePrecopy, MigrateEnd, MigrateTrace)}
