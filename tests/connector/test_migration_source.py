"""A live migration's source (scheduler/migration_source.py) over the real lease channel: pre-copy
leases of a running request's complete blocks, their digests, a reply that waits for the worker,
a request preempted meanwhile, and the blocks kept past the source's abort."""

import random
import threading
from types import SimpleNamespace

import pytest

from tests.connector.halves import (
    BLOCK_SIZE,
    RequestStatus,
    expect,
    lease_client,
    precopy,
    running,
    step,
    step_until_answered,
)
from vllm_ext import ops
from vllm_ext.lease.channel import ChannelRefused
from vllm_ext.lease.kv_params import prompt_hash


def test_a_migration_pre_copies_complete_blocks_and_keeps_them_past_the_abort(producer):
    sched, worker = producer
    mid = "ab" * 16
    req = running(sched, list(range(3, 3 + 50)), mid, [5, 6, 9, 11])
    client = lease_client(sched)
    pre, meta = precopy(sched, worker, client, mid, req)
    assert meta.digest_from == {}  # the first lease: every block digested
    # 51 computed, one scheduled this step, one more may be in flight: 49 valid -> 3 whole blocks
    assert pre.block_ids == [5, 6, 9] and pre.num_tokens == 48 and pre.token_ids[:50] == list(range(3, 53))
    assert pre.block_size == BLOCK_SIZE and pre.num_prompt_tokens == 50
    assert pre.prompt_hash == prompt_hash(pre.token_ids[:48])
    ids, _, _, digests = client.acquire(pre.lease, 5, 5, *expect(pre))
    assert ids == [5, 6, 9] and digests == ops.block_digests(worker.cache, ids)
    assert client.release(pre.lease, 5) is True  # not preempted meanwhile: the pull may be used

    # the final lease is one more pre-copy; then the router closes the stream
    final, meta = precopy(sched, worker, client, mid, req)
    assert final.block_ids == [5, 6, 9] and final.num_tokens == 48 and final.lease != pre.lease
    # its blocks are the first lease's, unchanged since (no preemption): not digested again
    assert meta.digest_from == {final.lease: 3}
    assert client.acquire(final.lease, 5, 5, *expect(final))[3] == digests  # the destination's pull is under way
    req.status = RequestStatus.FINISHED_ABORTED
    delay, params = sched.request_finished(req, [5, 6, 9, 11])
    assert delay is True and params is None  # its blocks stay, under the final lease
    client.end(mid, 5)  # ends no lease under a pull
    assert step(sched, worker).finished_sending == [] and sched.num_leases() == 1
    assert client.release(final.lease, 5) is True
    assert step(sched, worker).finished_sending == ["m-0"] and sched.num_leases() == 0
    with pytest.raises(ChannelRefused, match="no running request") as refused:  # forgotten with its last lease
        client.precopy(mid, 5)
    assert refused.value.kind == "RequestEnded"  # the router lets the source's stream finish
    client.close()


def test_a_pre_copy_replies_once_the_worker_serves_its_blocks(producer, monkeypatch):
    """The reply waits for the step's output that says the blocks are served (and digested), so
    the destination's acquire, under its resume's first step, need not wait for this engine."""
    sched, worker = producer
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.PRECOPY_GRANT_WAIT_S", 60.0)
    # an acquire finds it served, or fails
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.GRANT_STALL_S", 0.0)
    mid = "12" * 16
    req = running(sched, list(range(3, 3 + 40)), mid, [4, 7, 8])
    client = lease_client(sched)
    got = {}
    asker = threading.Thread(target=lambda: got.update(lease=client.precopy(mid, 30)))
    asker.start()
    meta = step_until_answered(sched, worker, req, asker, output=False)  # the lease is made and granted by the worker
    (lease_id,) = meta.new_leases
    asker.join(0.5)
    assert asker.is_alive() and "lease" not in got  # its output has not reached the scheduler yet
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta()))
    asker.join(5)
    assert got["lease"].lease == lease_id
    ids, _, _, digests = client.acquire(lease_id, 5, 5, *expect(got["lease"]))  # no wait left
    assert ids == [4, 7] and digests == ops.block_digests(worker.cache, ids)
    assert client.release(lease_id, 5) is True
    client.close()


def test_a_pre_copy_whose_blocks_are_not_served_in_time_still_replies(producer, monkeypatch):
    sched, worker = producer
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.PRECOPY_GRANT_WAIT_S", 0.05)
    mid = "34" * 16
    req = running(sched, list(range(3, 3 + 40)), mid, [4, 7, 8])
    client = lease_client(sched)
    lease, _ = precopy(sched, worker, client, mid, req, grant=False)  # the step's output never came
    with pytest.raises(ChannelRefused, match="not served yet"):  # the acquire waits as before, up to its hold
        client.acquire(lease.lease, 0.5, 5, *expect(lease))
    client.close()


