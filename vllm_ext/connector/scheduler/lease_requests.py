"""The lease channel's requests to a producer's scheduler half (served on the channel's threads,
one per connection): lease.describe, lease.acquire (waiting for the worker to serve the lease's
blocks), lease.release, and a migration's migrate.precopy, migrate.end and migrate.trace.

LeaseRequests is a part of SchedulerHalf (scheduler/__init__.py), kept apart for its size: it
works on the half's state under the half's lock (`_lock`, `_granted`, `_leases`, `_source`,
`_traces`, `_handshake`, the engine's progress) and ends leases through its `_end_lease`.
"""

import time

from ...lease import messages
from ...lease.kv_params import prompt_hash, source_ranks
from ...migration import protocol
from ..metadata import VllmExtHandshake
from .leases import Lease

# A consumer's acquire may extend a lease by at most this much beyond its remaining time (the
# pull's deadline): a lease is never freed under a pull in progress, nor held forever.
MAX_HOLD_S = messages.MAX_HOLD_S  # a pull's deadline (pull_timeout_s, at most 600 s) times gloo's patience
# An acquire waits for the producer's worker to serve the lease's blocks (it grants them in the
# engine step after the lease is made, and says so in that step's output: milliseconds when idle,
# a forward's time on a busy host) for as long as the engine makes progress, at most the hold
# the acquire asks for (the consumer's deadline); it is refused once the engine has been between
# steps, none in flight, for this long (a stuck engine).
GRANT_STALL_S = 3.0
# A pre-copy asked on the lease channel waits at most this long for the engine's next step.
PRECOPY_WAIT_S = 2.0
# Then its reply waits at most this long for the worker to serve the lease's blocks (the step's
# output: one or two steps), so that the destination's acquire finds them served and its load,
# under the resume's first step, does not wait for the source's engine (after this, it does).
PRECOPY_GRANT_WAIT_S = 1.0


def holds_tokens(lease: Lease, num_tokens: int, hash_: str) -> bool:
    """The lease holds the KV of these tokens: all of a P/D lease's, or a prefix of a migration
    lease's (a resume loads the tokens the client got, which may end before the lease's)."""
    if lease.token_ids and num_tokens < lease.num_tokens:
        return prompt_hash(lease.token_ids[:num_tokens]) == hash_
    return (num_tokens, hash_) == (lease.num_tokens, lease.prompt_hash)


