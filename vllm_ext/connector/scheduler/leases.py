"""The producer's leases: a request's blocks held for consumers, until released or expired.

A lease is made on the engine thread (a finished `do_remote_decode` request's, or a running
request's complete blocks for a migration's pre-copy), granted by the worker in the next step
(its endpoint then serves the blocks; the step's output says so, with the blocks' digests),
taken by one consumer's acquire and ended by its release or at expiry.

Under tensor parallelism every TP rank's worker serves its own shard of each block: a lease is
granted once every rank granted it, carries each rank's digests, is taken once by each of the
consumer's ranks and ends once every consumer rank released it (or at expiry). What the table learns in
between goes to the worker with the next step's metadata: leases made (to grant), leases ended
(to revoke), requests whose blocks go back to vLLM (finished_sending).

What P/D leases hold is bounded (`max_blocks`, the producer's `max_leased_fraction` of its
cache): the blocks of finished prompts that nobody pulls would otherwise pin the cache for
`lease_s` (a client that asks for prefills and never decodes them starves everyone else).
`make_room` says which of the oldest untaken leases to end so that a new one fits; a migration's
leases (a running request's own blocks, asked by the router) are not counted.

Not thread-safe: SchedulerHalf calls it under its lock (engine thread and lease channel threads).
"""

import collections
import dataclasses
import secrets
from typing import Callable, Dict, List, Optional, Set


@dataclasses.dataclass(eq=False)
class Lease:
    """A request's blocks held for consumers (producer side): a finished request's (P/D), or a
    running request's complete blocks (a migration's pre-copy: `migration_id` set)."""

    lease_id: str
    req_id: str
    block_ids: List[int]
    num_tokens: int
    prompt_hash: str  # of the request's first num_tokens token ids
    expires_at: float
    granted: bool  # every TP rank's worker's endpoint serves block_ids
    granted_ranks: Set[int] = dataclasses.field(default_factory=set)
    taken_ranks: Set[int] = dataclasses.field(default_factory=set)  # the consumer ranks whose acquire holds it
    released_ranks: Set[int] = dataclasses.field(default_factory=set)  # the consumer ranks that released it
    # migration leases: the request's migration id, its tokens so far, its prompt's length, and
    # its preemption count when the lease was made (a preemption gives its blocks back to vLLM)
    migration_id: Optional[str] = None
    token_ids: List[int] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    preemptions: Optional[int] = None
    # TP rank -> the blocks' digests, from that rank's worker when it served them (complete:
    # one per block, for every rank)
    digests: Dict[int, List[int]] = dataclasses.field(default_factory=dict)
    known_digests: Dict[int, List[int]] = dataclasses.field(default_factory=dict)  # of its first blocks, when made

    @property
    def taken(self) -> bool:
        """A consumer's acquire holds it (one of its ranks, at least)."""
        return bool(self.taken_ranks)


@dataclasses.dataclass(frozen=True)
class Digested:
    """A running request's last granted lease: its preemption count then, its blocks and their
    digests. A complete block's bytes do not change while the request holds it, so a later lease
    of the same request digests only the blocks after these."""

    preemptions: Optional[int]
    block_ids: List[int]
    digests: Dict[int, List[int]]  # TP rank -> one per block


@dataclasses.dataclass
class LeaseChanges:
    """What the worker learns at the next step (VllmExtMetadata's producer fields)."""

    new_leases: Dict[str, List[int]] = dataclasses.field(default_factory=dict)  # lease id -> blocks to grant
    digest_from: Dict[str, int] = dataclasses.field(default_factory=dict)  # lease id -> first blocks known
    ended_leases: List[str] = dataclasses.field(default_factory=list)  # grants to revoke
    finished_sending: List[str] = dataclasses.field(default_factory=list)  # requests whose blocks go back


