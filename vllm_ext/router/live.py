"""Live migration of a running request between two vLLM instances running VllmExtConnector:
the state machine, above the endpoint (the pulls are the destination's connector's, over
whatever backend the instances use: ipc, nccl or gloo alike).

    PRECOPY   while the source keeps decoding, up to `max_stages` times: take a lease on the
              request's complete blocks (MigratePrecopy) and have the destination load them
              into its prefix cache (a one-token request whose kv_transfer_params name the
              lease); stop when a stage would move at most `last_stage_max_blocks` new blocks.
    SWITCH    one more pre-copy lease, the final one, made at the source's next step while the
              request still decodes (answered once the source's worker serves its blocks, so
              the destination's load does not wait for it); then the router stops relaying the
              source's tokens and closes its stream (the source aborts the request: its blocks
              stay under the lease).
    RESUME    submit prompt + the tokens the client got to the destination with
              kv_transfer_params of the final lease: its prefix cache holds the pre-copied
              blocks, it pulls the rest before its next forward, computes the tokens after the
              lease's last complete block, and streams on. The migration commits at the
              destination's first token.
    END       MigrateEnd on the source (idempotent): every lease of the migration ends.

The client waits only for the resume: the source decodes until the final lease exists. Every
step is keyed by the migration id and safe to repeat. Failure before the switch leaves the
request running on the source (the pre-copy only cost the destination a cache fill): a source
whose lease channel does not answer keeps it, and so does a destination whose pre-copy load
fails. A source that refuses the final lease (the request has no complete block yet, or is
preempted) lets it go all the same, and the destination recomputes it from the tokens the
router holds; a destination that fails to resume hands the request back to the driver, which
resumes it elsewhere (the source first) by recomputing. The driver (the router) owns the HTTP
side: the streams, what the client saw, and the choice of where to go on failure.
"""

import asyncio
import dataclasses
import enum
import logging
import secrets
import time
from typing import Any, Dict, List, Optional, Protocol

from ..lease import messages
from ..lease.channel import ChannelError, ChannelRefused, LeaseClient, MigrationLease
from ..lease.kv_params import RemoteKV, prompt_hash

logger = logging.getLogger(__name__)

MAX_STAGES = 3  # pre-copy stages (Llumnix: 3)
LAST_STAGE_MAX_BLOCKS = 2  # a pre-copy stage that would move at most this many new blocks is the final lease
# Why a migration ends "finished". A request's engine runs ahead of what its client has: vLLM's
# API server and the router relay the tokens behind it (on a busy CPU host for seconds), so a
# move asked while the client still receives tokens may find the request already ended.
ENDED_IN_ENGINE = ("it had ended on the source: its engine generated its last token before the move, and the "
                   "client gets the tokens still on their way (vLLM's API server and the router relay them "
                   "behind the engine)")
ENDED_AT_ROUTER = "it had ended on the source: the router had its last token before the move's switch"


def new_migration_id() -> str:
    return secrets.token_hex(16)


class Outcome(str, enum.Enum):
    MOVED = "moved"  # resumed on the destination with the moved KV
    RECOMPUTED = "recomputed"  # resumed on the destination, which recomputed the KV
    STAYED = "stayed"  # aborted before the stop: the request runs on the source as before
    FINISHED = "finished"  # the request ended on the source before the stop
    FAILED = "failed"  # the destination did not resume it: the driver resumes it elsewhere


@dataclasses.dataclass
class Stage:
    blocks: int  # blocks the lease covered
    new_blocks: int  # beyond the previous stage's
    lease_ms: float  # the source's answer (its next step)
    load_ms: float  # the destination's load


@dataclasses.dataclass
class Record:
    """What one migration did, for the admin API, the logs and the benchmark."""

    migration_id: str
    request_id: str
    source: str
    destination: str
    state: str = "precopy"
    outcome: Optional[Outcome] = None
    reason: str = ""
    stages: List[Stage] = dataclasses.field(default_factory=list)
    final_blocks: int = 0  # blocks of the final lease
    moved_tokens: int = 0  # tokens whose KV the destination got from the final lease
    stop_tokens: int = 0  # tokens (prompt + output the client got) when the source's stream closed
    mode: str = "precopy"  # or "stop_and_copy" (no pre-copy), "recompute" (no KV moved)
    final_lease_ms: Optional[float] = None  # the final lease's wait (while the request still decodes)
    source_quiet_ms: Optional[float] = None  # from the source's last token the client got to the stop
    resume_spans: Optional[Dict[str, float]] = None  # where the resume went (resume_spans())
    stopped_at: float = 0.0  # monotonic: the source's stream closed
    resumed_at: float = 0.0  # monotonic: the destination's first token
    started_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def recomputed_tokens(self) -> int:
        """Of stop_tokens, those the destination computed (after the lease's, or all of them)."""
        return self.stop_tokens - self.moved_tokens

    def as_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["recomputed_tokens"] = self.recomputed_tokens
        out["outcome"] = self.outcome.value if self.outcome else None
        out["stop_to_resume_ms"] = (_ms(self.resumed_at - self.stopped_at)
                                    if self.resumed_at and self.stopped_at else None)
        for key in ("stopped_at", "resumed_at", "started_at"):
            out.pop(key)
        return out


