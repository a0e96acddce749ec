"""The live-migration source (vllm_ext/router/live.py drives it): the requests that carry a
migration id, their block tables, and the router's pre-copy asks.

A request whose kv_transfer_params carry a `migration_id` is tracked with its block table (from
the scheduler output of every step). A router may ask for pre-copy leases on its complete blocks
while it runs (made on the engine thread, from that step's exact counts), abort the request after
the last one (its blocks stay under that lease), and end the migration. A finished request's
blocks go back to vLLM only when its last lease has ended.

Not thread-safe: SchedulerHalf calls it under its lock (engine thread and lease channel threads).
"""

import dataclasses
import logging
import threading
from typing import Any, Dict, List, Optional, Set

from ...lease import messages
from ...lease.kv_params import migration_id_of
from ..compat import resumed_req_ids
from .leases import Digested, Lease

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclasses.dataclass(eq=False)
class Tracked:
    """A request that carries a migration id (source side): its block table and its leases."""

    migration_id: str
    request: Any  # vLLM's Request
    block_ids: List[int]
    finished: bool = False
    leases: Set[str] = dataclasses.field(default_factory=set)  # live lease ids
    digested: Optional[Digested] = None  # its last granted lease's blocks and digests


@dataclasses.dataclass(eq=False)
class PrecopyAsk:
    """A router's pre-copy, asked on the lease channel, answered at the engine's next step with
    a lease or a refusal (RequestEnded: the router lets the request finish; ValueError)."""

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    lease: Optional[Lease] = None
    error: Optional[Exception] = None


@dataclasses.dataclass(frozen=True)
class PrecopyCut:
    """What a pre-copy lease holds: a running request's complete blocks of tokens computed
    before this step."""

    req_id: str
    block_ids: List[int]
    num_tokens: int
    token_ids: List[int]  # the request's tokens so far
    num_prompt_tokens: int
    preemptions: int
    last: Optional[Digested]  # its last granted lease's


def preemptions_of(request) -> int:
    return getattr(request, "num_preemptions", 0)


class MigrationSource:
    """Args are values: the engine's block size, and why no request of this instance can move
    (None: they can; its KV cache groups say: groups.py)."""

    def __init__(self, *, block_size: int, refusal: Optional[str] = None):
        self.block_size = block_size
        self.refusal = refusal
        self._tracked: Dict[str, Tracked] = {}  # migration id -> request
        self._by_req: Dict[str, str] = {}  # request id -> migration id
        self._asks: Dict[str, PrecopyAsk] = {}  # migration id -> the pre-copy asked

    # ---- engine thread -------------------------------------------------------------------
    def track(self, request, block_ids: List[int]) -> None:
        """Follows a request that a router may migrate (it carries a migration id)."""
        mid = migration_id_of(request.kv_transfer_params)
        if mid is None or self.refusal is not None:
            return
        tracked = self._tracked.get(mid)
        if tracked is not None and tracked.request is not request:
            logger.warning("request %s: migration id %s is already in use here; not migratable", request.request_id,
                           mid[:8])
            return
        if tracked is None:
            self._tracked[mid] = Tracked(mid, request, list(block_ids))
            self._by_req[request.request_id] = mid
        else:  # resumed after a preemption: a new block table
            tracked.block_ids = list(block_ids)

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._by_req

    def request_finished(self, req_id: str) -> bool:
        """A tracked request ended (the router's abort after its last lease, or its own end):
        True keeps its blocks until its leases end."""
        tracked = self._tracked[self._by_req[req_id]]
        tracked.finished = True
        if tracked.leases:
            return True
        self._untrack(tracked)
        return False

    def follow_blocks(self, scheduler_output) -> None:
        """The tracked requests' block tables after this step's allocation."""
        if scheduler_output is None or not self._by_req:
            return
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            mid = self._by_req.get(new.req_id)
            if mid is not None:
                self._tracked[mid].block_ids = list(new.block_ids[0])
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is None:
            return
        resumed = resumed_req_ids(cached)
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            mid = self._by_req.get(req_id)
            if mid is None or new_ids is None:
                continue
            tracked = self._tracked[mid]
            if req_id in resumed:
                tracked.block_ids = list(new_ids[0])
            else:
                tracked.block_ids.extend(new_ids[0])

    def take_asks(self) -> Dict[str, PrecopyAsk]:
        asks, self._asks = self._asks, {}
        return asks

    def cut(self, mid: str, num_scheduled_tokens: Dict[str, int]) -> PrecopyCut:
        """The blocks a pre-copy lease holds, from this step's counts: only complete blocks of
        tokens computed before this step (under asynchronous scheduling one more step may still be
        writing: it is left out too). Raises the refusal."""
        from vllm.v1.request import RequestStatus

        tracked = self._tracked.get(mid)
        request = tracked.request if tracked is not None else None
        if request is None or tracked.finished or RequestStatus.is_finished(request.status):
            raise messages.RequestEnded("the request ended here")
        if request.status != RequestStatus.RUNNING:
            raise ValueError("the request is not running here (preempted)")
        valid = request.num_computed_tokens - num_scheduled_tokens.get(request.request_id, 0) - 1
        nblocks = min(max(valid, 0) // self.block_size, len(tracked.block_ids))
        if nblocks == 0:
            raise ValueError("the request has no complete block yet")
        return PrecopyCut(req_id=request.request_id, block_ids=tracked.block_ids[:nblocks],
                          num_tokens=nblocks * self.block_size, token_ids=list(request.all_token_ids),
                          num_prompt_tokens=request.num_prompt_tokens, preemptions=preemptions_of(request),
                          last=tracked.digested)

    # ---- lease channel threads -----------------------------------------------------------
    def ask(self, mid: str) -> PrecopyAsk:
        """A router's pre-copy ask, answered at the engine's next step."""
        if self.refusal is not None:
            raise ValueError(f"migration {mid[:8]}: {self.refusal}")
        if mid not in self._tracked:
            raise messages.RequestEnded(f"migration {mid[:8]}: no running request of this instance carries it")
        ask = self._asks[mid] = PrecopyAsk()
        return ask

    def forget_ask(self, mid: str) -> None:
        self._asks.pop(mid, None)

    def has_asks(self) -> bool:
        return bool(self._asks)

    def leases_of(self, mid: str) -> List[str]:
        tracked = self._tracked.get(mid)
        return list(tracked.leases) if tracked is not None else []

    def preemptions(self, mid: str) -> Optional[int]:
        """The tracked request's preemption count now (None: not tracked here)."""
        tracked = self._tracked.get(mid)
        return preemptions_of(tracked.request) if tracked is not None else None

    # ---- both ----------------------------------------------------------------------------
    def leased(self, mid: str, lease_id: str) -> None:
        self._tracked[mid].leases.add(lease_id)

    def digested(self, lease: Lease) -> None:
        """A lease of the request was granted with all its blocks' digests."""
        tracked = self._tracked.get(lease.migration_id)
        if tracked is not None:
            tracked.digested = Digested(lease.preemptions, lease.block_ids, lease.digests)

    def lease_ended(self, mid: str, lease_id: str) -> bool:
        """True when the request's blocks go back to vLLM now (it finished, its last lease ended)."""
        tracked = self._tracked.get(mid)
        if tracked is None:
            return False
        tracked.leases.discard(lease_id)
        if tracked.finished and not tracked.leases:
            self._untrack(tracked)
            return True
        return False

    def _untrack(self, tracked: Tracked) -> None:
        self._tracked.pop(tracked.migration_id, None)
        self._by_req.pop(tracked.request.request_id, None)