class LeaseRequests:
    """SchedulerHalf's answers on the lease channel; `_serve` is the LeaseServer's handler."""

    def _serve(self, request):
        """A consumer's or a router's request on the lease channel (authenticated, its fields
        checked by protocol.py): (reply message or None, payload). ValueError refuses."""
        if isinstance(request, messages.LeaseDescribe):
            instance = self._registered()
            handshake = self._handshakes.get(request.rank)
            if handshake is None:
                raise ValueError(f"rank: this instance runs {len(self._handshakes)} tensor-parallel rank(s), "
                                 f"got {request.rank}")
            return messages.LeaseDescribeReply(handshake.descriptor, handshake.fingerprint,
                                               handshake.fingerprint_fields, handshake.sampler,
                                               *self.max_tokens_limits,
                                               endpoint_id=instance.descriptor["endpoint_id"]), b""
        if isinstance(request, messages.MigrateTrace):
            return self._trace(request.migration_id, request.wait_s), b""
        if isinstance(request, messages.MigratePrecopy):
            self._registered()
            return self._serve_precopy(request.migration_id)
        if isinstance(request, messages.MigrateEnd):
            self._registered()
            return self._serve_end(request.migration_id)
        if isinstance(request, messages.LeaseAcquire):
            return self._serve_acquire(request.lease, request.hold_s, request.num_tokens, request.prompt_hash,
                                       request.rank, request.ranks)
        return self._serve_release(request.lease, request.rank, request.ranks)

    def _registered(self) -> VllmExtHandshake:
        if self._handshake is None:
            raise ValueError("this instance's worker has not registered its KV cache yet")
        return self._handshake

    def _live_lease(self, lease_id: str) -> Lease:
        """With the lock held."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise ValueError(f"lease {lease_id[:8]}: unknown, released or expired")
        return lease

    def _serve_acquire(self, lease_id: str, hold_s: float, num_tokens: int, hash_: str, rank: int = 0,
                       ranks: int = 1):
        """For the consumer's TP rank `rank` of `ranks`: the reply carries the digests of each of
        this instance's ranks that hold heads of that rank (kv_params.source_ranks), in order."""
        with self._lock:
            self._reap_expired()
            lease = self._live_lease(lease_id)
            if rank >= ranks:
                raise ValueError(f"rank: expected a tensor-parallel rank below ranks {ranks}, got {rank}")
            if hold_s > MAX_HOLD_S:
                raise ValueError(f"hold_s: expected at most {MAX_HOLD_S:g} seconds, got {hold_s!r}")
            if not holds_tokens(lease, num_tokens, hash_):  # the lease stays its own consumer's
                raise messages.NotThisPrompt(f"lease {lease_id[:8]}: it holds {lease.num_tokens} tokens of another "
                                             f"prompt, not the {num_tokens} (hash {hash_[:8]}) of the request that "
                                             "asks; refused before any pull")
            if rank in lease.taken_ranks or rank in lease.released_ranks:
                raise ValueError(f"lease {lease_id[:8]}: already taken by another pull"
                                 + (f" (rank {rank})" if ranks > 1 else ""))
            lease.taken_ranks.add(rank)  # before waiting: a second acquire is refused meanwhile
            why = self._wait_for_grant(lease, hold_s)
            if not self._leases.is_live(lease):
                raise ValueError(f"lease {lease_id[:8]}: released or expired")
            if why:
                lease.taken_ranks.discard(rank)
                raise ValueError(f"lease {lease_id[:8]}: its blocks are not served yet ({why})")
            self._leases.take(lease, hold_s)
            digests = []
            if len(lease.digests) == self._leases.ranks:  # every rank's, or none
                for q in source_ranks(rank, ranks, self._leases.ranks):
                    digests += lease.digests[q]
            return (messages.LeaseAcquireReply(len(lease.block_ids), lease.num_tokens, lease.prompt_hash,
                                               len(digests)),
                    protocol.encode_ids(lease.block_ids + digests))

    def _wait_for_grant(self, lease: Lease, hold_s: float) -> str:
        """With the lock held: waits until the worker serves the lease's blocks or the lease
        ended; "" then, else why it gave up. It waits while the engine makes progress (a step in
        flight, or one scheduled or ended in the last GRANT_STALL_S: on a busy host one step may
        take seconds), at most `hold_s` (the consumer's deadline)."""
        give_up = time.monotonic() + hold_s
        while not lease.granted and self._leases.is_live(lease):
            now = time.monotonic()
            if now >= give_up:
                return f"the producer's engine did not serve them within the acquire's {hold_s:g} s"
            until = give_up
            if self._steps_in_flight == 0:
                if now - self._last_step_at >= GRANT_STALL_S:
                    return f"the producer's engine took no step for {GRANT_STALL_S:g} s"
                until = min(until, self._last_step_at + GRANT_STALL_S)
            self._granted.wait(until - now)
        return ""

    def _serve_release(self, lease_id: str, rank: int = 0, ranks: int = 1):
        """A pre-copy lease's blocks were its request's throughout unless it was preempted
        meanwhile (its blocks then went back to vLLM, and may hold others' KV). The lease ends
        once `ranks` consumer ranks released it (1: at once)."""
        with self._lock:
            self._reap_expired()
            lease = self._live_lease(lease_id)
            if rank >= ranks:
                raise ValueError(f"rank: expected a tensor-parallel rank below ranks {ranks}, got {rank}")
            intact = lease.preemptions is None or self._source.preemptions(lease.migration_id) == lease.preemptions
            lease.released_ranks.add(rank if ranks > 1 else 0)
            if len(lease.released_ranks) >= ranks:
                self._end_lease(lease, "released")
            return messages.LeaseReleaseReply(intact), b""

    def _serve_precopy(self, mid: str):
        with self._lock:
            self._reap_expired()
            ask = self._source.ask(mid)
        if not ask.event.wait(PRECOPY_WAIT_S):
            with self._lock:
                self._source.forget_ask(mid)
            raise ValueError(f"migration {mid[:8]}: the engine took no step in {PRECOPY_WAIT_S:g} s")
        if ask.error is not None:  # the refusal, of its kind (RequestEnded: the router lets it finish)
            raise type(ask.error)(f"migration {mid[:8]}: {ask.error}")
        lease = ask.lease
        with self._lock:  # ended meanwhile: the consumer's acquire is refused as for any ended lease
            self._granted.wait_for(lambda: lease.granted or not self._leases.is_live(lease),
                                   timeout=PRECOPY_GRANT_WAIT_S)
            return self._lease_reply(lease)

    def _lease_reply(self, lease: Lease):
        desc = self._handshake.descriptor
        reply = messages.MigrateLeaseReply(
            lease=lease.lease_id, n=len(lease.block_ids), num_tokens=lease.num_tokens, n_tokens=len(lease.token_ids),
            num_prompt_tokens=lease.num_prompt_tokens, block_size=self.block_size, prompt_hash=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, endpoint_id=desc["endpoint_id"], backend=desc["backend"],
            lease_s=float(self.lease_s))
        return reply, protocol.encode_ids(lease.block_ids + lease.token_ids)

    def _serve_end(self, mid: str):
        """Leases not taken end now; a taken one ends at its consumer's release (or at the end of
        the hold its acquire asked for): never under a pull."""
        with self._lock:
            self._reap_expired()
            for lease_id in self._source.leases_of(mid):
                lease = self._leases.get(lease_id)
                if lease is not None and not lease.taken:
                    self._end_lease(lease, "released")
            return None, b""

    def _trace(self, mid: str, wait_s: float) -> messages.MigrateTraceReply:
        """The trace of the request carrying `mid`, once settled or after `wait_s` (without
        worker metadata no load reports, so a load never settles: answered once scheduled)."""
        trace, settled = self._traces.wait(mid, wait_s, loads_report=self.wait_for_grant)
        return messages.MigrateTraceReply(trace.arrival_s, trace.seen_s, trace.scheduled_s,
                                          unsafe=trace.load_failed and self.failed_load_is_unsafe(),
                                          settled=settled, load_failed=trace.load_failed)
