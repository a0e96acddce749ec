"""migrate.trace: when a request that carries a migration id arrived, was first looked at and
first scheduled here (a resumed request: where its switch went), and whether the load before its
first step failed.

A resumed request loads its KV before its first step's forward (sync): its trace settles only
once that step's output has reported the load (the worker's `loaded`), a failure showing as
invalid blocks in the same output. The router asks with the resume and waits for the answer.

Thread-safe: the engine thread notes, the lease channel's threads wait.
"""

import collections
import dataclasses
import threading
import time
from typing import Dict, Iterable, Optional, Set, Tuple

# The requests with a migration id whose arrival times migrate.trace still knows.
MAX_TRACES = 1024


@dataclasses.dataclass
class Trace:
    """Times on time.time()'s clock."""

    arrival_s: float
    seen_s: float
    scheduled_s: float = 0.0  # 0: not scheduled yet
    load_failed: bool = False


@dataclasses.dataclass(frozen=True)
class SyncLoad:
    """A resumed request's load before its first step (its blocks: a failure shows among the
    step's invalid blocks)."""

    migration_id: str
    block_ids: frozenset


class Traces:
    def __init__(self):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a trace was scheduled, or its load ended
        # migration id -> its trace; the oldest are forgotten past MAX_TRACES
        self._traces: collections.OrderedDict[str, Trace] = collections.OrderedDict()
        self._sync_loads: Dict[str, SyncLoad] = {}  # request id -> its load before its first step
        self._loading: Set[str] = set()  # migration ids whose sync load's step has not reported yet

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)

    def __contains__(self, mid: str) -> bool:
        with self._lock:
            return mid in self._traces

    # ---- engine thread -------------------------------------------------------------------
    def note(self, mid: str, arrival: Optional[float], scheduled: bool) -> None:
        """The scheduler's first look at the request (`arrival`: its API server's time, when
        known), or its first scheduling."""
        now = time.time()
        with self._lock:
            trace = self._traces.get(mid)
            if trace is None:
                trace = self._traces[mid] = Trace(arrival_s=arrival if isinstance(arrival, float) else now,
                                                  seen_s=now)
                while len(self._traces) > MAX_TRACES:
                    self._traces.popitem(last=False)
            if scheduled and not trace.scheduled_s:
                trace.scheduled_s = now
                self._changed.notify_all()

    def load_started(self, req_id: str, mid: str, block_ids: Iterable[int]) -> None:
        with self._lock:
            self._sync_loads[req_id] = SyncLoad(mid, frozenset(block_ids))
            self._loading.add(mid)

    def step_reported(self, invalid_block_ids: Optional[Set[int]], loaded: Iterable[str]) -> None:
        """A step's output: the blocks of failed loads, the requests whose sync loads ended."""
        if not self._sync_loads:
            return
        with self._lock:
            if invalid_block_ids:
                for load in self._sync_loads.values():
                    trace = self._traces.get(load.migration_id)
                    if trace is not None and not load.block_ids.isdisjoint(invalid_block_ids):
                        trace.load_failed = True
            if loaded:
                for req_id in loaded:
                    load = self._sync_loads.get(req_id)
                    if load is not None:
                        self._loading.discard(load.migration_id)
                self._changed.notify_all()

    def request_finished(self, req_id: str) -> None:
        """A request whose sync load's step never reported settles now."""
        if not self._sync_loads:
            return
        with self._lock:
            load = self._sync_loads.pop(req_id, None)
            if load is not None and load.migration_id in self._loading:
                self._loading.discard(load.migration_id)
                self._changed.notify_all()

    # ---- lease channel threads -----------------------------------------------------------
    def wait(self, mid: str, wait_s: float, loads_report: bool = True) -> Tuple[Trace, bool]:
        """(a copy of the trace of the request carrying `mid`, whether it is settled), once
        settled or after `wait_s`. `loads_report` false: the worker reports no loads (releases
        without worker metadata), so a scheduled trace is answered at once. ValueError when no
        request carried it lately or it is not scheduled yet."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                trace = self._traces.get(mid)
                scheduled = trace is not None and bool(trace.scheduled_s)
                settled = scheduled and mid not in self._loading
                left = deadline - time.monotonic()
                if settled or left <= 0 or (scheduled and not loads_report):
                    break
                self._changed.wait(left)
            if not scheduled:
                raise ValueError(f"migration {mid[:8]}: no request here carried it lately, or it is not scheduled "
                                 "yet")
            return dataclasses.replace(trace), settled