class LeaseTable:
    """Args are values: how long an untaken lease lives, the clock it is counted on, whether a
    lease waits for the worker's grant (False: releases without worker metadata, served at once),
    and the most blocks P/D leases may hold together (None: no bound). `ranks`: the instance's TP
    ranks (set once its workers registered)."""

    def __init__(self, *, lease_s: float, clock: Callable[[], float], wait_for_grant: bool,
                 max_blocks: Optional[int] = None):
        self.lease_s = lease_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._wait_for_grant = wait_for_grant
        self._leases: Dict[str, Lease] = {}  # in the order they were made
        self._held: collections.Counter = collections.Counter()  # block -> P/D leases holding it
        self._changes = LeaseChanges()
        self.ranks = 1

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> Optional[Lease]:
        return self._leases.get(lease_id)

    def is_live(self, lease: Lease) -> bool:
        return self._leases.get(lease.lease_id) is lease

    @property
    def leased_blocks(self) -> int:
        """The distinct blocks P/D leases hold (a block two leases share counts once)."""
        return len(self._held)

    def make_room(self, block_ids: List[int]) -> Optional[List[Lease]]:
        """The untaken P/D leases, oldest first, to end so that a new P/D lease of `block_ids`
        fits under max_blocks ([] when it fits now), or None when it cannot fit (the leases
        taken by a pull, which are never ended under it, hold too much, or it is larger than
        the bound). Changes nothing."""
        if self.max_blocks is None or self._fits(self._held, block_ids):
            return []
        held = collections.Counter(self._held)
        evict: List[Lease] = []
        for lease in self._leases.values():
            if lease.taken or lease.migration_id is not None:
                continue
            evict.append(lease)
            held.subtract(lease.block_ids)
            held += collections.Counter()  # drops the blocks no lease holds any more
            if self._fits(held, block_ids):
                return evict
        return None

    def _fits(self, held: collections.Counter, block_ids: List[int]) -> bool:
        return len(held) + len(set(block_ids).difference(held)) <= self.max_blocks

    def add(self, req_id: str, block_ids: List[int], num_tokens: int, prompt_hash: str, *,
            migration_id: Optional[str] = None, token_ids: Optional[List[int]] = None, num_prompt_tokens: int = 0,
            preemptions: Optional[int] = None, last: Optional[Digested] = None) -> Lease:
        """A new lease, granted by the worker at the next step. `last`: the request's last
        granted lease (a migration's): the digests of the blocks they share are reused."""
        lease = Lease(secrets.token_hex(16), req_id, list(block_ids), num_tokens, prompt_hash,
                      self._clock() + self.lease_s, granted=not self._wait_for_grant, migration_id=migration_id,
                      token_ids=token_ids or [], num_prompt_tokens=num_prompt_tokens, preemptions=preemptions)
        self._leases[lease.lease_id] = lease
        if migration_id is None:
            self._held.update(lease.block_ids)
        self._changes.new_leases[lease.lease_id] = lease.block_ids
        if last is not None and last.preemptions == preemptions:
            k = 0
            while k < min(len(last.block_ids), len(block_ids)) and last.block_ids[k] == block_ids[k]:
                k += 1
            if k:
                lease.known_digests = {rank: digests[:k] for rank, digests in last.digests.items()}
                self._changes.digest_from[lease.lease_id] = k
        return lease

    def expired(self) -> List[Lease]:
        now = self._clock()
        return [lease for lease in self._leases.values() if lease.expires_at <= now]

    def take(self, lease: Lease, hold_s: float) -> None:
        """A consumer's acquire found the lease served: it lives at least `hold_s` more."""
        lease.expires_at = max(lease.expires_at, self._clock() + hold_s)

    def end(self, lease: Lease) -> None:
        """Its grant is revoked at the next step (its blocks go back with `free`)."""
        del self._leases[lease.lease_id]
        if lease.migration_id is None:
            self._held.subtract(lease.block_ids)
            self._held += collections.Counter()  # drops the blocks no lease holds any more
        self._changes.ended_leases.append(lease.lease_id)

    def free(self, req_id: str) -> None:
        """The request's blocks go back to vLLM at the next step (the worker reports it in
        finished_sending)."""
        self._changes.finished_sending.append(req_id)

    def grant(self, lease_ids: List[str], digests: Dict[str, List[int]], rank: int = 0) -> List[Lease]:
        """TP rank `rank`'s worker serves these leases' blocks now, with their digests; returns
        those whose digests just became complete on every rank."""
        digested = []
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            lease.granted_ranks.add(rank)
            lease.granted = len(lease.granted_ranks) >= self.ranks
            found = digests.get(lease_id)
            known = lease.known_digests.get(rank, [])
            if found is not None and rank not in lease.digests and len(known) + len(found) == len(lease.block_ids):
                lease.digests[rank] = known + list(found)
                if len(lease.digests) == self.ranks:
                    digested.append(lease)
        return digested

    def take_changes(self) -> LeaseChanges:
        changes, self._changes = self._changes, LeaseChanges()
        return changes

    def has_pending_frees(self) -> bool:
        return bool(self._changes.finished_sending)
