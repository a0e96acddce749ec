"""A consumer's scheduler half (scheduler/consumer.py), against vLLM 0.32's Request: external
tokens after the local hit, whole-block loads, sync loads, bad kv_transfer_params field by field
(failing that request only), and the release of a lease it does not pull."""

import pytest

from tests.connector.halves import (
    BLOCK_SIZE,
    PROMPT_LENGTHS,
    SECRET,
    finish_prefill,
    good_params,
    make_request,
    make_scheduler,
    make_worker,
    released,
    step,
    vllm_layers,
)
from vllm_ext.connector.scheduler import SchedulerHalf
from vllm_ext.lease.kv_params import prompt_hash


@pytest.fixture
def consumer_sched():
    sched = make_scheduler(False)
    yield sched
    sched.shutdown()


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
@pytest.mark.parametrize("local_hit", [0, 16])
def test_consumer_counts_external_tokens_after_the_local_hit(producer, consumer_sched, n, local_hit):
    sched, worker = producer
    consumer_sched.set_handshake({0: worker.handshake()})  # same fingerprint as the producer
    prompt = list(range(7, 7 + n))
    _, params = finish_prefill(sched, prompt)
    req = make_request(prompt, params, req_id="d-0")
    local_hit = min(local_hit, (n // BLOCK_SIZE) * BLOCK_SIZE)
    for _ in range(2):  # side-effect free: same answer when asked again
        assert consumer_sched.get_num_new_matched_tokens(req, local_hit) == \
            ((n - local_hit, True) if n > local_hit else (0, False))
    if n <= local_hit:
        return
    dst = list(range(40, 40 + -(-n // BLOCK_SIZE)))
    consumer_sched.update_state_after_alloc(req, dst, n - local_hit)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # a preempted request recomputes
    (job,) = consumer_sched.build_connector_meta().recvs
    first = local_hit // BLOCK_SIZE
    assert job.src_block_ids == params["remote_block_ids"][first:] and job.dst_block_ids == dst[first:]
    assert job.first_block == first and job.lease == params["remote_lease"] and job.error is None
    assert consumer_sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_kv_transfer_params_may_carry_what_vllm_adds():
    from vllm_ext.lease.kv_params import RemoteKV

    params = dict(good_params(), remote_prefill_cached_tokens=0)  # vLLM's scheduler adds it
    assert RemoteKV.parse(params, BLOCK_SIZE).block_ids == [4, 5, 6]


def _without(key):
    def edit(p):
        if "." in key:
            outer, inner = key.split(".")
            del p[outer][inner]
        else:
            del p[key]
    return edit


def _set(key, value):
    def edit(p):
        if "." in key:
            outer, inner = key.split(".")
            p[outer][inner] = value
        else:
            p[key] = value
    return edit


BAD_PARAMS = [
    (_without("vllm_ext"), "kv_transfer_params.vllm_ext: missing"),
    (_set("vllm_ext", 99), "kv_transfer_params.vllm_ext: protocol 99"),
    (_without("remote_lease"), "kv_transfer_params.remote_lease: missing"),
    (_set("remote_lease", 7), "kv_transfer_params.remote_lease: expected str"),
    (_set("remote_lease", "xyz"), "kv_transfer_params.remote_lease: expected 32 hex digits"),
    (_without("remote_block_ids"), "kv_transfer_params.remote_block_ids: missing"),
    (_set("remote_block_ids", "4,5,6"), "kv_transfer_params.remote_block_ids: expected list"),
    (_set("remote_block_ids", [4, "5", 6]), r"kv_transfer_params.remote_block_ids\[1\]: expected a non-negative int"),
    (_set("remote_block_ids", [4, -5, 6]), r"kv_transfer_params.remote_block_ids\[1\]"),
    (_set("remote_block_ids", []), "kv_transfer_params.remote_block_ids: expected 1 to"),
    (_without("remote_num_tokens"), "kv_transfer_params.remote_num_tokens: missing"),
    (_set("remote_num_tokens", 40.0), "kv_transfer_params.remote_num_tokens: expected int"),
    (_set("remote_num_tokens", 70), "kv_transfer_params.remote_num_tokens: 70 tokens need 5 blocks"),
    (_without("remote_prompt_hash"), "kv_transfer_params.remote_prompt_hash: missing"),
    (_set("remote_prompt_hash", prompt_hash(range(1, 41))), "remote_prompt_hash: the producer's prompt differs"),
    (_without("remote_fingerprint"), "kv_transfer_params.remote_fingerprint: missing"),
    (_set("remote_fingerprint", "00" * 16), "remote_fingerprint: 0000"),
    (_without("remote_endpoint"), "kv_transfer_params.remote_endpoint: missing"),
    (_set("remote_endpoint", ["127.0.0.1", 9]), "kv_transfer_params.remote_endpoint: expected dict"),
    (_without("remote_endpoint.lease_host"), "remote_endpoint.lease_host: missing"),
    (_set("remote_endpoint.lease_port", "9"), "remote_endpoint.lease_port: expected int"),
    (_set("remote_endpoint.lease_port", 70000), "remote_endpoint.lease_port: 70000 is not a TCP port"),
    (_without("remote_endpoint.endpoint_id"), "remote_endpoint.endpoint_id: missing"),
    (_without("remote_endpoint.backend"), "remote_endpoint.backend: missing"),
    (_without("remote_lease_s"), "kv_transfer_params.remote_lease_s: missing"),
    (_set("remote_lease_s", "30"), "kv_transfer_params.remote_lease_s: expected number"),
    (_set("remote_token", "x"), "kv_transfer_params: unexpected field"),
    (_set("remote_endpoint.secret", "x"), "kv_transfer_params.remote_endpoint: unexpected field"),
]


def test_a_sync_load_is_counted_as_computed_and_loaded_before_the_forward():
    """kv_transfer_params with sync_load (a migration's resume): the external tokens are not an
    asynchronous hit, and the worker's job says so. They stop before the request's last token,
    which the step that loads them computes (vLLM schedules at least one token)."""
    sched = make_scheduler(False)
    try:
        from vllm_ext.connector.metadata import VllmExtHandshake

        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="cd" * 16, fingerprint_fields={})})
        req = make_request(range(40), dict(good_params(), sync_load=True), req_id="s")
        assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
        sched.update_state_after_alloc(req, [4, 5, 6], 39)
        job, = sched.build_connector_meta().recvs
        assert job.sync and job.dst_block_ids == [4, 5, 6] and job.error is None
        bad = make_request(range(40), dict(good_params(), sync_load="yes"), req_id="b")
        assert sched.get_num_new_matched_tokens(bad, 0) == (39, True)  # refused by name: failed at once
    finally:
        sched.shutdown()


@pytest.mark.parametrize("edit,message", BAD_PARAMS, ids=[m for _, m in BAD_PARAMS])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_bad_kv_transfer_params_fail_that_request_only(edit, message, policy):
    sched = make_scheduler(False, policy=policy)
    try:
        from vllm_ext.connector.metadata import VllmExtHandshake

        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="cd" * 16, fingerprint_fields={})})
        good = make_request(range(40), good_params(), req_id="good")
        params = good_params()
        edit(params)
        bad = make_request(range(40), params, req_id="bad")
        if policy == "fail":  # an async load that the worker fails at once: vLLM fails the request
            assert sched.get_num_new_matched_tokens(bad, 0) == (39, True)
            sched.update_state_after_alloc(bad, [1, 2, 3], 39)
        else:  # computed locally
            assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(good, 0) == (40, True)
        sched.update_state_after_alloc(good, [7, 8, 9], 40)
        recvs = {job.req_id: job for job in sched.build_connector_meta().recvs}
        assert recvs["good"].error is None and recvs["good"].dst_block_ids == [7, 8, 9]
        if policy == "fail":
            assert recvs["bad"].error is not None
            # the failed job names the blocks of the external hit it reported: releases without
            # failed_recving (0.26) learn of the failure only from them
            assert recvs["bad"].dst_block_ids == [1, 2, 3]
            import re

            assert re.search(message, recvs["bad"].error), recvs["bad"].error
        else:
            assert "bad" not in recvs
    finally:
        sched.shutdown()


