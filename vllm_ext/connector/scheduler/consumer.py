"""The consumer's admission of remote KV (engine thread only): a request whose
kv_transfer_params come from a producer reports the tokens beyond its local prefix-cache hit as an
external hit, loaded asynchronously or inside the step that schedules it (`loads_sync`, the rule
below), and hands the worker a RecvJob; a lease it will not pull, a ReleaseJob. A seeded request
resumed here with `sampled_tokens` has its random stream skip those tokens' draws (skip_draws).

Sync or async (`kv_connector_extra_config.load`, default "auto"): a sync load runs in the worker
before the forward of the step that schedules the request, so the request decodes in that step;
an asynchronous one waits in WAITING_FOR_REMOTE_KVS while the next steps run, and is scheduled
once a later step saw it received (two or more steps later). A sync load holds the whole step
(every running request waits for it, up to `sync_load_timeout_s`), and a failed one is recomputed
in place from its invalid blocks, which is safe only when vLLM learns of it before it runs the
request's next step: an engine that schedules one step at a time, or policy "fail" (the request
ends with vLLM's failed-load error and no token; the P/D proxy asks again without remote KV). So:
- `sync_load` in the params (a live migration's resume): sync, whatever the setting (the router
  checks the resume's trace for an unsafe failed load);
- "async": asynchronous; "sync": sync (refused at start-up where a failure is unsafe);
- "auto": sync when the producer's backend is ipc (its cache in this host's device memory: the
  pull is one copy kernel of milliseconds) and a failure is safe; otherwise asynchronous: gloo
  (a CPU source served by Python, whose pull may run up to its patience past the deadline while
  it makes progress), nccl (maybe across hosts), rayrpc, and any engine that schedules
  asynchronously under policy "recompute" (a GPU's default: use --no-async-scheduling on D, or
  policy "fail" behind the proxy, for the sync path).

The params come from the client, so their prompt hash proves nothing: the RecvJob carries the
hash of the request's own first `remote_num_tokens` tokens, and the worker refuses a lease whose
acquire says it holds other tokens, before any pull (docs/security.md)."""

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...lease.kv_params import ParamsError, RemoteKV, lease_ref, parse_remote_params, prompt_hash, sampled_tokens_of
from ..groups import NULL_BLOCK, ONE, Groups, pairs
from ..metadata import RecvJob, ReleaseJob
from ..settings import LOAD_MODES

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# Refused requests remembered for one log line each (vLLM may ask about a waiting request many times).
MAX_WARNED = 10000
# Producer backends whose pull "auto" runs inside the step: the producer's cache is mapped from this
# host's device memory, so the pull is a local copy bounded by the blocks' size.
SYNC_BACKENDS = ("ipc",)


def loads_sync(load: str, asked: bool, backend: str, safe: bool) -> bool:
    """The rule (module docstring): whether a request loads inside the step that schedules it.
    `load`: the setting; `asked`: its params carry `sync_load`; `backend`: the producer's;
    `safe`: a failed load is recomputed (or failed) before any of its tokens leaves."""
    if asked or load == "sync":
        return True
    return load == "auto" and backend in SYNC_BACKENDS and safe


def failed_sync_load_is_safe(failure_policy: str, async_scheduling: bool) -> bool:
    """Whether vLLM learns of a failed sync load before a token of it leaves: an engine that
    schedules one step at a time, or policy "fail" (the request ends with no token)."""
    return not async_scheduling or failure_policy == "fail"


