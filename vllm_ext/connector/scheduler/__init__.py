"""The scheduler half of VllmExtConnector (EngineCore process): vLLM's calls, the lease channel,
and the lock over the producer's leases and migrating requests.

Producer: a finished `do_remote_decode` request's blocks stay allocated under a lease (the
engine keeps them until the worker reports the request in finished_sending); the lease's
blocks are described in the returned kv_transfer_params and served to consumers through the
authenticated lease channel (lease/channel.py), which also frees them. A lease that nobody
takes or releases expires after `lease_s` (leases.py).

Consumer: a request whose kv_transfer_params come from a producer reports the tokens beyond
its local prefix-cache hit as an asynchronous external hit, and hands the worker a RecvJob
(consumer.py).

Live migration: a producer is the source of the requests that carry a migration id
(migration_source.py) and traces the resumed requests it receives for migrate.trace (traces.py).

Who calls what (vLLM, on the engine thread unless said otherwise): get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
set_handshake (once at start-up), and the lease channel's threads call _serve.
"""

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...lease import messages
from ...lease.channel import LeaseServer
from ...lease.kv_params import RemoteKV, migration_id_of, prompt_hash
from ...migration import protocol
from ..metadata import VllmExtHandshake, VllmExtMetadata
from ..stats import VllmExtStats
from .consumer import Consumer, skip_draws
from .leases import Lease, LeaseTable
from .migration_source import MigrationSource
from .traces import Traces

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# A consumer's acquire may extend a lease by at most this much beyond its remaining time (the
# pull's deadline): a lease is never freed under a pull in progress, nor held forever.
MAX_HOLD_S = 900.0  # a pull's deadline is at most 600 s (pull_timeout_s)
# An acquire waits at most this long for the producer's worker to serve the lease's blocks (it
# grants them in the engine step after the lease is made: milliseconds).
GRANT_WAIT_S = 3.0
# A pre-copy asked on the lease channel waits at most this long for the engine's next step.
PRECOPY_WAIT_S = 2.0
# Then its reply waits at most this long for the worker to serve the lease's blocks (the step's
# output: one or two steps), so that the destination's acquire finds them served and its load,
# under the resume's first step, does not wait for the source's engine (after this, it does).
PRECOPY_GRANT_WAIT_S = 1.0