@pytest.mark.parametrize("n,local_hit,expected", [(40, 0, 32), (48, 0, 32), (49, 0, 48), (16, 0, 0), (17, 0, 16),
                                                  (64, 16, 32), (33, 32, 0)])
def test_whole_block_loads_stop_before_the_last_token(producer, n, local_hit, expected):
    sched, worker = producer
    d = SchedulerHalf(is_producer=False, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                      lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="fail", whole_blocks=True)
    d.set_handshake({0: worker.handshake()})
    _, params = finish_prefill(sched, list(range(n)))
    req = make_request(range(n), params, req_id="d-0")
    assert d.get_num_new_matched_tokens(req, local_hit) == ((expected, True) if expected else (0, False))
    if expected:
        nblocks = -(-n // BLOCK_SIZE)
        d.update_state_after_alloc(req, list(range(30, 30 + nblocks)), expected)
        (job,) = d.build_connector_meta().recvs
        first, last = local_hit // BLOCK_SIZE, (local_hit + expected) // BLOCK_SIZE
        assert job.src_block_ids == params["remote_block_ids"][first:last]
        assert job.dst_block_ids == list(range(30 + first, 30 + last))


@pytest.mark.parametrize("case", ["full_local_hit", "partial_tail_hit", "whole_blocks_short", "skip_prefix_cache",
                                  "bad_params_recompute", "bad_params_fail", "aborted_while_waiting"])
def test_a_lease_that_is_not_pulled_is_released(producer, case):
    """Whenever valid params carry a lease and this instance pulls nothing, it releases the
    lease (a release-only job) and reports no receive for it."""
    sched, p_worker = producer
    policy = "fail" if case == "bad_params_fail" else "recompute"
    d = SchedulerHalf(is_producer=False, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                      lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy=policy,
                      whole_blocks=case == "whole_blocks_short")
    d_worker = make_worker(vllm_layers(seed=6), producer=False, allowed=[sched])
    try:
        d.set_handshake({0: d_worker.handshake()})
        n = {"full_local_hit": 48, "partial_tail_hit": 40, "whole_blocks_short": 16}.get(case, 40)
        prompt = list(range(n))
        _, params = finish_prefill(sched, prompt)
        step(sched, p_worker)
        if case.startswith("bad_params"):
            params = dict(params, remote_prompt_hash=prompt_hash(range(1, n + 1)))  # refused, lease fields good
        # a later turn: the decode prompt extends the prefilled one, and D's own cache holds it all
        more = {"full_local_hit": 16, "partial_tail_hit": 8}.get(case, 0)
        req = make_request(prompt + [7] * more, params, req_id="d-0")
        if case == "aborted_while_waiting":
            d.request_finished(req, [])
        else:
            local = {"full_local_hit": 48, "partial_tail_hit": 40}.get(case, 0)
            tail = local % BLOCK_SIZE  # vLLM shows the block-aligned hit, then keeps its tail ...
            ext, _ = d.get_num_new_matched_tokens(req, local - tail)
            if tail and ext <= tail:
                ext = 0  # ... unless the remote hit strictly exceeds it
            if case == "skip_prefix_cache":
                ext = 0  # vLLM overrides the connector's answer
            assert (ext > 0) == (case == "bad_params_fail"), ext
            d.update_state_after_alloc(req, [30, 31, 32], ext)
        meta = d.build_connector_meta()
        assert [r.lease for r in meta.releases] == [params["remote_lease"]]
        assert [j.req_id for j in meta.recvs] == (["d-0"] if case == "bad_params_fail" else [])
        d_worker.start_load_kv(meta)
        assert released(sched, p_worker) == ["p-0"]
        assert sched.num_leases() == 0 and p_worker.leased_blocks == {}
        _, recving, failed = d_worker.take_results(None)
        assert recving == failed == ({"d-0"} if case == "bad_params_fail" else set())
        assert d.build_connector_meta().releases == []  # once
        d.request_finished(req, [])
        assert d.build_connector_meta().releases == []
    finally:
        d.shutdown()
        d_worker.shutdown()


# (load setting, the producer's backend, kv_load_failure_policy, async scheduling) -> loads in the step
LOAD_RULE = [
    ("auto", "ipc", "recompute", False, True),  # same-host device memory, a failure recomputed in place
    ("auto", "ipc", "fail", True, True),  # the failure ends the request before any token
    ("auto", "ipc", "recompute", True, False),  # vLLM would send the token of a step run on bad KV
    ("auto", "gloo", "recompute", False, False),  # a CPU source served by Python: may run past the deadline
    ("auto", "nccl", "fail", False, False),  # maybe across hosts
    ("auto", "rayrpc", "recompute", False, False),
    ("sync", "gloo", "recompute", False, True),
    ("sync", "nccl", "fail", True, True),
    ("async", "ipc", "recompute", False, False),
]


def consumer_scheduler(load, policy, async_scheduling):
    return SchedulerHalf(is_producer=False, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                         lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy=policy,
                         async_scheduling=async_scheduling, load=load)


@pytest.mark.parametrize("load,backend,policy,async_scheduling,sync", LOAD_RULE)
def test_a_pd_request_loads_in_its_step_by_the_stated_rule(load, backend, policy, async_scheduling, sync):
    """The `load` rule: a sync P/D request is reported as computed (not an asynchronous hit),
    stops before its last token (which its first step computes) and its job loads before that
    step's forward; vLLM 0.34's may_load_async agrees with it. A `sync_load` request (a live
    migration's resume) loads in its step whatever the setting."""
    import random

    from vllm_ext.connector.metadata import VllmExtHandshake

    sched = consumer_scheduler(load, policy, async_scheduling)
    try:
        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="cd" * 16, fingerprint_fields={})})
        n = random.randrange(2 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 1)  # three blocks, the prompt's whole length
        prompt = [random.randrange(3, 1000) for _ in range(n)]
        params = dict(good_params(), remote_num_tokens=n, remote_prompt_hash=prompt_hash(prompt))
        params["remote_endpoint"] = dict(params["remote_endpoint"], backend=backend)
        for asked in (False, True):
            req = make_request(prompt, dict(params, **({"sync_load": True} if asked else {})), req_id=f"r-{asked}")
            loads_sync = sync or asked
            count = n - 1 if loads_sync else n
            assert sched.get_num_new_matched_tokens(req, 0) == (count, not loads_sync)
            assert sched.may_load_async(req.kv_transfer_params) is not loads_sync
            sched.update_state_after_alloc(req, [4, 5, 6], count)
            job, = sched.build_connector_meta().recvs
            blocks = -(-count // BLOCK_SIZE)  # a sync load of 2 blocks + 1 token leaves the third to its step
            assert job.sync is loads_sync and job.dst_block_ids == [4, 5, 6][:blocks] and job.error is None
    finally:
        sched.shutdown()


def test_load_sync_is_refused_where_a_failed_load_would_send_a_wrong_token():
    """load "sync" on an engine that schedules asynchronously under policy "recompute": vLLM
    would run the request's next step on the KV of a failed load and send its token. Refused at
    start-up, naming the setting and the ways out; "auto" and "async" start (asynchronously)."""
    with pytest.raises(ValueError, match=r'kv_connector_extra_config.load "sync" with asynchronous scheduling and '
                                         r'kv_load_failure_policy "recompute".*--no-async-scheduling'):
        consumer_scheduler("sync", "recompute", True)
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.load: expected one of auto, sync, async, got 'x'"):
        consumer_scheduler("x", "fail", False)
    for load in ("auto", "async"):
        consumer_scheduler(load, "recompute", True).shutdown()


@pytest.mark.parametrize("load,sync", [("sync", True), ("async", False)])
def test_refused_params_fail_as_the_load_the_rule_names(load, sync):
    """Params refused by the scheduler (here: another instance's layout) under policy "fail":
    the request's "load" fails at once, inside its step where the rule loads in the step (its
    blocks invalid, no asynchronous receive), asynchronously otherwise; may_load_async agrees."""
    from vllm_ext.connector.metadata import VllmExtHandshake

    sched = consumer_scheduler(load, "fail", True)
    try:
        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="ee" * 16, fingerprint_fields={})})
        req = make_request(range(40), good_params(), req_id="x")  # remote_fingerprint "cd"*16: refused
        assert sched.get_num_new_matched_tokens(req, 0) == (39, not sync)
        assert sched.may_load_async(req.kv_transfer_params) is not sync
        sched.update_state_after_alloc(req, [4, 5, 6], 39)
        job, = sched.build_connector_meta().recvs
        assert job.error and job.sync is sync and job.dst_block_ids == [4, 5, 6]
    finally:
        sched.shutdown()
