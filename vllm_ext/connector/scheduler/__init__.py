"""The scheduler half of VllmExtConnector (EngineCore process): vLLM's calls, the lease channel,
and the lock over the producer's leases and migrating requests.

Producer: a finished `do_remote_decode` request's blocks stay allocated under a lease (the
engine keeps them until the worker reports the request in finished_sending); the lease's
blocks are described in the returned kv_transfer_params and served to consumers through the
authenticated lease channel (lease/channel.py), which also frees them. A lease that nobody
takes or releases expires after `lease_s`; P/D leases together hold at most
`max_leased_fraction` of the cache, the oldest untaken ones ending early to make room (leases.py).

Consumer: a request whose kv_transfer_params come from a producer reports the tokens beyond
its local prefix-cache hit as an external hit, loaded inside the step that schedules it or
asynchronously by the `load` rule, and hands the worker a RecvJob (consumer.py).

Live migration: a producer is the source of the requests that carry a migration id
(migration_source.py) and traces the resumed requests it receives for migrate.trace (traces.py).

Who calls what (vLLM, on the engine thread unless said otherwise): get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
set_handshake (once at start-up), and the lease channel's threads call _serve (its requests are
answered in lease_requests.py).
"""

import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...lease.channel import LeaseServer
from ...lease.kv_params import RemoteKV, migration_id_of, prompt_hash
from .. import compat
from ..groups import ONE, Groups
from ..metadata import VllmExtHandshake, VllmExtMetadata
from ..stats import VllmExtStats
from .consumer import Consumer, skip_draws
from .lease_requests import LeaseRequests
from .leases import Lease, LeaseTable
from .migration_source import MigrationSource
from .traces import Traces

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# Unleased prefills and early-ended leases are logged at most this often (a flood is one line).
BOUND_LOG_S = 10.0


class ProducerParams(dict):
    """The kv_transfer_params a producer answers a prefill with. vLLM's scheduler adds the
    request's local prefix-cache hit to them (`remote_prefill_cached_tokens`, for the decode
    side's usage report): an oracle that tells any client how much of a guessed prompt this
    instance has cached. This dict does not take that key; nothing else needs it (the decode side
    then reports its own hit)."""

    def __setitem__(self, key, value):
        if key != "remote_prefill_cached_tokens":
            super().__setitem__(key, value)


# What a producer answers when it makes no lease (max_leased_fraction reached): the decode side
# computes the prompt itself, under either failure policy.
UNLEASED = {"do_remote_prefill": False, "do_remote_decode": False}


