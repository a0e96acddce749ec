"""A lease is loaded only into a request whose own tokens it holds. The kv_transfer_params come
from the client: one that got a lease for prompt X and rewrites `remote_prompt_hash` to prompt Y's
must not make Y's request load X's KV (vLLM would cache it under Y's block hashes for everyone).
The consumer's scheduler hashes the request's own tokens into its RecvJob; the worker compares
them with what the producer's acquire says the lease holds and refuses a mismatch before any
pull, releasing the lease. Fresh random tokens each run; real halves, a real gloo endpoint."""

import random
import time

import pytest
import torch

from tests.connector.halves import (
    BLOCK_SIZE,
    expect,
    finish_prefill,
    lease_client,
    make_request,
    make_scheduler,
    make_worker,
    precopy,
    receive,
    released,
    running,
    step,
    vllm_layers,
)
from vllm_ext.connector.metadata import VllmExtMetadata
from vllm_ext.lease.channel import ChannelError
from vllm_ext.lease.kv_params import RemoteKV, prompt_hash

PROMPT_LENGTHS = (17, 40, 64)


def tokens(n, rng):
    return [rng.randrange(1, 30000) for _ in range(n)]


@pytest.fixture
def producer():
    """A producer's two halves (one process): scheduler with its lease channel, worker with its
    endpoint."""
    worker = make_worker(vllm_layers(seed=1), producer=True)
    sched = make_scheduler(True)
    sched.set_handshake({0: worker.handshake()})
    try:
        yield sched, worker
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.fixture
def consumer(producer):
    """A consumer's two halves, allowed to dial the producer; and a record of the pulls its
    worker starts."""
    sched, _ = producer
    d_sched = make_scheduler(False, policy="recompute")
    caches = vllm_layers(seed=random.randrange(1000) + 10)
    d_worker = make_worker(caches, producer=False, allowed=[sched])
    d_sched.set_handshake({0: d_worker.handshake()})
    pulls = []
    pull = d_worker.receiver.pull

    def recorded_pull(peer, src, dst, deadline):
        pulls.append(list(dst))
        return pull(peer, src, dst, deadline)

    d_worker.receiver.pull = recorded_pull
    try:
        yield d_sched, d_worker, caches, pulls
    finally:
        d_sched.shutdown()
        d_worker.shutdown()