class Consumer:
    """Args are values: the engine's block size, `kv_load_failure_policy` ("fail" or
    "recompute"), whether loads stop at the last whole block before a request's last token, the
    `load` setting, whether the engine schedules asynchronously and its KV cache groups (block
    ids interleave them: groups.py). `fingerprint`: this instance's KV cache layout, once its
    worker registered it. ValueError for `load` "sync" where a failed load is unsafe."""

    def __init__(self, *, block_size: int, failure_policy: str, whole_blocks: bool, load: str = "auto",
                 async_scheduling: bool = False, groups: Groups = ONE):
        if load not in LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config.load: expected one of {', '.join(LOAD_MODES)}, got {load!r}")
        self.block_size = block_size
        self.failure_policy = failure_policy
        self.whole_blocks = whole_blocks
        self.load = load
        self.groups = groups
        self.sync_safe = failed_sync_load_is_safe(failure_policy, async_scheduling)
        if load == "sync" and not self.sync_safe:
            raise ValueError('VllmExtConnector: kv_connector_extra_config.load "sync" with asynchronous scheduling and '
                             'kv_load_failure_policy "recompute": vLLM would run the request\'s next step on the KV '
                             "of a failed load and send its token. Start this instance with --no-async-scheduling, "
                             'or set kv_load_failure_policy "fail" (behind the P/D proxy, which asks again without '
                             'remote KV), or load "auto"')
        self.fingerprint: Optional[str] = None
        self._recvs: List[RecvJob] = []
        self._releases: List[ReleaseJob] = []
        self._warned: set = set()

    def remote(self, request) -> Tuple[Optional[RemoteKV], Optional[str]]:
        """(RemoteKV, None), (None, why it is refused), or (None, None) when the request has no
        KV to receive."""
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None, None
        try:
            remote = parse_remote_params(params, self.block_size, self.groups.count)
            if self.fingerprint is not None and remote.fingerprint != self.fingerprint:
                raise ParamsError(
                    f"kv_transfer_params.remote_fingerprint: {remote.fingerprint} is not this instance's "
                    f"{self.fingerprint}: the prefill instance's KV cache differs (layout, attention "
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

    def matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        """The external tokens beyond the (block-aligned) local hit, and whether they load
        asynchronously (vLLM's get_num_new_matched_tokens; no side effect but one log line)."""
        remote, error = self.remote(request)
        if error is not None:
            self._warn_once(request.request_id, error)
            if self.failure_policy == "fail" and request.num_tokens - 1 > num_computed_tokens:
                # failed by the worker at once, as the load may_load_async says it is
                return request.num_tokens - 1 - num_computed_tokens, self.may_load_async(request.kv_transfer_params)
            return 0, False
        end = self._load_end(request, remote) if remote is not None else 0
        if end <= num_computed_tokens:
            return 0, False
        return end - num_computed_tokens, not self.is_sync(remote)

    def is_sync(self, remote: RemoteKV) -> bool:
        """Whether `remote` loads inside the step that schedules its request (loads_sync)."""
        return loads_sync(self.load, remote.sync, remote.backend, self.sync_safe)

    def may_load_async(self, params: Any) -> bool:
        """vLLM 0.34's may_load_async: False only for a request whose load (if any) is sync by
        the rule, read from its raw params (a request whose params are refused may fail its
        "load" asynchronously: True). Agrees with matched_tokens."""
        if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
            return False
        endpoint = params.get("remote_endpoint")
        backend = endpoint.get("backend") if isinstance(endpoint, Mapping) else ""
        asked = params.get("sync_load", False)
        if not isinstance(asked, bool):
            return True  # refused by name: failed at once, as an asynchronous load
        return not loads_sync(self.load, asked, backend if isinstance(backend, str) else "", self.sync_safe)

    def _load_end(self, request, remote: RemoteKV) -> int:
        """Tokens [0, end) come from the producer. With whole_blocks, `end` stops at the last
        block boundary before the request's last token, so that the step after the load starts
        on a block boundary as after a local prefix hit (the rest, < one block, is computed here).
        A sync load stops before the last token in any case: the step that loads it computes
        that token (vLLM schedules at least one; an asynchronous load's end is moved back by vLLM)."""
        if not self.whole_blocks:
            return min(remote.num_tokens, request.num_tokens - 1) if self.is_sync(remote) else remote.num_tokens
        return min(remote.num_tokens, request.num_tokens - 1) // self.block_size * self.block_size

    def allocated(self, request, block_ids: List[int], num_external_tokens: int) -> Optional[RecvJob]:
        """vLLM allocated the request's blocks (`block_ids`: all of them, local-hit blocks
        first; the groups interleaved): the receive it needs, if any (also returned). It is called
        for every request scheduled from the waiting queue, also when nothing is loaded (a full
        local hit, nothing beyond it, skip_reading_prefix_cache, refused params): then the lease is
        released at once, so the producer frees its blocks now and not at expiry."""
        remote, error = self.remote(request)
        if remote is None and error is None:
            return None
        asynchronous = self.may_load_async(request.kv_transfer_params)  # a refused load fails as this
        request.kv_transfer_params["do_remote_prefill"] = False  # once: a preempted request recomputes
        if num_external_tokens <= 0 or error is not None:
            if error is not None and num_external_tokens > 0:
                # the blocks of the external hit get_num_new_matched_tokens reported (policy "fail"):
                # releases without failed_recving (0.26) learn of the failure only from its blocks
                end = request.num_tokens - 1
                first, last = (end - num_external_tokens) // self.block_size, -(-end // self.block_size)
                return self._failed(request, error, not asynchronous, self._blocks(block_ids, first, last))
            self.release(request.request_id, request.kv_transfer_params)
            return None
        end = self._load_end(request, remote)
        start = end - num_external_tokens
        first, last = start // self.block_size, -(-end // self.block_size)
        g = self.groups.count
        try:
            src, dst, index = pairs(remote.block_ids[first * g:last * g], block_ids[first * g:last * g], first * g,
                                    self.groups.windowed)
        except ValueError as e:
            return self._failed(request, str(e), self.is_sync(remote), self._blocks(block_ids, first, last))
        job = RecvJob(
            req_id=request.request_id, lease=remote.lease, lease_host=remote.lease_host,
            lease_port=remote.lease_port, endpoint_id=remote.endpoint_id, fingerprint=remote.fingerprint,
            first_block=first * g, lease_index=index, num_tokens=remote.num_tokens,
            prompt_hash=prompt_hash(request.all_token_ids[:remote.num_tokens]),  # the worker checks the lease's
            src_block_ids=src, dst_block_ids=dst, sync=self.is_sync(remote))
        self._recvs.append(job)
        return job

    def _failed(self, request, error: str, sync: bool, dst_block_ids: List[int]) -> RecvJob:
        """A receive the worker fails at once (its blocks `dst_block_ids` invalid), its lease released."""
        job = RecvJob(req_id=request.request_id, error=error, sync=sync, dst_block_ids=dst_block_ids)
        self._recvs.append(job)
        self.release(request.request_id, request.kv_transfer_params)
        return job

    def _blocks(self, block_ids: List[int], first: int, last: int) -> List[int]:
        """This instance's blocks of positions [first, last), every group's (nulls left out)."""
        g = self.groups.count
        return [b for b in block_ids[first * g:last * g] if not self.groups.windowed or b != NULL_BLOCK]

    def request_finished(self, request) -> None:
        """A request never scheduled (aborted while waiting): nothing will pull its lease."""
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            self.release(request.request_id, params)

    def release(self, req_id: str, params: Any) -> None:
        """A release-only job for the lease named by `params`, when its lease fields are well
        formed (the worker dials only allowed producers)."""
        ref = lease_ref(params)
        if ref is not None:
            self._releases.append(ReleaseJob(req_id=req_id, lease=ref[0], lease_host=ref[1], lease_port=ref[2]))

    def take_jobs(self) -> Tuple[List[RecvJob], List[ReleaseJob]]:
        jobs = self._recvs, self._releases
        self._recvs, self._releases = [], []
        return jobs

    def _warn_once(self, req_id: str, error: str) -> None:
        """One log line per refused request."""
        if req_id in self._warned:
            return
        if len(self._warned) > MAX_WARNED:
            self._warned.clear()
        self._warned.add(req_id)
        logger.warning("request %s: refusing its kv_transfer_params (policy %r: %s): %s", req_id,
                       self.failure_policy, "it fails" if self.failure_policy == "fail" else "computed here",
                       error)


def skip_draws(scheduler_output) -> Dict[str, int]:
    """The seeded requests first scheduled in this step that were resumed here with
    `sampled_tokens` (their random stream skips those tokens' draws)."""
    if scheduler_output is None:
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
