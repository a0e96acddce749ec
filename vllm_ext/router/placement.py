"""Where requests and migrations go: one policy for both fronts.

Turns orders the servers a request may go to (the router's instances, the P/D proxy's prefill
or decode servers): in turn, each request starting one further (round_robin), or by load, in
turn among equals (least_loaded). Placement is the router's whole policy over its instances:
the order a new request, a recovery or /migrate's choice tries them in, whether a migration may
go to an instance now (its room, the request's own state, its output limit and its random
stream), and what the balancer and a drain move where."""

import itertools
from typing import Any, List, Optional, Sequence, Tuple

from . import legs
from .state import Instance, Routed

POLICIES = ("round_robin", "least_loaded")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")


class Turns:
    """The order of the servers one request tries (each has a `load`: requests it serves now)."""

    def __init__(self, policy: str):
        check_policy(policy)
        self.policy = policy
        self._next = itertools.count()

    def order(self, servers: Sequence[Any]) -> List[Any]:
        start = next(self._next) % max(len(servers), 1)
        order = list(servers[start:]) + list(servers[:start])
        if self.policy == "least_loaded":
            order.sort(key=lambda s: s.load)  # stable: in turn among equals
        return order


def no_room(inst: Instance, max_kv_usage: float) -> Optional[str]:
    """Why no migration may go to `inst` now (None: it may), from its last /metrics poll: a
    request that has to wait for blocks there would make the moved one wait too."""
    usage, waiting = inst.metrics.get("kv_cache_usage_perc", 0.0), inst.metrics.get("num_requests_waiting", 0.0)
    if waiting > 0:
        return f"it queues {waiting:g} requests"
    if usage >= max_kv_usage:
        return f"its KV cache is {100 * usage:.0f}% used (a migration goes where it is under " \
               f"{100 * max_kv_usage:.0f}%)"
    return None