class SchedulerHalf(LeaseRequests):
    """Args are values: the roles, the engine's block size, the lease settings (the most blocks
    P/D leases may hold together: None, no bound), the deployment secret and
    `kv_load_failure_policy` ("fail" or "recompute")."""

    def __init__(self, *, is_producer: bool, is_consumer: bool, block_size: int, lease_s: float,
                 lease_host: str, lease_port: int, secret: bytes, failure_policy: str,
                 whole_blocks: bool = False, clock: Callable[[], float] = time.monotonic,
                 wait_for_grant: bool = True, async_scheduling: bool = False,
                 max_tokens_limits: Tuple[int, int] = (0, 0), max_leased_blocks: Optional[int] = None,
                 load: str = "auto", groups: Groups = ONE):
        self.is_producer = is_producer
        # the KV cache groups: a request's block ids interleave them (groups.py)
        self.groups = groups
        self.is_consumer = is_consumer
        self.block_size = block_size
        self.lease_s = lease_s
        # wait_for_grant: the worker reports the leases it serves (update_connector_output) and
        # acquire waits for that; False (releases without worker metadata): served at once
        self.wait_for_grant = wait_for_grant
        # the engine schedules a step before the last one's output is in: a failed load before a
        # request's first step is then unsafe (vLLM has run its next step on the bad blocks)
        self.async_scheduling = async_scheduling
        # (default, cap) of the output limit the instance's OpenAI server applies (0: none), for
        # lease.describe: the router carries them across a move
        self.max_tokens_limits = max_tokens_limits
        # the leases and the migrating requests: the engine thread and the lease channel's threads
        self._lock = threading.Lock()
        self._granted = threading.Condition(self._lock)  # a lease was granted or ended, or a step passed
        self._leases = LeaseTable(lease_s=lease_s, clock=clock, wait_for_grant=wait_for_grant,
                                  max_blocks=max_leased_blocks)
        # the engine's progress, for an acquire's wait (real time: `clock` may be a test's)
        self._last_step_at = time.monotonic()  # a step scheduled or its output in
        self._steps_in_flight = 0  # scheduled, output not in yet
        self._bound_log = {"evicted": 0, "unleased": 0, "logged_at": 0.0}
        self._source = MigrationSource(block_size=block_size, refusal=groups.live_migration_refusal())
        self._traces = Traces()  # a lock of its own
        self._consumer = Consumer(block_size=block_size, failure_policy=failure_policy, whole_blocks=whole_blocks,
                                  load=load, async_scheduling=async_scheduling,
                                  groups=groups) if is_consumer else None
        self._handshake: Optional[VllmExtHandshake] = None  # TP rank 0's: the instance's endpoint id
        self._handshakes: Dict[int, VllmExtHandshake] = {}  # TP rank -> its worker's
        self._stats = VllmExtStats()
        self._server = None
        if is_producer:
            self._server = LeaseServer(secret, self._serve, host=lease_host, port=lease_port)
            logger.info("vllm-ext connector: lease channel at %s:%d (lease %g s, P/D leases hold at most %s blocks)",
                        self._server.host, self._server.port, lease_s,
                        "any number of" if max_leased_blocks is None else max_leased_blocks)

    # ---- start-up ------------------------------------------------------------------------
    def set_handshake(self, metadata: Dict[int, VllmExtHandshake]) -> None:
        """Every TP rank's worker's handshake (rank -> it): each serves its own shard of the
        cache, with an endpoint of its own; the shards' layouts must agree."""
        ranks = sorted(metadata)
        if ranks != list(range(len(ranks))) or not ranks:
            raise ValueError(f"VllmExtConnector: expected the handshakes of TP ranks 0 to n-1, got ranks {ranks}")
        shards = {rank: json.dumps(h.fingerprint_fields, sort_keys=True) for rank, h in metadata.items()}
        if len(set(shards.values())) != 1:
            raise ValueError(f"VllmExtConnector: the TP ranks' KV cache shards differ ({shards}): a model whose KV "
                             "heads do not split evenly over the ranks is not supported")
        self._handshakes = dict(metadata)
        self._handshake = metadata[0]
        with self._lock:
            self._leases.ranks = len(ranks)
        if self._consumer is not None:
            self._consumer.fingerprint = self._handshake.fingerprint

    @property
    def lease_address(self) -> Tuple[str, int]:
        assert self._server is not None
        return self._server.host, self._server.port

    # ---- admission (engine thread) -------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        """The external tokens beyond the (block-aligned) local hit (its only side effect: the
        first look at a request with a migration id is noted for migrate.trace)."""
        self._note_trace(request, scheduled=False)
        if self._consumer is None:
            return 0, False
        return self._consumer.matched_tokens(request, num_computed_tokens)

    def may_load_async(self, params: Any) -> bool:
        """vLLM 0.34's may_load_async, by the consumer's rule (consumer.py)."""
        return compat.may_load_async(params, self._consumer)

    def update_state_after_alloc(self, request, block_ids: List[int], num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks (local-hit blocks first; the groups interleaved)."""
        try:
            mid = migration_id_of(request.kv_transfer_params) if self.is_producer else None
            if mid is not None:
                with self._lock:
                    self._source.track(request, block_ids)
            if self._consumer is None:
                return
            job = self._consumer.allocated(request, block_ids, num_external_tokens)
            if job is not None and job.sync and mid is not None:
                self._traces.load_started(request.request_id, mid, job.dst_block_ids)  # its trace says if it fails
        finally:  # after a sync load is registered: its trace settles only once that load ended
            self._note_trace(request, scheduled=True)

    def _note_trace(self, request, scheduled: bool) -> None:
        """Notes the time of the scheduler's first look at, or first scheduling of, a request
        that carries a migration id (a resumed one: where its switch went)."""
        if not self.is_producer:
            return
        mid = migration_id_of(request.kv_transfer_params)
        if mid is not None:
            self._traces.note(mid, getattr(request, "arrival_time", None), scheduled)

    # ---- a request's end (engine thread) -------------------------------------------------
    def request_finished(self, request, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """`block_ids`: the request's blocks, the groups interleaved (groups.py)."""
        self._traces.request_finished(request.request_id)
        if self._consumer is not None:
            self._consumer.request_finished(request)
        if not self.is_producer:
            return False, None
        with self._lock:
            if self._source.is_tracked(request.request_id):
                return self._source.request_finished(request.request_id), None
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        if self._handshake is None:
            logger.warning("request %s: no worker handshake yet; its KV is not offered", request.request_id)
            return False, None
        num_tokens = min(request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
                         request.num_prompt_tokens)
        nblocks = -(-num_tokens // self.block_size) * self.groups.count
        if num_tokens <= 0 or nblocks > len(block_ids):
            return False, None
        leased = list(block_ids[:nblocks])
        with self._lock:
            room = self._leases.make_room(leased)
            if room is None:  # taken leases hold the bound: this prompt is computed again by its consumer
                self._stats.record_unleased()
                self._note_bound("unleased")
                return False, dict(UNLEASED)
            for old in room:
                self._end_lease(old, "evicted")
            lease = self._leases.add(request.request_id, leased, num_tokens,
                                     prompt_hash(request.all_token_ids[:num_tokens]))
            self._stats.record_leased_blocks(self._leases.leased_blocks)
        desc = self._handshake.descriptor
        host, port = self.lease_address
        return True, ProducerParams(RemoteKV(
            lease=lease.lease_id, block_ids=lease.block_ids, num_tokens=num_tokens, prompt_hash=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, lease_host=host, lease_port=port,
            endpoint_id=desc["endpoint_id"], backend=desc["backend"], lease_s=self.lease_s).to_params())

    def _note_bound(self, what: str) -> None:
        """With the lock held: one log line per BOUND_LOG_S for the leases the bound ended early
        and the prefills it left unleased (a client flooding prefills would write one a request)."""
        self._bound_log[what] += 1
        now = time.monotonic()
        if now - self._bound_log["logged_at"] >= BOUND_LOG_S:
            logger.warning("P/D leases hold their bound of %d blocks (kv_connector_extra_config.max_leased_fraction): "
                           "%d untaken leases ended early and %d prefills left unleased (their decode side computes "
                           "the prompt) since the last such line", self._leases.max_blocks,
                           self._bound_log["evicted"], self._bound_log["unleased"])
            self._bound_log.update(evicted=0, unleased=0, logged_at=now)

    # ---- every step (engine thread) ------------------------------------------------------
    def build_connector_meta(self, scheduler_output=None) -> VllmExtMetadata:
        with self._lock:
            self._step_passed(+1)
            if self.is_producer:
                self._reap_expired()
                self._source.follow_blocks(scheduler_output)
                if self._source.has_asks():
                    self._precopy(scheduler_output)
            changes = self._leases.take_changes()
        skips = skip_draws(scheduler_output) if self._consumer is not None else {}
        recvs, releases = self._consumer.take_jobs() if self._consumer is not None else ([], [])
        return VllmExtMetadata(recvs=recvs, releases=releases, new_leases=changes.new_leases,
                               digest_from=changes.digest_from, ended_leases=changes.ended_leases,
                               finished_sending=changes.finished_sending, skip_draws=skips)

    def _precopy(self, scheduler_output) -> None:
        """With the lock held: the pre-copy leases asked since the last step, from this step's counts."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) if scheduler_output is not None else {}
        for mid, ask in self._source.take_asks().items():
            try:
                cut = self._source.cut(mid, scheduled)
            except ValueError as e:  # RequestEnded among them
                ask.error = e
            else:
                ask.lease = self._leases.add(cut.req_id, cut.block_ids, cut.num_tokens,
                                             prompt_hash(cut.token_ids[:cut.num_tokens]), migration_id=mid,
                                             token_ids=cut.token_ids, num_prompt_tokens=cut.num_prompt_tokens,
                                             preemptions=cut.preemptions, last=cut.last)
                self._source.leased(mid, ask.lease.lease_id)
            ask.event.set()

    def update_connector_output(self, output) -> None:
        """The step's worker output: the leases whose blocks the worker now serves, and the
        blocks of loads that failed (a resumed request's: its trace says so)."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        self._traces.step_reported(getattr(output, "invalid_block_ids", None), getattr(meta, "loaded", None) or ())
        granted = getattr(meta, "granted", None) or {}
        digests = getattr(meta, "digests", None) or {}
        with self._lock:
            self._step_passed(-1)
            for rank, lease_ids in granted.items():  # each TP rank's worker's
                for lease in self._leases.grant(lease_ids, digests.get(rank, {}), rank):
                    if lease.migration_id is not None:
                        self._source.digested(lease)

    def _step_passed(self, scheduled: int) -> None:
        """With the lock held: a step was scheduled (+1) or its output came in (-1)."""
        self._steps_in_flight = max(0, self._steps_in_flight + scheduled)
        self._last_step_at = time.monotonic()
        self._granted.notify_all()

    def has_pending_frees(self) -> bool:
        """Leases ended whose blocks go back at the next step (live leases are not counted: a
        scheduler short of blocks preempts rather than waits up to lease_s for them)."""
        with self._lock:
            return self._leases.has_pending_frees()

    # ---- leases' ends (with the lock held) -----------------------------------------------
    def _end_lease(self, lease: Lease, why: str) -> None:
        """The lease's blocks go back to the engine at the next step (a migration lease's: once
        its request finished and its last lease ended)."""
        self._leases.end(lease)
        self._granted.notify_all()
        if lease.migration_id is None:
            self._stats.record_leased_blocks(self._leases.leased_blocks)
        if lease.migration_id is None or self._source.lease_ended(lease.migration_id, lease.lease_id):
            self._leases.free(lease.req_id)
        if why == "evicted":
            self._stats.record_eviction()
            self._note_bound("evicted")
        if why == "expired":
            self._stats.record_expiry()
            logger.warning("lease %s (request %s, %d blocks) expired unused after %g s; blocks freed",
                           lease.lease_id[:8], lease.req_id, len(lease.block_ids), self.lease_s)

    def _reap_expired(self) -> None:
        for lease in self._leases.expired():
            self._end_lease(lease, "expired")

    def failed_load_is_unsafe(self) -> bool:
        """Whether a resumed request whose first load failed may have had wrong tokens sent."""
        return self.async_scheduling

    # ---- accounting ----------------------------------------------------------------------
    def get_stats(self) -> Optional[VllmExtStats]:
        with self._lock:  # the lease channel's threads record too
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, VllmExtStats()
        return stats

    def leased_blocks(self) -> int:
        """The distinct blocks P/D leases hold now (the vllm:vllm_ext_leased_blocks gauge)."""
        with self._lock:
            return self._leases.leased_blocks

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