def admit(d_sched, prompt, params, dst, req_id="d-0"):
    """The consumer's scheduler admits the request (its params pass its own checks) and returns
    the step's receive jobs."""
    req = make_request(prompt, params, req_id=req_id)
    n, _ = d_sched.get_num_new_matched_tokens(req, 0)
    assert n > 0, "the consumer's scheduler refused the params itself"
    d_sched.update_state_after_alloc(req, dst, n)
    return d_sched.build_connector_meta().recvs


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_the_job_carries_the_hash_of_the_requests_own_tokens(producer, consumer, n):
    """The expected hash is the request's own first remote_num_tokens tokens', also for a request
    longer than the lease (a pre-copy stage's load: the lease's tokens and one more)."""
    sched, p_worker = producer
    d_sched, _, _, _ = consumer
    rng = random.Random()
    prompt = tokens(n, rng)
    _, params = finish_prefill(sched, prompt)
    longer = prompt + tokens(5, rng)
    (job,) = admit(d_sched, longer, params, list(range(40, 40 + -(-len(longer) // BLOCK_SIZE))))
    assert job.num_tokens == n and job.prompt_hash == prompt_hash(longer[:n]) == prompt_hash(prompt)


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_lease_for_another_prompt_is_refused_before_any_pull(producer, consumer, n, sync):
    """The attack: P leased prompt X; a request for prompt Y arrives at D with P's params and
    remote_prompt_hash rewritten to Y's. D's scheduler cannot tell (the hash is Y's); its worker
    learns from P's acquire that the lease holds X's tokens and refuses: nothing pulled, nothing
    written, the receive failed (vLLM recomputes or fails by its policy), the lease released."""
    sched, p_worker = producer
    d_sched, d_worker, caches, pulls = consumer
    rng = random.Random()
    x, y = tokens(n, rng), tokens(n, rng)
    _, params = finish_prefill(sched, x)
    step(sched, p_worker)
    forged = dict(params, remote_prompt_hash=prompt_hash(y), **({"sync_load": True} if sync else {}))
    nblocks = -(-n // BLOCK_SIZE)
    dst = list(range(20, 20 + nblocks))
    before = [t.clone() for t in caches.values()]
    jobs = admit(d_sched, y, forged, dst)
    assert [(j.num_tokens, j.prompt_hash) for j in jobs] == [(n, prompt_hash(y))]
    d_worker.start_load_kv(_meta(jobs))
    deadline = time.monotonic() + 30
    failed_blocks = set()
    while True:
        _, done, failed = d_worker.take_results(None)
        every, sync_blocks = d_worker.take_failed_blocks()
        failed_blocks |= sync_blocks if sync else every
        if sync or done:
            break
        assert time.monotonic() < deadline, "the receive was not reported"
        time.sleep(0.01)
    if not sync:
        assert done == failed == {"d-0"}
    # vLLM never caches them as loaded (a sync load stops before the last token, which its step computes)
    assert failed_blocks == set(jobs[0].dst_block_ids) and jobs[0].dst_block_ids == dst[:-(-(n - sync) // BLOCK_SIZE)]
    assert pulls == []
    for t, b in zip(caches.values(), before):
        assert torch.equal(t, b)  # nothing written
    stats = d_worker.get_stats().data
    assert (stats["refused"], stats["failed"], stats["transfers"]) == (1, 1, 0)
    assert released(sched, p_worker) == ["p-0"] and sched.num_leases() == 0  # released, not left to expire


def _meta(jobs):
    return VllmExtMetadata(recvs=jobs)


def test_a_lease_naming_fewer_tokens_than_it_holds_is_refused(producer, consumer):
    """The token count counts too: params that name a prefix of the lease (their hash and
    blocks cut to it) are refused, even where the request shares that prefix."""
    sched, p_worker = producer
    d_sched, d_worker, _, pulls = consumer
    rng = random.Random()
    x = tokens(40, rng)
    _, params = finish_prefill(sched, x)
    step(sched, p_worker)
    y = x[:32] + tokens(8, rng)
    cut = dict(params, remote_num_tokens=32, remote_block_ids=params["remote_block_ids"][:2],
               remote_prompt_hash=prompt_hash(y[:32]))
    jobs = admit(d_sched, y, cut, [20, 21, 22])
    assert receive(d_worker, jobs) == ({"d-0"}, {"d-0"}) and pulls == []
    assert d_worker.get_stats().data["refused"] == 1
    assert released(sched, p_worker) == ["p-0"]


def test_the_requests_own_prompt_still_loads(producer, consumer):
    """The honest hand-off, with fresh random tokens: pulled, the blocks equal the producer's."""
    sched, p_worker = producer
    d_sched, d_worker, caches, pulls = consumer
    prompt = tokens(50, random.Random())
    _, params = finish_prefill(sched, prompt)
    step(sched, p_worker)
    jobs = admit(d_sched, prompt, params, [20, 21, 22, 23])
    assert receive(d_worker, jobs) == ({"d-0"}, set()) and pulls == [[20, 21, 22, 23]]
    for mine, theirs in zip(caches.values(), p_worker.cache.layers):
        for src, dst in zip(params["remote_block_ids"], [20, 21, 22, 23]):
            assert torch.equal(mine[dst], theirs[src])
    assert d_worker.get_stats().data["refused"] == 0


def test_a_migration_lease_loads_only_into_the_requests_own_tokens(producer, consumer):
    """A running request's pre-copy lease (a migration's source): a resumed request with the
    source's tokens (prompt + output so far, longer than the lease) loads it; a request of other
    tokens with params whose hash was rewritten is refused before any pull, and the lease ends
    with its release (the source's blocks go back once its request finished)."""
    sched, p_worker = producer
    d_sched, d_worker, _, pulls = consumer
    rng = random.Random()
    mid = "9a" * 16
    req = running(sched, tokens(50, rng), mid, [5, 6, 9, 11])
    client = lease_client(sched)
    try:
        for case in ("own", "forged"):
            lease, _ = precopy(sched, p_worker, client, mid, req)
            own = list(lease.token_ids)
            n = lease.num_tokens
            prompt = own if case == "own" else tokens(len(own), rng)
            # a resume's params, as a router builds them from the lease (forged: the hash rewritten)
            params = RemoteKV(lease=lease.lease, block_ids=lease.block_ids, num_tokens=n,
                              prompt_hash=prompt_hash(prompt[:n]), fingerprint=lease.fingerprint,
                              lease_host=client.host, lease_port=client.port, endpoint_id=lease.endpoint_id,
                              backend=lease.backend, lease_s=lease.lease_s, sync=True).to_params()
            pulls.clear()
            jobs = admit(d_sched, prompt, params, [30, 31, 32, 33], req_id=f"r-{case}")
            assert jobs[0].sync and jobs[0].prompt_hash == prompt_hash(prompt[:n])
            d_worker.start_load_kv(_meta(jobs))  # a sync load: done when start_load_kv returns
            _, sync_failed = d_worker.take_failed_blocks()
            if case == "own":
                assert sync_failed == set() and pulls == [[30, 31, 32]]
            else:
                assert sync_failed == {30, 31, 32} and pulls == []
            # released by the consumer, pulled or not (a pull its digests vouch for: just after its report)
            deadline = time.monotonic() + 30
            while True:
                with pytest.raises(ChannelError) as refused:
                    client.acquire(lease.lease, 5, 5, *expect(lease))
                if "unknown, released or expired" in str(refused.value):
                    break
                assert "already taken" in str(refused.value) and time.monotonic() < deadline, refused.value
                time.sleep(0.01)
    finally:
        client.end(mid, 5)
        client.close()