class Placement:
    """The router's policy over `fleet`'s instances (fleet.py), under `settings`."""

    def __init__(self, fleet, settings):
        self.fleet, self.settings = fleet, settings
        self._turns = Turns(settings.policy)

    # ---- where a request goes --------------------------------------------------------------
    def candidates(self, exclude=()) -> List[Instance]:
        """The instances a request tries, in order: those up and not draining (all that are not
        draining when every one is marked down: tried rather than refused)."""
        instances = self.fleet.instances
        up = [i for i in instances if i.healthy and not i.draining and i not in exclude]
        if not up:
            up = [i for i in instances if not i.draining and i not in exclude]
        return self._turns.order(up)

    def recovery_order(self, routed: Routed, prefer_source: bool) -> List[Instance]:
        """Where a request whose leg is gone continues: the others (draining ones last), and its
        instance if it is up: first when `prefer_source` and it is not draining, else last."""
        prev = routed.instance
        others = self.candidates(exclude=(prev,))
        others += [i for i in self.fleet.instances
                   if i.draining and i.healthy and i is not prev and i not in others]
        source = [prev] if prev is not None and prev.healthy else []
        return source + others if prefer_source and source and not prev.draining else others + source

    # ---- whether a migration may go there ----------------------------------------------------
    def no_room(self, inst: Instance) -> Optional[str]:
        """Why no migration may go to `inst` now (None: it has room; no_room)."""
        return no_room(inst, self.settings.max_destination_kv_usage)

    def cannot_start(self, routed: Routed, dst: Instance) -> Optional[str]:
        """Why `routed` cannot begin to move to `dst` now (None: it can)."""
        src = routed.instance
        if routed.migration is not None:
            return f"request {routed.rid} is moving already"
        if routed.pinned:
            return f"request {routed.rid} cannot move: {routed.pinned}"
        if src is None or routed.leg is None or routed.client.prompt_token_ids is None:
            return f"request {routed.rid} has not started yet"
        if src is dst:
            return f"request {routed.rid} runs on {dst.url} already"
        if src.control is None:
            return f"instance {src.url} has no lease channel (--lease): its requests cannot move"
        full = self.no_room(dst)
        if full is not None:
            return f"to: {dst.url} takes no migration now: {full}"
        return None

    async def refusal(self, routed: Routed, dst: Instance) -> Optional[str]:
        """Why `routed` may not move to `dst` (None: it may): a request moves only where its output
        limit holds (the destination caps none of what is left of it below it), and a seeded one
        only where its random stream goes on: both instances draw the same way
        (vllm_ext/connector/sampling.py). A migration asks before it starts and again before the
        stop: a request pinned meanwhile stays."""
        if routed.pinned:
            return routed.pinned
        described = await self.fleet.describe(dst)
        cap = described.max_tokens_cap if described is not None else 0
        limit = routed.limit.value()
        left = None if limit is None else limit - len(routed.client.token_ids)
        if cap and (left is None or left > cap):
            return (f"the destination caps a request's output at {cap} tokens (its generation config), "
                    f"this one has {'no limit' if left is None else f'{left} tokens'} left")
        if not legs.seeded_random(routed.body) or routed.instance is None:
            return None
        source = await self.fleet.sampler(routed.instance)
        there = await self.fleet.sampler(dst)
        if not source or source != there:
            return (f"a seeded request's random stream would not go on there: the source samples by "
                    f"{source or 'an unknown way'!r}, the destination by {there or 'an unknown way'!r}")
        return None

    # ---- what moves where ------------------------------------------------------------------
    @staticmethod
    def movable(request) -> bool:
        """A request of an instance's that a drain or the balancer may move now."""
        return (isinstance(request, Routed) and request.migration is None and request.leg is not None
                and not request.pinned and request.client.prompt_token_ids is not None)

    def target(self, src: Optional[Instance]) -> Optional[Instance]:
        """/migrate's own choice for a request of `src`: the least loaded other instance with room,
        one with no migration coming in first (those not known healthy when none is)."""
        targets = [i for i in self.candidates(exclude=(src,)) if i.healthy and self.no_room(i) is None]
        if not targets:
            targets = self.candidates(exclude=(src,))  # none known healthy: try the others
        return min(targets, key=lambda i: (i.migrating_in > 0, i.load)) if targets else None

    def drain_target(self, inst: Instance) -> Optional[Instance]:
        """Where a drain of `inst` moves its next request: the least loaded instance up, with room
        and no migration coming in (None: none now)."""
        targets = [i for i in self.candidates(exclude=(inst,)) if i.healthy and not i.migrating_in
                   and self.no_room(i) is None]
        return min(targets, key=lambda i: i.load) if targets else None

    def pick(self, inst: Instance) -> Optional[Routed]:
        """The request the balancer moves off `inst`: the shortest running (fewest tokens
        generated) of those that may move, have moved fewer than max_migrations_per_request
        times and have min_remaining_tokens or more left."""
        best = None
        for routed in inst.requests.values():
            if not self.movable(routed) or len(routed.migrations) >= self.settings.max_migrations_per_request:
                continue
            limit = routed.limit.value()
            if limit is not None and limit - len(routed.client.token_ids) < self.settings.min_remaining_tokens:
                continue
            if best is None or len(routed.client.token_ids) < len(best.client.token_ids):
                best = routed
        return best

    def balance(self) -> Optional[Tuple[Routed, Instance]]:
        """Llumnix-style: a request of the most loaded instance and the least loaded one with room
        to move it to, when their loads differ by balance_threshold or more; one migration in and
        one out per instance at a time (None: nothing to move now)."""
        pool = [i for i in self.fleet.instances if i.healthy and not i.draining]
        if len(pool) < 2:
            return None
        src = max(pool, key=lambda i: i.load)
        room = [i for i in pool if self.no_room(i) is None]
        if not room:
            return None
        dst = min(room, key=lambda i: i.load)
        if src.load - dst.load < self.settings.balance_threshold or src.control is None:
            return None
        if src.migrating_out or src.migrating_in or dst.migrating_in or dst.migrating_out:
            return None
        routed = self.pick(src)
        return None if routed is None else (routed, dst)
