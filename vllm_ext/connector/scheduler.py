"""The scheduler half of VllmExtConnector (EngineCore process).

Producer: a finished `do_remote_decode` request's blocks stay allocated under a lease (the
engine keeps them until the worker reports the request in finished_sending); the lease's
blocks are described in the returned kv_transfer_params and served to consumers through the
authenticated lease channel (channel.py), which also frees them. A lease that nobody takes
or releases expires after `lease_s`.

Consumer: a request whose kv_transfer_params come from a producer reports the tokens beyond
its local prefix-cache hit as an asynchronous external hit, and hands the worker a RecvJob.

Live migration (source side; vllm_ext/migration/live.py drives it): a request whose
kv_transfer_params carry a `migration_id` is tracked with its block table (from the scheduler
output of every step). A router may ask for pre-copy leases on its complete blocks while it
runs (made on the engine thread, from that step's exact counts), abort the request after the
last one (its blocks stay under that lease), and end the migration. A finished request's blocks
go back to vLLM only when its last lease has ended.

Who calls what (vLLM, on the engine thread unless said otherwise): get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
set_handshake (once at start-up), and the lease channel's threads call _serve.
"""

import collections
import logging
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..lease import messages
from ..lease.channel import LeaseServer
from ..lease.kv_params import (
    ParamsError,
    RemoteKV,
    lease_ref,
    migration_id_of,
    parse_remote_params,
    prompt_hash,
    sampled_tokens_of,
)
from ..migration import protocol
from .metadata import RecvJob, ReleaseJob, VllmExtHandshake, VllmExtMetadata
from .stats import VllmExtStats

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
# The requests with a migration id whose arrival times migrate.trace still knows.
MAX_TRACES = 1024


class Lease:
    """A request's blocks held for consumers (producer side): a finished request's (P/D), or a
    running request's complete blocks (a migration's pre-copy)."""

    __slots__ = ("lease_id", "req_id", "block_ids", "num_tokens", "prompt_hash", "expires_at", "taken", "granted",
                 "token_ids", "num_prompt_tokens", "preemptions", "tracked", "digests", "known_digests")

    def __init__(self, lease_id, req_id, block_ids, num_tokens, prompt_hash_, expires_at, granted,
                 token_ids=None, num_prompt_tokens=0, tracked=None):
        self.lease_id = lease_id
        self.req_id = req_id
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.prompt_hash = prompt_hash_
        self.expires_at = expires_at
        self.taken = False
        self.granted = granted  # the worker's endpoint serves block_ids
        self.token_ids = token_ids or []  # migration leases: the request's tokens so far
        self.num_prompt_tokens = num_prompt_tokens
        self.tracked = tracked  # migration leases: the _Tracked request
        self.digests: List[int] = []  # the blocks' digests, from the worker that serves them
        self.known_digests: List[int] = []  # those of its first blocks, known before it was granted
        # a pre-copy lease of a running request: its preemption count when the lease was made
        self.preemptions = getattr(tracked.request, "num_preemptions", 0) if tracked is not None else None


