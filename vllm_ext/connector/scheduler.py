"""The scheduler half of VllmExtConnector (EngineCore process).

Producer: a finished `do_remote_decode` request's blocks stay allocated under a lease (the
engine keeps them until the worker reports the request in finished_sending); the lease's
blocks are described in the returned kv_transfer_params and served to consumers through the
authenticated lease channel (channel.py), which also frees them. A lease that nobody takes
or releases expires after `lease_s`.

Consumer: a request whose kv_transfer_params come from a producer reports the tokens beyond
its local prefix-cache hit as an asynchronous external hit, and hands the worker a RecvJob.

Who calls what (vLLM, on the engine thread unless said otherwise): get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
set_handshake (once at start-up), and the lease channel's threads call _serve.
"""

import logging
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..migration import protocol
from .channel import LeaseServer
from .metadata import RecvJob, ReleaseJob, VllmExtHandshake, VllmExtMetadata
from .protocol import ParamsError, lease_ref, parse_remote_params, producer_params, prompt_hash
from .stats import VllmExtStats

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# A consumer's acquire may extend a lease by at most this much beyond its remaining time (the
# pull's deadline): a lease is never freed under a pull in progress, nor held forever.
MAX_HOLD_S = 900.0  # a pull's deadline is at most 600 s (pull_timeout_s)
# An acquire waits at most this long for the producer's worker to serve the lease's blocks (it
# grants them in the engine step after the lease is made: milliseconds).
GRANT_WAIT_S = 3.0


class Lease:
    """A finished request's blocks held for consumers (producer side)."""

    __slots__ = ("lease_id", "req_id", "block_ids", "num_tokens", "prompt_hash", "expires_at", "taken", "granted")

    def __init__(self, lease_id, req_id, block_ids, num_tokens, prompt_hash_, expires_at, granted):
        self.lease_id = lease_id
        self.req_id = req_id
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.prompt_hash = prompt_hash_
        self.expires_at = expires_at
        self.taken = False
        self.granted = granted  # the worker's endpoint serves block_ids


class SchedulerHalf:
    """Args are values: the roles, the engine's block size, the lease settings, the
    deployment secret and `kv_load_failure_policy` ("fail" or "recompute")."""

    def __init__(self, *, is_producer: bool, is_consumer: bool, block_size: int, lease_s: float,
                 lease_host: str, lease_port: int, secret: bytes, failure_policy: str,
                 whole_blocks: bool = False, clock: Callable[[], float] = time.monotonic,
                 wait_for_grant: bool = True):
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
        self._lock = threading.Lock()  # leases and _finished_sending: engine thread + channel threads
        self._granted = threading.Condition(self._lock)
        self._leases: Dict[str, Lease] = {}
        self._by_req: Dict[str, str] = {}
        self._finished_sending: List[str] = []
        self._new_leases: Dict[str, List[int]] = {}
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
        """Side-effect free: the external tokens beyond the (block-aligned) local hit."""
        remote, error = self._remote(request)
        if error is not None:
            self._warn_once(request.request_id, error)
            if self.failure_policy == "fail" and request.num_tokens - 1 > num_computed_tokens:
                return request.num_tokens - 1 - num_computed_tokens, True  # failed by the worker at once
            return 0, False
        end = self._load_end(request, remote) if remote is not None else 0
        if end <= num_computed_tokens:
            return 0, False
        return end - num_computed_tokens, True

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
        remote, error = self._remote(request)
        if remote is None and error is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # once: a preempted request recomputes
        if num_external_tokens <= 0 or error is not None:
            if error is not None and num_external_tokens > 0:
                self._recvs.append(RecvJob(req_id=request.request_id, error=error))
            self._release(request.request_id, request.kv_transfer_params)
            return
        end = self._load_end(request, remote)
        start = end - num_external_tokens
        first, last = start // self.block_size, -(-end // self.block_size)
        self._recvs.append(RecvJob(
            req_id=request.request_id, lease=remote.lease, lease_host=remote.lease_host,
            lease_port=remote.lease_port, endpoint_id=remote.endpoint_id, fingerprint=remote.fingerprint,
            first_block=first, src_block_ids=remote.block_ids[first:last], dst_block_ids=list(block_ids[first:last])))

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
        if self.is_consumer and isinstance(params, dict) and params.get("do_remote_prefill"):
            # never scheduled (aborted while waiting): nothing will pull its lease
            params["do_remote_prefill"] = False
            self._release(request.request_id, params)
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
            self._new_leases[request.request_id] = lease.block_ids
        desc = self._handshake.descriptor
        host, port = self.lease_address
        return True, producer_params(
            lease=lease_id, block_ids=lease.block_ids, num_tokens=num_tokens, prompt_hash_=lease.prompt_hash,
            fingerprint=self._handshake.fingerprint, lease_host=host, lease_port=port,
            endpoint_id=desc["endpoint_id"], backend=desc["backend"], lease_s=self.lease_s)

    def _end_lease(self, lease: Lease, why: str) -> None:
        """With self._lock held: the lease's blocks go back to the engine at the next step."""
        del self._leases[lease.lease_id]
        self._by_req.pop(lease.req_id, None)
        self._granted.notify_all()
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
        if isinstance(request, protocol.LeaseDescribe):
            if self._handshake is None:
                raise ValueError("this instance's worker has not registered its KV cache yet")
            return protocol.LeaseDescribeReply(self._handshake.descriptor, self._handshake.fingerprint,
                                               self._handshake.fingerprint_fields), b""
        lease_id = request.lease
        self._reap_expired()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise ValueError(f"lease {lease_id[:8]}: unknown, released or expired")
            if isinstance(request, protocol.LeaseAcquire):
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
                return (protocol.LeaseAcquireReply(len(lease.block_ids), lease.num_tokens, lease.prompt_hash),
                        protocol.encode_ids(lease.block_ids))
            self._end_lease(lease, "released")  # LeaseRelease
            return None, b""

    # ---- every step ----------------------------------------------------------------------
    def build_connector_meta(self) -> VllmExtMetadata:
        if self.is_producer:
            self._reap_expired()
        with self._lock:
            meta = VllmExtMetadata(recvs=self._recvs, releases=self._releases, new_leases=self._new_leases,
                                   finished_sending=self._finished_sending)
            self._new_leases, self._finished_sending = {}, []
        self._recvs, self._releases = [], []
        return meta

    def update_connector_output(self, output) -> None:
        """The step's worker output: the leases whose blocks the worker now serves."""
        granted = getattr(getattr(output, "kv_connector_worker_meta", None), "granted", None)
        if not granted:
            return
        with self._lock:
            for req_id in granted:
                lease = self._leases.get(self._by_req.get(req_id, ""))
                if lease is not None:
                    lease.granted = True
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