class Driver(Protocol):
    """What the state machine needs from the router (one request)."""

    def finished(self) -> bool:
        """The request ended (its last token was relayed)."""

    async def refuse(self, destination: str) -> Optional[str]:
        """Why the request cannot move to `destination` (None: it can); asked first, and again
        at the switch (before the source stops)."""

    async def load(self, destination: str, token_ids: List[int], params: Dict[str, Any]) -> bool:
        """A pre-copy stage: the destination loads `params`' lease for `token_ids` into its
        prefix cache (a one-token request). True when it answered."""

    async def stop(self) -> bool:
        """Stop relaying the source's tokens and abort the request there (close its stream).
        False when it had ended first."""

    def tokens(self) -> List[int]:
        """Prompt + the output tokens the client got, in order."""

    def last_token_at(self) -> Optional[float]:
        """time.monotonic() when the client got its last token (None: none yet)."""

    async def resume(self, destination: str, params: Optional[Dict[str, Any]]) -> bool:
        """Continue the request on `destination` from tokens(), loading `params`' lease (None:
        recompute); True once its first token arrived."""

    async def resume_trace(self, destination: str) -> Optional[Dict[str, float]]:
        """After a resume: resume_spans() of it (None when the destination cannot say)."""

    def load_failed(self) -> bool:
        """After a resume that loaded a lease: the destination said the load failed and it
        recomputed those blocks in place (False when it cannot say)."""