class SchedulerHalf:
    """Args are values: the roles, the engine's block size, the lease settings, the
    deployment secret and `kv_load_failure_policy` ("fail" or "recompute")."""

    def __init__(self, *, is_producer: bool, is_consumer: bool, block_size: int, lease_s: float,
                 lease_host: str, lease_port: int, secret: bytes, failure_policy: str,
                 whole_blocks: bool = False, clock: Callable[[], float] = time.monotonic,
                 wait_for_grant: bool = True, async_scheduling: bool = False,
                 max_tokens_limits: Tuple[int, int] = (0, 0)):
        self.is_producer = is_producer
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
        self._granted = threading.Condition(self._lock)  # a lease was granted or ended
        self._leases = LeaseTable(lease_s=lease_s, clock=clock, wait_for_grant=wait_for_grant)
        self._source = MigrationSource(block_size=block_size)
        self._traces = Traces()  # a lock of its own
        self._consumer = Consumer(block_size=block_size, failure_policy=failure_policy,
                                  whole_blocks=whole_blocks) if is_consumer else None  # engine thread only
        self._handshake: Optional[VllmExtHandshake] = None
        self._stats = VllmExtStats()
        self._server = None
        if is_producer:
            self._server = LeaseServer(secret, self._serve, host=lease_host, port=lease_port)
            logger.info("vllm-ext connector: lease channel at %s:%d (lease %g s)",
                        self._server.host, self._server.port, lease_s)

    # ---- start-up ------------------------------------------------------------------------
    def set_handshake(self, metadata: Dict[int, VllmExtHandshake]) -> None:
        if set(metadata) != {0}:
            raise ValueError(f"VllmExtConnector supports one worker (TP=1, PP=1); got ranks {sorted(metadata)}")
        self._handshake = metadata[0]
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

    def update_state_after_alloc(self, request, block_ids: List[int], num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks (local-hit blocks first)."""
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
        nblocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or nblocks > len(block_ids):
            return False, None
        with self._lock:
            lease = self._leases.add(request.request_id, list(block_ids[:nblocks]), num_tokens,
                                     prompt_hash(request.all_token_ids[:num_tokens]))
        desc = self._handshake.descriptor
        host, port = self.lease_address
        return True, RemoteKV(
            lease=lease.lease_id, block_ids=lease.block_ids, num_tokens=num_tokens, prompt_hash=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, lease_host=host, lease_port=port,
            endpoint_id=desc["endpoint_id"], backend=desc["backend"], lease_s=self.lease_s).to_params()

    # ---- every step (engine thread) ------------------------------------------------------
    def build_connector_meta(self, scheduler_output=None) -> VllmExtMetadata:
        with self._lock:
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
        granted = getattr(meta, "granted", None)
        if not granted:
            return
        with self._lock:
            for lease in self._leases.grant(granted, getattr(meta, "digests", None) or {}):
                if lease.migration_id is not None:
                    self._source.digested(lease)
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
        if lease.migration_id is None or self._source.lease_ended(lease.migration_id, lease.lease_id):
            self._leases.free(lease.req_id)
        if why == "expired":
            self._stats.record_expiry()
            logger.warning("lease %s (request %s, %d blocks) expired unused after %g s; blocks freed",
                           lease.lease_id[:8], lease.req_id, len(lease.block_ids), self.lease_s)

    def _reap_expired(self) -> None:
        for lease in self._leases.expired():
            self._end_lease(lease, "expired")

    # ---- the lease channel (its threads) -------------------------------------------------
    def _serve(self, request):
        """A consumer's or a router's request on the lease channel (authenticated, its fields
        checked by protocol.py): (reply message or None, payload). ValueError refuses."""
        if isinstance(request, messages.LeaseDescribe):
            handshake = self._registered()
            return messages.LeaseDescribeReply(handshake.descriptor, handshake.fingerprint,
                                               handshake.fingerprint_fields, handshake.sampler,
                                               *self.max_tokens_limits), b""
        if isinstance(request, messages.MigrateTrace):
            return self._trace(request.migration_id, request.wait_s), b""
        if isinstance(request, messages.MigratePrecopy):
            self._registered()
            return self._serve_precopy(request.migration_id)
        if isinstance(request, messages.MigrateEnd):
            self._registered()
            return self._serve_end(request.migration_id)
        if isinstance(request, messages.LeaseAcquire):
            return self._serve_acquire(request.lease, request.hold_s)
        return self._serve_release(request.lease)

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

    def _serve_acquire(self, lease_id: str, hold_s: float):
        with self._lock:
            self._reap_expired()
            lease = self._live_lease(lease_id)
            if hold_s > MAX_HOLD_S:
                raise ValueError(f"hold_s: expected at most {MAX_HOLD_S:g} seconds, got {hold_s!r}")
            if lease.taken:
                raise ValueError(f"lease {lease_id[:8]}: already taken by another pull")
            lease.taken = True  # before waiting: a second acquire is refused meanwhile
            waited = self._granted.wait_for(lambda: lease.granted or not self._leases.is_live(lease),
                                            timeout=GRANT_WAIT_S)
            if not self._leases.is_live(lease):
                raise ValueError(f"lease {lease_id[:8]}: released or expired")
            if not waited:
                lease.taken = False
                raise ValueError(f"lease {lease_id[:8]}: its blocks are not served yet (the producer's worker "
                                 f"did not grant them within {GRANT_WAIT_S:g} s)")
            self._leases.take(lease, hold_s)
            return (messages.LeaseAcquireReply(len(lease.block_ids), lease.num_tokens, lease.prompt_hash,
                                               len(lease.digests)),
                    protocol.encode_ids(lease.block_ids + lease.digests))

    def _serve_release(self, lease_id: str):
        """A pre-copy lease's blocks were its request's throughout unless it was preempted
        meanwhile (its blocks then went back to vLLM, and may hold others' KV)."""
        with self._lock:
            self._reap_expired()
            lease = self._live_lease(lease_id)
            intact = lease.preemptions is None or self._source.preemptions(lease.migration_id) == lease.preemptions
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

    def failed_load_is_unsafe(self) -> bool:
        """Whether a resumed request whose first load failed may have had wrong tokens sent."""
        return self.async_scheduling

    # ---- accounting ----------------------------------------------------------------------
    def get_stats(self) -> Optional[VllmExtStats]:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, VllmExtStats()
        return stats

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