class _Tracked:
    """A request that carries a migration id (source side): its block table and its leases."""

    __slots__ = ("migration_id", "request", "block_ids", "finished", "leases", "digested")

    def __init__(self, migration_id: str, request, block_ids: List[int]):
        self.migration_id = migration_id
        self.request = request
        self.block_ids = list(block_ids)
        self.finished = False
        self.leases: set = set()  # live lease ids
        # (preemption count, block ids, their digests) of its last granted lease: a complete
        # block's bytes do not change while the request holds it, so a later lease digests
        # only the blocks after these
        self.digested: Tuple[Optional[int], List[int], List[int]] = (None, [], [])


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
        self.failure_policy = failure_policy
        self.whole_blocks = whole_blocks
        self._clock = clock
        # wait_for_grant: the worker reports the leases it serves (update_connector_output) and
        # acquire waits for that; False (releases without worker metadata): served at once
        self.wait_for_grant = wait_for_grant
        # the engine schedules a step before the last one's output is in: a failed load before a
        # request's first step is then unsafe (vLLM has run its next step on the bad blocks)
        self.async_scheduling = async_scheduling
        # (default, cap) of the output limit the instance's OpenAI server applies (0: none), for
        # lease.describe: the router carries them across a move
        self.max_tokens_limits = max_tokens_limits
        self._lock = threading.Lock()  # leases and _finished_sending: engine thread + channel threads
        self._granted = threading.Condition(self._lock)
        self._traced = threading.Condition(self._lock)  # a trace was scheduled, or its load ended
        self._leases: Dict[str, Lease] = {}
        self._by_req: Dict[str, str] = {}
        self._finished_sending: List[str] = []
        self._new_leases: Dict[str, List[int]] = {}  # lease id -> blocks the worker grants
        self._digest_from: Dict[str, int] = {}  # lease id -> blocks whose digests are known (VllmExtMetadata)
        self._ended_leases: List[str] = []  # lease ids whose grants the worker revokes
        self._tracked: Dict[str, _Tracked] = {}  # migration id -> request
        self._tracked_req: Dict[str, str] = {}  # request id -> migration id
        self._precopy_asks: Dict[str, Dict[str, Any]] = {}  # migration id -> {"event", "lease", "error"}
        # migration id -> [arrival, seen, scheduled (time.time()), its load failed] of the
        # requests that carried one lately (migrate.trace); the oldest are forgotten past MAX_TRACES
        self._traces: collections.OrderedDict[str, list] = collections.OrderedDict()
        # request id -> (migration id, blocks) of a load before a resumed request's first step
        # (sync): a failure shows as invalid blocks in that step's output
        self._sync_loads: Dict[str, Tuple[str, set]] = {}
        # migration ids whose sync load's step has not reported yet (the worker's `loaded`): until
        # then their traces are not settled
        self._loading: set = set()
        self._recvs: List[RecvJob] = []
        self._releases: List[ReleaseJob] = []
        self._warned: set = set()
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

    @property
    def lease_address(self) -> Tuple[str, int]:
        assert self._server is not None
        return self._server.host, self._server.port

    # ---- consumer ------------------------------------------------------------------------
    def _remote(self, request) -> Tuple[Optional[Any], Optional[str]]:
        """(RemoteKV, None), (None, why it is refused), or (None, None) when the request has no
        KV to receive."""
        params = request.kv_transfer_params
        if not self.is_consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None, None
        try:
            remote = parse_remote_params(params, self.block_size)
            if self._handshake is not None and remote.fingerprint != self._handshake.fingerprint:
                raise ParamsError(
                    f"kv_transfer_params.remote_fingerprint: {remote.fingerprint} is not this instance's "
                    f"{self._handshake.fingerprint}: the prefill instance's KV cache differs (layout, attention "
                    "backend, dtype, block size, layers or heads); the lease channel handshake names the fields")
            if remote.num_tokens > request.num_tokens:
                raise ParamsError(f"kv_transfer_params.remote_num_tokens: {remote.num_tokens} exceeds this "
                                  f"request's {request.num_tokens} tokens")
            if prompt_hash(request.all_token_ids[:remote.num_tokens]) != remote.prompt_hash:
                raise ParamsError("kv_transfer_params.remote_prompt_hash: the producer's prompt differs from this "
                                  "request's (another tokenizer or chat template?)")
            return remote, None
        except ParamsError as e:
            return None, str(e)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        """The external tokens beyond the (block-aligned) local hit (its only side effect: the
        first look at a request with a migration id is noted for migrate.trace)."""
        self._note_trace(request, scheduled=False)
        remote, error = self._remote(request)
        if error is not None:
            self._warn_once(request.request_id, error)
            if self.failure_policy == "fail" and request.num_tokens - 1 > num_computed_tokens:
                return request.num_tokens - 1 - num_computed_tokens, True  # failed by the worker at once
            return 0, False
        end = self._load_end(request, remote) if remote is not None else 0
        if end <= num_computed_tokens:
            return 0, False
        return end - num_computed_tokens, not remote.sync

    def _load_end(self, request, remote) -> int:
        """Tokens [0, end) come from the producer. With whole_blocks, `end` stops at the last
        block boundary before the request's last token, so that the step after the load starts
        on a block boundary as after a local prefix hit (the rest, < one block, is computed here)."""
        if not self.whole_blocks:
            return remote.num_tokens
        return min(remote.num_tokens, request.num_tokens - 1) // self.block_size * self.block_size

    def update_state_after_alloc(self, request, block_ids: List[int], num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks (local-hit blocks first). vLLM calls it for
        every request it schedules from the waiting queue, also when nothing is loaded (a full
        local hit, nothing beyond it, skip_reading_prefix_cache, refused params): then the
        lease is released at once, so the producer frees its blocks now and not at expiry."""
        try:
            self._allocated(request, block_ids, num_external_tokens)
        finally:  # after a sync load is registered: its trace settles only once that load ended
            self._note_trace(request, scheduled=True)

    def _allocated(self, request, block_ids: List[int], num_external_tokens: int) -> None:
        self._track(request, block_ids)
        remote, error = self._remote(request)
        if remote is None and error is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # once: a preempted request recomputes
        if num_external_tokens <= 0 or error is not None:
            if error is not None and num_external_tokens > 0:
                # the blocks of the external hit get_num_new_matched_tokens reported (policy "fail"):
                # releases without failed_recving (0.26) learn of the failure only from its blocks
                end = request.num_tokens - 1
                first, last = (end - num_external_tokens) // self.block_size, -(-end // self.block_size)
                self._recvs.append(RecvJob(req_id=request.request_id, error=error,
                                           dst_block_ids=list(block_ids[first:last])))
            self._release(request.request_id, request.kv_transfer_params)
            return
        end = self._load_end(request, remote)
        start = end - num_external_tokens
        first, last = start // self.block_size, -(-end // self.block_size)
        mid = migration_id_of(request.kv_transfer_params)
        if remote.sync and mid is not None and self.is_producer:  # its trace (the lease channel's) says if it fails
            with self._lock:
                self._sync_loads[request.request_id] = (mid, set(block_ids[first:last]))
                self._loading.add(mid)
        self._recvs.append(RecvJob(
            req_id=request.request_id, lease=remote.lease, lease_host=remote.lease_host,
            lease_port=remote.lease_port, endpoint_id=remote.endpoint_id, fingerprint=remote.fingerprint,
            first_block=first, src_block_ids=remote.block_ids[first:last], dst_block_ids=list(block_ids[first:last]),
            sync=remote.sync))

    def _track(self, request, block_ids: List[int]) -> None:
        """Follows a request that a router may migrate (a producer that carries a migration id)."""
        if not self.is_producer:
            return
        mid = migration_id_of(request.kv_transfer_params)
        if mid is None:
            return
        with self._lock:
            tracked = self._tracked.get(mid)
            if tracked is not None and tracked.request is not request:
                logger.warning("request %s: migration id %s is already in use here; not migratable", request.request_id,
                               mid[:8])
                return
            if tracked is None:
                self._tracked[mid] = _Tracked(mid, request, block_ids)
                self._tracked_req[request.request_id] = mid
            else:  # resumed after a preemption: a new block table
                tracked.block_ids = list(block_ids)

    def _note_trace(self, request, scheduled: bool) -> None:
        """Notes the time of the scheduler's first look at, or first scheduling of, a request
        that carries a migration id (a resumed one: where its switch went)."""
        if not self.is_producer:
            return
        mid = migration_id_of(request.kv_transfer_params)
        if mid is None:
            return
        now = time.time()
        with self._lock:
            trace = self._traces.get(mid)
            if trace is None:
                arrival = getattr(request, "arrival_time", None)
                trace = self._traces[mid] = [arrival if isinstance(arrival, float) else now, now, 0.0, False]
                while len(self._traces) > MAX_TRACES:
                    self._traces.popitem(last=False)
            if scheduled and not trace[2]:
                trace[2] = now
                self._traced.notify_all()

    def _release(self, req_id: str, params: Any) -> None:
        """A release-only job for the lease named by `params`, when its lease fields are well
        formed (the worker dials only allowed producers)."""
        ref = lease_ref(params)
        if ref is not None:
            self._releases.append(ReleaseJob(req_id=req_id, lease=ref[0], lease_host=ref[1], lease_port=ref[2]))

    def _warn_once(self, req_id: str, error: str) -> None:
        """One log line per refused request (vLLM may ask about a waiting request many times)."""
        if req_id in self._warned:
            return
        if len(self._warned) > 10000:
            self._warned.clear()
        self._warned.add(req_id)
        logger.warning("request %s: refusing its kv_transfer_params (policy %r: %s): %s", req_id,
                       self.failure_policy, "it fails" if self.failure_policy == "fail" else "computed here",
                       error)

    # ---- producer ------------------------------------------------------------------------
    def request_finished(self, request, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        params = request.kv_transfer_params
        if self._sync_loads:
            with self._lock:
                ended = self._sync_loads.pop(request.request_id, None)
                if ended is not None and ended[0] in self._loading:  # its step never reported
                    self._loading.discard(ended[0])
                    self._traced.notify_all()
        if self.is_consumer and isinstance(params, dict) and params.get("do_remote_prefill"):
            # never scheduled (aborted while waiting): nothing will pull its lease
            params["do_remote_prefill"] = False
            self._release(request.request_id, params)
        if self.is_producer and request.request_id in self._tracked_req:
            return self._tracked_finished(request), None
        if not self.is_producer or not isinstance(params, dict) or not params.get("do_remote_decode"):
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
        lease_id = secrets.token_hex(16)
        lease = Lease(lease_id, request.request_id, list(block_ids[:nblocks]), num_tokens,
                      prompt_hash(request.all_token_ids[:num_tokens]), self._clock() + self.lease_s,
                      granted=not self.wait_for_grant)
        with self._lock:
            self._leases[lease_id] = lease
            self._by_req[request.request_id] = lease_id
            self._new_leases[lease_id] = lease.block_ids
        desc = self._handshake.descriptor
        host, port = self.lease_address
        return True, RemoteKV(
            lease=lease_id, block_ids=lease.block_ids, num_tokens=num_tokens, prompt_hash=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, lease_host=host, lease_port=port,
            endpoint_id=desc["endpoint_id"], backend=desc["backend"], lease_s=self.lease_s).to_params()

    def _tracked_finished(self, request) -> bool:
        """A migratable request ended (the router's abort after its last lease, or its own end):
        True keeps its blocks until its leases end."""
        with self._lock:
            tracked = self._tracked[self._tracked_req[request.request_id]]
            tracked.finished = True
            if tracked.leases:
                return True
            self._untrack(tracked)
            return False

    def _add_lease(self, request, block_ids: List[int], num_tokens: int, tokens: List[int],
                   tracked: "_Tracked") -> Lease:
        """With self._lock held: a migration lease, granted by the worker at the next step."""
        lease = Lease(secrets.token_hex(16), request.request_id, block_ids, num_tokens,
                      prompt_hash(tokens[:num_tokens]), self._clock() + self.lease_s, granted=not self.wait_for_grant,
                      token_ids=tokens, num_prompt_tokens=request.num_prompt_tokens, tracked=tracked)
        self._leases[lease.lease_id] = lease
        self._new_leases[lease.lease_id] = block_ids
        tracked.leases.add(lease.lease_id)
        at, blocks, digests = tracked.digested
        if at is not None and at == lease.preemptions:
            k = 0
            while k < min(len(blocks), len(block_ids)) and blocks[k] == block_ids[k]:
                k += 1
            if k:
                lease.known_digests = digests[:k]
                self._digest_from[lease.lease_id] = k
        return lease

    def _untrack(self, tracked: "_Tracked") -> None:
        self._tracked.pop(tracked.migration_id, None)
        self._tracked_req.pop(tracked.request.request_id, None)

    def _end_lease(self, lease: Lease, why: str) -> None:
        """With self._lock held: the lease's blocks go back to the engine at the next step
        (a migration lease's: once its request finished and its last lease ended)."""
        del self._leases[lease.lease_id]
        self._ended_leases.append(lease.lease_id)
        self._granted.notify_all()
        tracked = lease.tracked
        if tracked is not None:
            tracked.leases.discard(lease.lease_id)
            if tracked.finished and not tracked.leases:
                self._finished_sending.append(lease.req_id)
                self._untrack(tracked)
        else:
            self._by_req.pop(lease.req_id, None)
            self._finished_sending.append(lease.req_id)
        if why == "expired":
            self._stats.record_expiry()
            logger.warning("lease %s (request %s, %d blocks) expired unused after %g s; blocks freed",
                           lease.lease_id[:8], lease.req_id, len(lease.block_ids), self.lease_s)

    def _reap_expired(self) -> None:
        now = self._clock()
        with self._lock:
            for lease in [x for x in self._leases.values() if x.expires_at <= now]:
                self._end_lease(lease, "expired")

    def _serve(self, request):
        """A consumer's request on the lease channel (authenticated, its fields checked by
        protocol.py): (reply message or None, payload). ValueError refuses."""
        if isinstance(request, messages.LeaseDescribe):
            if self._handshake is None:
                raise ValueError("this instance's worker has not registered its KV cache yet")
            return messages.LeaseDescribeReply(self._handshake.descriptor, self._handshake.fingerprint,
                                               self._handshake.fingerprint_fields, self._handshake.sampler,
                                               *self.max_tokens_limits), b""
        if isinstance(request, (messages.MigratePrecopy, messages.MigrateEnd)):
            return self._serve_migration(request)
        if isinstance(request, messages.MigrateTrace):
            return self._trace(request.migration_id, request.wait_s), b""
        lease_id = request.lease
        self._reap_expired()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise ValueError(f"lease {lease_id[:8]}: unknown, released or expired")
            if isinstance(request, messages.LeaseAcquire):
                if request.hold_s > MAX_HOLD_S:
                    raise ValueError(f"hold_s: expected at most {MAX_HOLD_S:g} seconds, got {request.hold_s!r}")
                if lease.taken:
                    raise ValueError(f"lease {lease_id[:8]}: already taken by another pull")
                lease.taken = True  # before waiting: a second acquire is refused meanwhile
                waited = self._granted.wait_for(lambda: lease.granted or lease.lease_id not in self._leases,
                                                timeout=GRANT_WAIT_S)
                if lease.lease_id not in self._leases:
                    raise ValueError(f"lease {lease_id[:8]}: released or expired")
                if not waited:
                    lease.taken = False
                    raise ValueError(f"lease {lease_id[:8]}: its blocks are not served yet (the producer's worker "
                                     f"did not grant them within {GRANT_WAIT_S:g} s)")
                lease.expires_at = max(lease.expires_at, self._clock() + request.hold_s)
                return (messages.LeaseAcquireReply(len(lease.block_ids), lease.num_tokens, lease.prompt_hash,
                                                   len(lease.digests)),
                        protocol.encode_ids(lease.block_ids + lease.digests))
            # LeaseRelease: a pre-copy lease's blocks were its request's throughout unless it was
            # preempted meanwhile (its blocks then went back to vLLM, and may hold others' KV)
            intact = lease.preemptions is None or (
                getattr(lease.tracked.request, "num_preemptions", 0) == lease.preemptions)
            self._end_lease(lease, "released")
            return messages.LeaseReleaseReply(intact), b""

    # ---- live migration (the lease channel's threads) -----------------------------------
    def _lease_reply(self, lease: Lease):
        desc = self._handshake.descriptor
        reply = messages.MigrateLeaseReply(
            lease=lease.lease_id, n=len(lease.block_ids), num_tokens=lease.num_tokens, n_tokens=len(lease.token_ids),
            num_prompt_tokens=lease.num_prompt_tokens, block_size=self.block_size, prompt_hash=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, endpoint_id=desc["endpoint_id"], backend=desc["backend"],
            lease_s=float(self.lease_s))
        return reply, protocol.encode_ids(lease.block_ids + lease.token_ids)

    def _serve_migration(self, request):
        mid = request.migration_id
        if self._handshake is None:
            raise ValueError("this instance's worker has not registered its KV cache yet")
        self._reap_expired()
        if isinstance(request, messages.MigratePrecopy):
            ask = {"event": threading.Event(), "lease": None, "error": None}
            with self._lock:
                if mid not in self._tracked:
                    raise messages.RequestEnded(f"migration {mid[:8]}: no running request of this instance carries it")
                self._precopy_asks[mid] = ask
            if not ask["event"].wait(PRECOPY_WAIT_S):
                with self._lock:
                    self._precopy_asks.pop(mid, None)
                raise ValueError(f"migration {mid[:8]}: the engine took no step in {PRECOPY_WAIT_S:g} s")
            if ask["error"] is not None:  # the refusal, of its kind (RequestEnded: the router lets it finish)
                raise type(ask["error"])(f"migration {mid[:8]}: {ask['error']}")
            lease = ask["lease"]
            with self._lock:  # ended meanwhile: the consumer's acquire is refused as for any ended lease
                self._granted.wait_for(lambda: lease.granted or lease.lease_id not in self._leases,
                                       timeout=PRECOPY_GRANT_WAIT_S)
                return self._lease_reply(lease)
        # MigrateEnd: leases not taken end now; a taken one ends at its consumer's release (or at
        # the end of the hold its acquire asked for): never under a pull
        with self._lock:
            tracked = self._tracked.get(mid)
            if tracked is not None:
                for lease_id in list(tracked.leases):
                    if not self._leases[lease_id].taken:
                        self._end_lease(self._leases[lease_id], "released")
            return None, b""

    def _precopy(self, scheduler_output) -> None:
        """Engine thread: the pre-copy leases asked since the last step, from this step's counts:
        only complete blocks of tokens computed before this step (under asynchronous scheduling
        one more step may still be writing: it is left out too)."""
        from vllm.v1.request import RequestStatus

        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) if scheduler_output is not None else {}
        with self._lock:
            asks, self._precopy_asks = self._precopy_asks, {}
            for mid, ask in asks.items():
                tracked = self._tracked.get(mid)
                request = tracked.request if tracked is not None else None
                if request is None or tracked.finished or RequestStatus.is_finished(request.status):
                    ask["error"] = messages.RequestEnded("the request ended here")
                elif request.status != RequestStatus.RUNNING:
                    ask["error"] = ValueError("the request is not running here (preempted)")
                else:
                    valid = request.num_computed_tokens - scheduled.get(request.request_id, 0) - 1
                    nblocks = min(max(valid, 0) // self.block_size, len(tracked.block_ids))
                    if nblocks == 0:
                        ask["error"] = ValueError("the request has no complete block yet")
                    else:
                        ask["lease"] = self._add_lease(request, tracked.block_ids[:nblocks], nblocks * self.block_size,
                                                       list(request.all_token_ids), tracked)
                ask["event"].set()

    def _follow_blocks(self, scheduler_output) -> None:
        """Engine thread: the tracked requests' block tables after this step's allocation."""
        if scheduler_output is None or not self._tracked_req:
            return
        with self._lock:
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
                mid = self._tracked_req.get(new.req_id)
                if mid is not None:
                    self._tracked[mid].block_ids = list(new.block_ids[0])
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            if cached is None:
                return
            resumed = getattr(cached, "resumed_req_ids", None)
            if resumed is None:  # releases with a per-request flag
                flags = getattr(cached, "resumed_from_preemption", [])
                resumed = {r for r, f in zip(cached.req_ids, flags) if f}
            for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
                mid = self._tracked_req.get(req_id)
                if mid is None or new_ids is None:
                    continue
                tracked = self._tracked[mid]
                if req_id in resumed:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])

    def _skip_draws(self, scheduler_output) -> Dict[str, int]:
        """Engine thread: the seeded requests first scheduled in this step that were resumed
        here with `sampled_tokens` (their random stream skips those tokens' draws)."""
        if not self.is_consumer or scheduler_output is None:
            return {}
        from vllm.sampling_params import SamplingType

        skips = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            sampling = new.sampling_params
            if sampling is None or sampling.sampling_type != SamplingType.RANDOM_SEED:
                continue
            params = (sampling.extra_args or {}).get("kv_transfer_params")
            try:
                n = sampled_tokens_of(params, len(new.prompt_token_ids or ()))
            except ParamsError as e:
                logger.warning("request %s: %s: its seeded random stream restarts here", new.req_id, e)
                continue
            if n:
                skips[new.req_id] = n
        return skips

    # ---- every step ----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output=None) -> VllmExtMetadata:
        if self.is_producer:
            self._reap_expired()
            self._follow_blocks(scheduler_output)
            if self._precopy_asks:
                self._precopy(scheduler_output)
        skips = self._skip_draws(scheduler_output)
        with self._lock:
            meta = VllmExtMetadata(recvs=self._recvs, releases=self._releases, new_leases=self._new_leases,
                                   digest_from=self._digest_from, ended_leases=self._ended_leases,
                                   finished_sending=self._finished_sending, skip_draws=skips)
            self._new_leases, self._digest_from, self._ended_leases, self._finished_sending = {}, {}, [], []
        self._recvs, self._releases = [], []
        return meta

    def _trace(self, mid: str, wait_s: float) -> messages.MigrateTraceReply:
        """The trace of the request carrying `mid`, once settled or after `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                trace = self._traces.get(mid)
                settled = trace is not None and bool(trace[2]) and mid not in self._loading
                left = deadline - time.monotonic()
                if settled or left <= 0 or (trace is not None and trace[2] and not self.wait_for_grant):
                    break  # (the last: no worker metadata, no load reports, so a load never settles)
                self._traced.wait(left)
            if trace is None or not trace[2]:
                raise ValueError(f"migration {mid[:8]}: no request here carried it lately, or it is not scheduled "
                                 "yet")
            return messages.MigrateTraceReply(*trace[:3], unsafe=trace[3] and self.failed_load_is_unsafe(),
                                              settled=settled, load_failed=trace[3])

    def failed_load_is_unsafe(self) -> bool:
        """Whether a resumed request whose first load failed may have had wrong tokens sent."""
        return self.async_scheduling

    def update_connector_output(self, output) -> None:
        """The step's worker output: the leases whose blocks the worker now serves, and the
        blocks of loads that failed (a resumed request's: its trace says so)."""
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid and self._sync_loads:
            with self._lock:
                for mid, blocks in self._sync_loads.values():
                    trace = self._traces.get(mid)
                    if trace is not None and not blocks.isdisjoint(invalid):
                        trace[3] = True
        meta = getattr(output, "kv_connector_worker_meta", None)
        loaded = getattr(meta, "loaded", None)
        if loaded and self._sync_loads:
            with self._lock:
                for req_id in loaded:
                    ended = self._sync_loads.get(req_id)
                    if ended is not None:
                        self._loading.discard(ended[0])
                self._traced.notify_all()
        granted = getattr(meta, "granted", None)
        if not granted:
            return
        digests = getattr(meta, "digests", None) or {}
        with self._lock:
            for lease_id in granted:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.granted = True
                    found = digests.get(lease_id)
                    if found is not None and len(lease.known_digests) + len(found) == len(lease.block_ids):
                        lease.digests = lease.known_digests + list(found)
                        if lease.tracked is not None:
                            lease.tracked.digested = (lease.preemptions, lease.block_ids, lease.digests)
            self._granted.notify_all()

    def has_pending_frees(self) -> bool:
        """Leases ended whose blocks go back at the next step (live leases are not counted: a
        scheduler short of blocks preempts rather than waits up to lease_s for them)."""
        with self._lock:
            return bool(self._finished_sending)

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