def lease_params(lease: MigrationLease, lease_host: str, lease_port: int, num_tokens: int,
                 migration_id: Optional[str] = None) -> Dict[str, Any]:
    """kv_transfer_params naming the first `num_tokens` tokens of a source's lease (a consumer
    loads those; it checks their hash against its own prompt). With `migration_id` (a resume)
    its few blocks load before the destination's next forward."""
    num_tokens = min(num_tokens, lease.num_tokens)
    return RemoteKV(lease=lease.lease, block_ids=lease.block_ids[:-(-num_tokens // lease.block_size)],
                    num_tokens=num_tokens, prompt_hash=prompt_hash(lease.token_ids[:num_tokens]),
                    fingerprint=lease.fingerprint, lease_host=lease_host, lease_port=lease_port,
                    endpoint_id=lease.endpoint_id, backend=lease.backend, lease_s=lease.lease_s,
                    sync=migration_id is not None, migration_id=migration_id).to_params()


def resume_spans(sent_s: float, trace: messages.MigrateTraceReply, first_s: float,
                 check_s: Optional[float] = None) -> Dict[str, float]:
    """Where a resume's time went, from the router's wall clock when it sent the request and
    when the first token came, and the destination's trace (the same clock on one host; across
    hosts their offset shifts the first and the last span): to vLLM's API server, from there to
    its scheduler's first look (this waits for the engine's current step), to its first
    scheduling, and from there to the token's arrival (the step that computes it, and the way
    back). `check_s`: how long that token then waited for the trace that vouches for the load
    (a resume that loaded KV; the client gets the token after it)."""
    spans = {"to_api_server_ms": _ms(trace.arrival_s - sent_s), "to_scheduler_ms": _ms(trace.seen_s - trace.arrival_s),
             "to_scheduled_ms": _ms(trace.scheduled_s - trace.seen_s),
             "to_first_token_ms": _ms(first_s - trace.scheduled_s)}
    if check_s is not None:
        spans["load_check_ms"] = _ms(check_s)
    return spans


def agreed_tokens(lease: MigrationLease, tokens: List[int]) -> int:
    """How many of the lease's tokens agree with `tokens` (the router's), from the start."""
    n = min(lease.num_tokens, len(tokens))
    theirs = lease.token_ids
    if n > len(theirs):
        n = len(theirs)
    i = 0
    while i < n and theirs[i] == tokens[i]:
        i += 1
    return i


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


async def _call(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _end(source: LeaseClient, migration_id: str, record: Record) -> None:
    try:
        await _call(source.end, migration_id)
    except ChannelError as e:  # its leases expire by themselves
        logger.warning("migration %s: ending it on %s failed (its leases expire): %s", migration_id[:8],
                       record.source, e)


async def _ends_early(record: Record, source: LeaseClient, outcome: Outcome, reason: str = "") -> Record:
    """A migration that ends before the resume: its outcome (and reason), its end on the source."""
    record.state, record.outcome = "done", outcome
    if reason:
        record.reason = reason
    await _end(source, record.migration_id, record)
    return record


async def migrate(record: Record, source: LeaseClient, driver: Driver, *, max_stages: int = MAX_STAGES,
                  last_stage_max_blocks: int = LAST_STAGE_MAX_BLOCKS,
                  next_migration_id: Optional[str] = None, recompute: bool = False) -> Record:
    """Runs one migration to its end (see the module's docstring); the record says how it went.
    `next_migration_id`: the id the request carries on the destination (it may move again);
    `recompute`: move no KV (the destination recomputes it: the baseline migration is measured
    against)."""
    mid = record.migration_id
    refused = await driver.refuse(record.destination)
    if refused is not None:
        return await _ends_early(record, source, Outcome.STAYED, refused)
    if recompute:
        max_stages, record.mode = 0, "recompute"
    elif max_stages == 0:
        record.mode = "stop_and_copy"
    moved = 0  # blocks the destination's prefix cache got from pre-copies
    final: Optional[MigrationLease] = None
    for _ in range(max_stages):
        if driver.finished():
            break
        started = time.perf_counter()
        try:
            lease = await _call(source.precopy, mid)
        except ChannelError as e:
            if isinstance(e, ChannelRefused) and e.kind == messages.RequestEnded.__name__:
                return await _ends_early(record, source, Outcome.FINISHED, ENDED_IN_ENGINE)
            logger.info("migration %s: no pre-copy (%s)", mid[:8], e)
            break
        leased = time.perf_counter()
        new = lease.n - moved
        if new <= last_stage_max_blocks and record.stages:
            final = lease  # few enough to move at the switch: the final lease
            record.final_lease_ms = _ms(leased - started)
            break
        # the next token too, so that a destination loading whole blocks before the last token
        # still loads every block of the lease
        prompt = lease.token_ids[:lease.num_tokens + 1]
        ok = await driver.load(record.destination, prompt, lease_params(lease, source.host, source.port,
                                                                        lease.num_tokens))
        record.stages.append(Stage(lease.n, new, _ms(leased - started), _ms(time.perf_counter() - leased)))
        if not ok:  # the destination is in trouble: the request stays (its pre-copied blocks, salted, go unread)
            return await _ends_early(record, source, Outcome.STAYED, "a pre-copy to the destination failed")
        moved = lease.n
    if driver.finished():
        return await _ends_early(record, source, Outcome.FINISHED, ENDED_AT_ROUTER)

    record.state = "switch"
    refused = await driver.refuse(record.destination)  # again: what the request showed meanwhile
    if refused is not None:
        return await _ends_early(record, source, Outcome.STAYED, refused)
    params = None
    if final is None and not recompute:
        started = time.perf_counter()
        try:
            final = await _call(source.precopy, mid)
            record.final_lease_ms = _ms(time.perf_counter() - started)
        except ChannelRefused as e:
            if e.kind == messages.RequestEnded.__name__:  # its last tokens are on their way: let them come
                return await _ends_early(record, source, Outcome.FINISHED, ENDED_IN_ENGINE)
            # the request has no complete block yet, or is preempted: recompute it
            record.reason = f"no final lease ({e}): recomputed"
        except ChannelError as e:
            return await _ends_early(record, source, Outcome.STAYED, f"no final lease: {e}")
    if not await driver.stop():
        return await _ends_early(record, source, Outcome.FINISHED, ENDED_AT_ROUTER)
    record.stopped_at = time.monotonic()
    last = driver.last_token_at()
    record.source_quiet_ms = _ms(record.stopped_at - last) if last is not None else None
    tokens = driver.tokens()
    record.stop_tokens = len(tokens)
    if final is not None:
        n = min(agreed_tokens(final, tokens), len(tokens) - 1)  # the destination computes one at least
        if n > 0:
            record.final_blocks = -(-n // final.block_size)
            record.moved_tokens = n
            params = lease_params(final, source.host, source.port, n, next_migration_id)
        else:
            record.reason = "the source's tokens differ from the router's: recomputed"
    if params is None and next_migration_id is not None:
        params = {"migration_id": next_migration_id}

    record.state = "resume"
    ok = await driver.resume(record.destination, params)
    record.resumed_at = time.monotonic() if ok else 0.0
    record.state = "done"
    if ok:
        record.outcome = Outcome.MOVED if params and "remote_lease" in params else Outcome.RECOMPUTED
        if record.outcome is Outcome.MOVED and driver.load_failed():
            record.outcome, record.moved_tokens = Outcome.RECOMPUTED, 0
            record.reason = "the destination's load of the final lease failed: it recomputed the KV in place"
    else:
        record.outcome, record.reason = Outcome.FAILED, record.reason or "the destination did not resume it"
    await _end(source, mid, record)
    if ok:
        record.resume_spans = await driver.resume_trace(record.destination)
    return record