def test_a_pre_copy_of_a_request_preempted_meanwhile_is_not_vouched_for(producer, monkeypatch):
    sched, worker = producer
    # its blocks are never served
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.PRECOPY_GRANT_WAIT_S", 0.05)
    mid = "cd" * 16
    req = running(sched, list(range(3, 3 + 40)), mid, [1, 2, 3])
    client = lease_client(sched)
    lease, _ = precopy(sched, worker, client, mid, req, grant=False)
    req.num_preemptions += 1  # vLLM preempted it: its blocks went back to the pool
    assert client.release(lease.lease, 5) is False
    # an unknown migration, a finished request: refused by name
    with pytest.raises(ChannelRefused, match="no running request"):
        client.precopy("ef" * 16, 5)
    req.status = RequestStatus.PREEMPTED  # not running, not ended: refused as such
    with pytest.raises(ChannelRefused, match="preempted") as refused:
        precopy(sched, worker, client, mid, req)
    assert refused.value.kind == "ValueError"
    req.status = RequestStatus.FINISHED_STOPPED
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)  # no lease left: freed at once
    with pytest.raises(ChannelRefused, match="no running request") as refused:
        client.precopy(mid, 5)
    assert refused.value.kind == "RequestEnded"
    client.close()


def test_a_later_lease_digests_only_the_blocks_after_the_last_granted_ones(producer):
    sched, worker = producer
    mid = "ef" * 16
    req = running(sched, list(range(3, 3 + 50)), mid, [5, 6, 9, 11])
    client = lease_client(sched)
    first, meta = precopy(sched, worker, client, mid, req)
    assert first.block_ids == [5, 6, 9] and meta.digest_from == {}
    # 16 more tokens decoded; the step that scheduled the last of them allocated block 12
    req.append_output_token_ids([8] * 16)
    req.num_computed_tokens += 16
    grown = SimpleNamespace(req_ids=[req.request_id], new_block_ids=[([12],)], resumed_req_ids=set())
    step(sched, worker, SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=grown))
    second, meta = precopy(sched, worker, client, mid, req)
    assert second.block_ids == [5, 6, 9, 11] and meta.digest_from == {second.lease: 3}
    assert client.acquire(second.lease, 5, 5, *expect(second))[3] == ops.block_digests(worker.cache, [5, 6, 9, 11])
    assert client.release(second.lease, 5) is True
    # preempted (and resumed in the same blocks): nothing known is trusted, every block is digested
    req.num_preemptions += 1
    third, meta = precopy(sched, worker, client, mid, req)
    assert third.block_ids == [5, 6, 9, 11] and meta.digest_from == {}
    assert client.acquire(third.lease, 5, 5, *expect(third))[3] == ops.block_digests(worker.cache, [5, 6, 9, 11])
    client.end(mid, 5)
    client.close()


def test_a_resume_may_load_a_prefix_of_a_migration_lease_and_nothing_else(producer):
    """A resume loads the tokens the client got, which may end before the final lease's (the
    source's engine runs ahead of its stream): the source hands the lease to an acquire naming a
    prefix of its tokens, and refuses one naming other tokens (NotThisPrompt) before any block."""
    sched, worker = producer
    rng = random.Random()
    mid = "cd" * 16
    req = running(sched, [rng.randrange(3, 1000) for _ in range(50)], mid, [5, 6, 9, 11])
    client = lease_client(sched)
    lease, _ = precopy(sched, worker, client, mid, req)
    n = rng.randrange(1, lease.num_tokens)
    other = list(lease.token_ids[:n])
    other[rng.randrange(n)] += 1
    with pytest.raises(ChannelRefused, match="tokens of another prompt") as refused:
        client.acquire(lease.lease, 5, 5, n, prompt_hash(other))
    assert refused.value.kind == "NotThisPrompt"
    with pytest.raises(ChannelRefused, match="tokens of another prompt"):  # more tokens than it holds
        client.acquire(lease.lease, 5, 5, lease.num_tokens + 1, prompt_hash(lease.token_ids[:lease.num_tokens + 1]))
    ids, num_tokens, _, _ = client.acquire(lease.lease, 5, 5, n, prompt_hash(lease.token_ids[:n]))
    assert (ids, num_tokens) == (lease.block_ids, lease.num_tokens)
    assert client.release(lease.lease, 5) is True
    client.end(mid, 5)
    client.close()
