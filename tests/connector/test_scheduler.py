"""SchedulerHalf (scheduler/__init__.py) on a producer, against vLLM 0.32's Request: a finished
prefill's lease and its kv_transfer_params, the requests it leaves alone, a lease's expiry, and
an instance that is producer and consumer at once."""

import pytest

from tests.connector.halves import (
    BLOCK_SIZE,
    PROMPT_LENGTHS,
    SECRET,
    RequestStatus,
    expect,
    finish_prefill,
    lease_client,
    make_request,
)
from vllm_ext.connector.scheduler import SchedulerHalf
from vllm_ext.lease.channel import ChannelError
from vllm_ext.lease.kv_params import prompt_hash


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_producer_leases_a_finished_prefill(producer, n):
    sched, worker = producer
    prompt = list(range(100, 100 + n))
    delay, params = finish_prefill(sched, prompt)
    assert delay is True
    nblocks = -(-n // BLOCK_SIZE)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == list(range(3, 3 + nblocks))
    assert params["remote_num_tokens"] == n
    assert params["remote_prompt_hash"] == prompt_hash(prompt)
    assert params["remote_fingerprint"] == worker.fingerprint
    assert len(params["remote_lease"]) == 32 and params["remote_lease"] != "p-0"  # not vLLM's id
    assert set(params["remote_endpoint"]) == {"lease_host", "lease_port", "endpoint_id", "backend"}
    assert "secret" not in str(params).lower()
    meta = sched.build_connector_meta()
    assert meta.new_leases == {params["remote_lease"]: params["remote_block_ids"]} and meta.finished_sending == []


def test_producer_ignores_other_requests(producer):
    sched, _ = producer
    req = make_request(range(20), None)
    req.status = RequestStatus.FINISHED_STOPPED
    assert sched.request_finished(req, [1, 2]) == (False, None)
    req = make_request(range(20), {"do_remote_decode": True})
    req.num_computed_tokens = 20
    req.status = RequestStatus.FINISHED_ABORTED  # an abort returns no params: nothing to lease
    assert sched.request_finished(req, [1, 2]) == (False, None)
    assert sched.num_leases() == 0


def test_lease_expires_and_frees_the_blocks(producer):
    sched, _ = producer
    _, params = finish_prefill(sched, list(range(40)))
    sched.build_connector_meta()
    sched.clock.now += 29.0
    assert sched.build_connector_meta().finished_sending == []
    sched.clock.now += 1.5
    assert sched.build_connector_meta().finished_sending == ["p-0"]
    assert sched.get_stats().data["expired"] == 1
    with pytest.raises(ChannelError, match="unknown, released or expired"):
        lease_client(sched).acquire(params["remote_lease"], 5, 5, *expect(params))


def test_kv_both_is_producer_and_consumer(producer):
    _, worker = producer
    both = SchedulerHalf(is_producer=True, is_consumer=True, block_size=BLOCK_SIZE, lease_s=30.0,
                         lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="fail")
    try:
        both.set_handshake({0: worker.handshake()})
        delay, params = finish_prefill(both, list(range(40)))
        assert delay and params["remote_num_tokens"] == 40
        req = make_request(range(40), params, req_id="d-0")
        assert both.get_num_new_matched_tokens(req, 0) == (40, True)
        assert not both.has_pending_frees()  # a live lease is not a pending free
    finally:
        both.shutdown()
