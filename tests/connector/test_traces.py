"""A destination's traces of resumed requests (scheduler/traces.py) for migrate.trace: when a
request with a migration id arrived and was scheduled, whether its failed load is unsafe, and an
answer that waits for the load before its first step."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.connector.halves import (
    BLOCK_SIZE,
    SECRET,
    STATIC,
    finish_prefill,
    good_params,
    lease_client,
    make_request,
    step,
    vllm_layers,
)
from vllm_ext.connector.scheduler import SchedulerHalf
from vllm_ext.connector.worker import WorkerHalf
from vllm_ext.lease.channel import ChannelRefused, LeaseClient


def test_a_destination_traces_when_a_request_with_a_migration_id_arrived_and_was_scheduled(producer, monkeypatch):
    sched, _ = producer
    client = lease_client(sched)
    mid = "7e" * 16
    with pytest.raises(ChannelRefused, match="no request here carried it"):  # unknown
        client.trace(mid, 5)
    before = time.time()
    req = make_request(list(range(3, 40)), {"migration_id": mid}, req_id="r-0")
    req.arrival_time = before - 0.25  # vLLM's API server took it a moment ago
    sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ChannelRefused, match="not scheduled yet"):  # seen, waiting
        client.trace(mid, 5)
    sched.get_num_new_matched_tokens(req, 0)  # looked at again: the first look counts
    sched.update_state_after_alloc(req, [1, 2, 3], 0)
    got = client.trace(mid, 5)
    assert got.arrival_s == before - 0.25
    assert before <= got.seen_s <= got.scheduled_s <= time.time()
    # a request without a migration id leaves no trace; the oldest traces are forgotten
    sched.get_num_new_matched_tokens(make_request([1, 2, 3], req_id="plain"), 0)
    monkeypatch.setattr("vllm_ext.connector.scheduler.traces.MAX_TRACES", 3)
    for i in range(3):
        other = make_request([1, 2, 3], {"migration_id": f"{i:02x}" * 16}, req_id=f"o-{i}")
        sched.update_state_after_alloc(other, [4], 0)
    for i in range(3):  # the newest three are kept ...
        assert client.trace(f"{i:02x}" * 16, 5).scheduled_s >= before
    with pytest.raises(ChannelRefused, match="no request here carried it"):  # ... the oldest forgotten
        client.trace(mid, 5)
    client.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_resumes_failed_load_is_unsafe_only_with_a_step_in_flight(async_scheduling):
    """A resumed request (sync load, a migration id) whose blocks come back invalid: its trace
    says unsafe when the engine schedules asynchronously (vLLM ran its next step on the bad
    blocks before it learnt of them), and only then; a failure of other blocks does not count."""
    from vllm_ext.connector.metadata import VllmExtHandshake

    sched = SchedulerHalf(is_producer=True, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                          lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="recompute",
                          async_scheduling=async_scheduling)
    client = None
    try:
        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="cd" * 16, fingerprint_fields={})})
        client = lease_client(sched)
        resumed, other = "5a" * 16, "6b" * 16
        for mid, req_id, dst in ((resumed, "r", [4, 5, 6]), (other, "o", [7, 8, 9])):
            req = make_request(range(41), dict(good_params(), sync_load=True, migration_id=mid), req_id=req_id)
            assert sched.get_num_new_matched_tokens(req, 0) == (40, False)
            sched.update_state_after_alloc(req, dst, 40)
        sched.build_connector_meta()
        sched.update_connector_output(SimpleNamespace(invalid_block_ids={5, 30}, kv_connector_worker_meta=None))
        reply = client.trace(resumed, 5)
        assert reply.unsafe is async_scheduling and reply.load_failed is True
        assert client.trace(other, 5).unsafe is False and client.trace(other, 5).load_failed is False
    finally:
        if client is not None:
            client.close()
        sched.shutdown()


def test_a_trace_asked_with_the_resume_answers_once_the_load_before_its_first_step_ended(producer):
    """migrate.trace with wait_s (the router asks it when it sends the resume): the answer waits
    until the request is scheduled and its sync load's step has reported (real halves: the
    destination's worker pulls from the producer); a failed load then answers unsafe; a request
    that loads nothing settles when scheduled; a load that never reports answers unsettled."""
    p_sched, p_worker = producer
    caches = vllm_layers(seed=int(time.time()) % 1000 + 3)
    dst = SchedulerHalf(is_producer=True, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                        lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="recompute",
                        async_scheduling=True)
    worker = WorkerHalf(is_producer=True, is_consumer=True, backend="gloo", endpoint_host="127.0.0.1",
                        endpoint_options={}, secret=SECRET, pull_timeout_s=10.0, static_fields=dict(STATIC),
                        connect_to=[], allowed_producers=["{}:{}".format(*p_sched.lease_address)])
    worker.register_kv_caches(caches)
    client = None
    try:
        dst.set_handshake({0: worker.handshake()})
        client = lease_client(dst)

        def ask(mid, wait_s):
            answer = {}
            t = threading.Thread(target=lambda: answer.update(reply=client.trace(mid, 5, wait_s)), daemon=True)
            t.start()
            return t, answer

        def resume(mid, req_id, params, blocks):
            # a resume's request goes past its lease (the step that loads computes at least a token)
            req = make_request(range(41), dict(params, sync_load=True, migration_id=mid), req_id=req_id)
            assert dst.get_num_new_matched_tokens(req, 0) == (40, False)
            dst.update_state_after_alloc(req, blocks, 40)

        def engine_step():  # the load runs in the worker before the forward; its report comes back
            worker.start_load_kv(dst.build_connector_meta())
            dst.update_connector_output(SimpleNamespace(invalid_block_ids=worker.take_failed_blocks()[1],
                                                        kv_connector_worker_meta=worker.build_worker_meta()))

        for case, mid in (("loaded", "1a" * 16), ("failed", "2b" * 16)):
            _, params = finish_prefill(p_sched, list(range(40)), req_id=f"p-{case}")
            step(p_sched, p_worker)
            if case == "failed":  # the producer lets the lease go before the pull
                assert LeaseClient(SECRET, *p_sched.lease_address).release(params["remote_lease"], 5)
            t, answer = ask(mid, 10)
            resume(mid, f"r-{case}", params, [4, 5, 6] if case == "loaded" else [7, 8, 9])
            t.join(0.3)
            assert t.is_alive(), "answered before the load's step reported"
            engine_step()
            t.join(10)
            reply = answer["reply"]
            assert reply.settled and reply.unsafe is reply.load_failed is (case == "failed"), reply
            assert reply.scheduled_s >= reply.seen_s
            if case == "loaded":  # the pull did happen, before the answer
                for mine, theirs in zip(caches.values(), p_worker.cache.layers):
                    for src, dst_block in zip(params["remote_block_ids"], [4, 5, 6]):
                        assert torch.equal(mine[dst_block], theirs[src])
        # nothing to load: settled once scheduled
        plain = make_request(range(40), {"migration_id": "3c" * 16}, req_id="plain")
        dst.get_num_new_matched_tokens(plain, 0)
        dst.update_state_after_alloc(plain, [10, 11, 12], 0)
        assert client.trace("3c" * 16, 5, 10).settled
        # a load whose step never reports: the answer comes at wait_s, unsettled
        _, params = finish_prefill(p_sched, list(range(40)), req_id="p-silent")
        step(p_sched, p_worker)
        resume("4d" * 16, "r-silent", params, [13, 14, 15])
        reply = client.trace("4d" * 16, 5, 0.2)
        assert not reply.settled and not reply.unsafe
    finally:
        if client is not None:
            client.close()
        dst.shutdown()
        worker.shutdown()
