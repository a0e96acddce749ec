"""Hostile clients and a busy host, on the connector's real halves (vLLM 0.32's classes, a real
gloo endpoint, the real lease channel): what a producer's P/D leases hold is bounded (a client
that asks for prefills and never decodes them cannot pin the cache), its answer carries no
prefix-cache oracle, and an acquire waits for a busy producer's worker as long as its engine
makes progress (a stuck one is refused before the consumer's deadline). Fresh random sizes and
tokens each run; the seed is in each failure's message."""

import functools
import logging
import random
import threading
import time
from types import SimpleNamespace

import pytest

from tests.connector.halves import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SECRET,
    RequestStatus,
    expect,
    lease_client,
    make_request,
    make_worker,
    step,
    vllm_layers,
)
from vllm_ext.connector.metadata import RecvJob, VllmExtMetadata
from vllm_ext.connector.scheduler import UNLEASED, SchedulerHalf
from vllm_ext.lease.channel import ChannelRefused
from vllm_ext.lease.kv_params import RemoteKV, prompt_hash

# how long the engine may be between steps, none in flight, before an acquire is refused
STALL_S = 1.5  # a starved test thread on a loaded 2-core host can pause a few hundred ms
# how late a busy producer's worker serves a lease: many stall limits, and more than the fixed
# 3 s an acquire used to wait
LATE_S = 6.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def seed():
    return random.randrange(1 << 30)


def bounded_producer(max_blocks):
    """A producer's halves whose P/D leases hold at most `max_blocks` blocks."""
    worker = make_worker(vllm_layers(seed=1), producer=True)
    sched = SchedulerHalf(is_producer=True, is_consumer=False, block_size=BLOCK_SIZE, lease_s=30.0,
                          lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="recompute",
                          clock=Clock(), max_leased_blocks=max_blocks)
    sched.set_handshake({0: worker.handshake()})
    return sched, worker


@pytest.fixture
def producer_of():
    made = []

    def make(max_blocks=None):
        made.append(bounded_producer(max_blocks))
        return made[-1]

    yield make
    for sched, worker in made:
        sched.shutdown()
        worker.shutdown()


def prefill(sched, blocks, rng, req_id):
    """request_finished of a 1-token prefill whose prompt fills `blocks` (the last one partly)."""
    n = (len(blocks) - 1) * BLOCK_SIZE + rng.randrange(1, BLOCK_SIZE + 1)
    req = make_request([rng.randrange(3, 30000) for _ in range(n)], {"do_remote_decode": True}, req_id=req_id,
                       max_tokens=1)
    req.num_computed_tokens = n
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return sched.request_finished(req, list(blocks))


def stats_of(sched):
    stats = sched.get_stats()
    return stats.data if stats is not None else {}


# ---- the bound ---------------------------------------------------------------------------------
def test_leases_stop_at_the_bound_and_the_oldest_untaken_make_room(producer_of, seed):
    rng = random.Random(seed)
    bound = rng.randrange(8, 20)
    sched, worker = producer_of(bound)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    leases = []  # (request id, params), oldest first
    while True:
        blocks = [free.pop() for _ in range(rng.randrange(1, 5))]
        held = sum(len(p["remote_block_ids"]) for _, p in leases)
        if held + len(blocks) > bound:
            break
        delay, params = prefill(sched, blocks, rng, f"p-{len(leases)}")
        assert delay is True and params["do_remote_prefill"] is True, seed
        leases.append((f"p-{len(leases)}", params))
        assert sched.leased_blocks() == held + len(blocks), seed
    assert stats_of(sched)["leased_blocks"] == sched.leased_blocks() <= bound
    step(sched, worker)  # the leases are granted

    # a lease that does not fit: the oldest untaken leases end, just enough of them
    delay, params = prefill(sched, blocks, rng, "p-new")
    assert delay is True and params["do_remote_prefill"] is True, seed
    evicted = []
    while sum(len(p["remote_block_ids"]) for _, p in leases) + len(blocks) > bound:
        evicted.append(leases.pop(0))
    leases.append(("p-new", params))
    assert evicted, seed
    assert sched.leased_blocks() == sum(len(p["remote_block_ids"]) for _, p in leases) <= bound, seed
    data = stats_of(sched)
    assert (data["evicted"], data["unleased"], data["leased_blocks"]) == (len(evicted), 0, sched.leased_blocks())
    assert sorted(step(sched, worker).finished_sending) == sorted(r for r, _ in evicted), seed
    client = lease_client(sched)
    try:
        for _, old in evicted:
            with pytest.raises(ChannelRefused, match="unknown, released or expired"):
                client.acquire(old["remote_lease"], 5, 10, *expect(old))

        # leases taken by pulls are never ended under them: once they hold the bound, a prefill
        # that does not fit is answered without a lease, and its blocks go back at once
        for _, p in leases:
            assert client.acquire(p["remote_lease"], 20, 10, *expect(p))[0] == p["remote_block_ids"], seed
        room = bound - sched.leased_blocks()
        more = [free.pop() for _ in range(room + 1)]
        assert prefill(sched, more, rng, "p-unleased") == (False, UNLEASED), seed
        data = stats_of(sched)
        assert (data.get("evicted", 0), data["unleased"]) == (0, 1), seed
        assert sched.leased_blocks() == bound - room and sched.num_leases() == len(leases)

        # a release frees its blocks at once (at the next step), and the gauge follows
        req_id, first = leases.pop(0)
        assert client.release(first["remote_lease"], 5) is True
        assert step(sched, worker).finished_sending == [req_id]
        assert stats_of(sched)["leased_blocks"] == sched.leased_blocks() == \
            sum(len(p["remote_block_ids"]) for _, p in leases)
    finally:
        client.close()


def test_a_prefill_larger_than_the_bound_is_never_leased(producer_of, seed):
    rng = random.Random(seed)
    bound = rng.randrange(1, 6)
    sched, _ = producer_of(bound)
    assert prefill(sched, list(range(10, 10 + bound + 1)), rng, "p-big") == (False, UNLEASED), seed
    assert sched.num_leases() == 0 and sched.leased_blocks() == 0
    delay, params = prefill(sched, list(range(10, 10 + bound)), rng, "p-fits")  # exactly the bound
    assert delay is True and len(params["remote_block_ids"]) == bound == sched.leased_blocks(), seed


def test_an_unacquired_lease_released_on_the_channel_is_freed_at_the_next_step(producer_of, seed):
    """What a front calls when the decode leg failed: the producer's blocks go back at once."""
    rng = random.Random(seed)
    sched, worker = producer_of(NUM_BLOCKS // 2)
    _, params = prefill(sched, rng.sample(range(NUM_BLOCKS), rng.randrange(1, 5)), rng, "p-0")
    client = lease_client(sched)
    try:
        assert client.release(params["remote_lease"], 5) is True  # before its grant even
        meta = step(sched, worker)
        assert meta.finished_sending == ["p-0"] and meta.ended_leases == [params["remote_lease"]]
        assert sched.leased_blocks() == 0 and sched.num_leases() == 0
        assert worker.leased_blocks == {}  # granted and revoked in the same step: nothing is served
    finally:
        client.close()


def test_leases_sharing_blocks_count_them_once(producer_of, seed):
    """Two prompts with a common prefix (vLLM's prefix cache gives them the same first blocks)."""
    rng = random.Random(seed)
    sched, _ = producer_of(NUM_BLOCKS)
    shared = rng.sample(range(NUM_BLOCKS), 3)
    own = [b for b in range(NUM_BLOCKS) if b not in shared][:2]
    prefill(sched, shared + own[:1], rng, "p-0")
    prefill(sched, shared + own[1:], rng, "p-1")
    assert sched.leased_blocks() == 5 and sched.num_leases() == 2


def test_the_bound_is_a_share_of_the_cache_and_checked():
    from vllm_ext.connector.connector import max_leased_blocks

    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=None))
    assert max_leased_blocks({}, config, SimpleNamespace(num_blocks=600)) == 300  # the default: half
    assert max_leased_blocks({"max_leased_fraction": 0.1}, config, SimpleNamespace(num_blocks=600)) == 60
    assert max_leased_blocks({"max_leased_fraction": 1}, config, SimpleNamespace(num_blocks=600)) == 600
    assert max_leased_blocks({}, SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=64)), None) == 32
    for bad in (0, -0.5, 1.5, "0.5", True, None):
        with pytest.raises(ValueError, match=r"max_leased_fraction: expected a fraction of the KV cache in \(0, 1\]"):
            max_leased_blocks({"max_leased_fraction": bad}, config, SimpleNamespace(num_blocks=600))


def test_the_bound_reaches_prometheus():
    import prometheus_client as prom

    from vllm_ext.connector.stats import VllmExtPromMetrics, VllmExtStats

    registry = prom.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (prom.Gauge, prom.Counter, prom.Histogram)}
    metrics = VllmExtPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    rng = random.Random()
    older, newer = VllmExtStats(), VllmExtStats()
    evicted, unleased, leased = rng.randrange(1, 9), rng.randrange(1, 9), rng.randrange(0, 500)
    for _ in range(evicted):
        older.record_eviction()
    for _ in range(unleased):
        newer.record_unleased()
    older.record_leased_blocks(leased + 7)
    newer.record_leased_blocks(leased)  # the latest value wins
    metrics.observe(older.aggregate(newer).data, 0)

    def value(name):
        return registry.get_sample_value(name, {"engine": "0"})

    assert value("vllm:vllm_ext_leased_blocks") == leased
    assert value("vllm:vllm_ext_evicted_leases_total") == evicted
    assert value("vllm:vllm_ext_unleased_prefills_total") == unleased
    metrics.observe(VllmExtStats().data, 0)  # stats without the gauge leave it as it was
    assert value("vllm:vllm_ext_leased_blocks") == leased
    assert not VllmExtStats().aggregate(VllmExtStats()).data.get("leased_blocks")


# ---- the prefix-cache oracle -------------------------------------------------------------------
def test_the_producers_answer_does_not_take_the_prefix_cache_hit(producer_of, seed):
    """vLLM's scheduler writes `remote_prefill_cached_tokens` (the producer's local prefix-cache
    hit) into the params the connector returns: what reaches the client, through vLLM's engine
    output serialisation, has no such field, and a consumer still takes the params."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_ext.connector.scheduler.consumer import Consumer

    rng = random.Random(seed)
    sched, _ = producer_of(NUM_BLOCKS)
    blocks = rng.sample(range(NUM_BLOCKS), rng.randrange(1, 6))
    _, params = prefill(sched, blocks, rng, "p-0")
    params["remote_prefill_cached_tokens"] = BLOCK_SIZE * rng.randrange(0, len(blocks) + 1)  # as vLLM 0.32 does
    assert "remote_prefill_cached_tokens" not in params
    out = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="p-0", new_token_ids=[1], kv_transfer_params=params)])
    sent = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out)).outputs[0].kv_transfer_params
    assert sent == dict(params) and "remote_prefill_cached_tokens" not in sent, seed
    remote = RemoteKV.parse(sent, BLOCK_SIZE)
    assert remote.block_ids == params["remote_block_ids"]

    consumer = Consumer(block_size=BLOCK_SIZE, failure_policy="fail", whole_blocks=False)
    prompt = [rng.randrange(3, 30000) for _ in range(remote.num_tokens)]
    sent["remote_prompt_hash"] = prompt_hash(prompt)
    assert consumer.remote(make_request(prompt, sent)) == (RemoteKV.parse(sent, BLOCK_SIZE), None)


# ---- a busy producer ---------------------------------------------------------------------------
def acquire_in_thread(client, params, hold_s=30.0, timeout=30.0):
    got = {}

    def run():
        try:
            got["reply"] = client.acquire(params["remote_lease"], hold_s, timeout, *expect(params))
        except Exception as e:  # noqa: BLE001 - the test reads it
            got["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def run_steps(sched, seconds):
    """Empty engine steps (scheduled, output in, nothing granted) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sched.build_connector_meta()
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
        time.sleep(0.02)


def test_an_acquire_waits_while_the_engine_steps_until_the_worker_serves_the_lease(producer_of, monkeypatch, seed):
    """The worker grants late (the step that carries the lease comes after several that do not,
    for many times the stall limit); the engine steps all along, so the acquire is answered."""
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.GRANT_STALL_S", STALL_S)
    rng = random.Random(seed)
    sched, worker = producer_of()
    _, params = prefill(sched, rng.sample(range(NUM_BLOCKS), 3), rng, "p-0")
    carrier = sched.build_connector_meta()  # the step that hands the lease to the worker...
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    client = lease_client(sched)
    try:
        thread, got = acquire_in_thread(client, params)
        run_steps(sched, LATE_S)
        assert thread.is_alive() and not got, got  # still waiting: the engine makes progress
        worker.start_load_kv(carrier)  # ...reaches it only now
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta()))
        thread.join(30)
        assert got["reply"][0] == params["remote_block_ids"], got
    finally:
        client.close()


def test_an_acquire_waits_for_a_step_in_flight(producer_of, monkeypatch, seed):
    """The step that grants the lease is running (a forward that takes long on a busy host): no
    step starts or ends meanwhile, and the acquire waits for its output."""
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.GRANT_STALL_S", STALL_S)
    rng = random.Random(seed)
    sched, worker = producer_of()
    _, params = prefill(sched, rng.sample(range(NUM_BLOCKS), 2), rng, "p-0")
    worker.start_load_kv(sched.build_connector_meta())  # scheduled and granted; its output is not in
    client = lease_client(sched)
    try:
        thread, got = acquire_in_thread(client, params)
        thread.join(LATE_S)
        assert thread.is_alive() and not got, got
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta()))
        thread.join(30)
        assert got["reply"][0] == params["remote_block_ids"], got
    finally:
        client.close()


def test_an_acquire_from_an_engine_that_makes_no_progress_is_refused_before_its_deadline(producer_of, monkeypatch,
                                                                                          seed):
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.GRANT_STALL_S", STALL_S)
    rng = random.Random(seed)
    sched, worker = producer_of()
    _, params = prefill(sched, rng.sample(range(NUM_BLOCKS), 2), rng, "p-0")
    client = lease_client(sched)
    try:
        with pytest.raises(ChannelRefused, match=f"took no step for {STALL_S:g} s"):  # not the 30 s hold's refusal
            client.acquire(params["remote_lease"], 30.0, 30.0, *expect(params))
        step(sched, worker)  # the engine steps again: the lease was left untaken
        assert client.acquire(params["remote_lease"], 5, 10, *expect(params))[0] == params["remote_block_ids"]
    finally:
        client.close()


@pytest.fixture
def pair(producer_of):
    """A producer and a consumer worker allowed to dial it (pull deadline 20 s)."""
    sched, p_worker = producer_of()
    d_worker = make_worker(vllm_layers(seed=random.randrange(1000) + 10), producer=False, pull_timeout_s=20.0,
                           allowed=[sched])
    yield sched, p_worker, d_worker
    d_worker.shutdown()


def recv_job(params, prompt, dst):
    ep = params["remote_endpoint"]
    return RecvJob(req_id="d-0", lease=params["remote_lease"], lease_host=ep["lease_host"],
                   lease_port=ep["lease_port"], endpoint_id=ep["endpoint_id"], fingerprint=params["remote_fingerprint"],
                   num_tokens=len(prompt), prompt_hash=prompt_hash(prompt), src_block_ids=params["remote_block_ids"],
                   dst_block_ids=dst)


def test_a_consumer_pulls_from_a_producer_whose_worker_serves_the_lease_late(pair, monkeypatch, seed):
    """The acquire is answered after more than one lease-channel deadline (made short here):
    the consumer waits up to its pull's deadline, and the pull brings the producer's blocks."""
    from vllm_ext import ops

    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.GRANT_STALL_S", STALL_S)
    monkeypatch.setattr("vllm_ext.connector.receiver.CHANNEL_TIMEOUT_S", STALL_S)
    rng = random.Random(seed)
    sched, p_worker, d_worker = pair
    src = rng.sample(range(NUM_BLOCKS), 3)
    prompt = [rng.randrange(3, 30000) for _ in range(2 * BLOCK_SIZE + 5)]
    req = make_request(prompt, {"do_remote_decode": True}, req_id="p-0", max_tokens=1)
    req.num_computed_tokens, req.status = len(prompt), RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = sched.request_finished(req, src)
    carrier = sched.build_connector_meta()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    dst = rng.sample(range(NUM_BLOCKS), 3)
    d_worker.start_load_kv(VllmExtMetadata(recvs=[recv_job(params, prompt, dst)]))
    run_steps(sched, LATE_S)  # a busy engine: steps, none of which grants the lease
    p_worker.start_load_kv(carrier)
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=p_worker.build_worker_meta()))
    done, failed = _results(d_worker)
    assert done == {"d-0"} and failed == set(), (seed, done, failed)
    assert ops.block_digests(d_worker.cache, dst) == ops.block_digests(p_worker.cache, src)


def _results(d_worker, deadline_s=60.0):
    """(done, failed) once the consumer reported its one receive (a stated, generous deadline)."""
    done, failed = set(), set()
    deadline = time.monotonic() + deadline_s
    while not done:
        assert time.monotonic() < deadline, "the receive was not reported within the deadline"
        _, d, f = d_worker.take_results(None)
        done |= d
        failed |= f
        time.sleep(0.01)
    return done, failed


def test_an_acquire_past_the_consumers_deadline_frees_the_lease(producer_of, monkeypatch, seed):
    """The producer's step never ends (its output never comes): the consumer fails the receive
    at its pull's deadline and releases the lease, so its blocks do not stay pinned."""
    rng = random.Random(seed)
    sched, p_worker = producer_of()
    d_worker = make_worker(vllm_layers(seed=11), producer=False, pull_timeout_s=1.5, allowed=[sched])
    try:
        prompt = [rng.randrange(3, 30000) for _ in range(BLOCK_SIZE + 3)]
        req = make_request(prompt, {"do_remote_decode": True}, req_id="p-0", max_tokens=1)
        req.num_computed_tokens, req.status = len(prompt), RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = sched.request_finished(req, [5, 9])
        sched.build_connector_meta()  # a step in flight that never reports
        d_worker.start_load_kv(VllmExtMetadata(recvs=[recv_job(params, prompt, [1, 2])]))
        done, failed = _results(d_worker)
        assert failed == {"d-0"}
        deadline = time.monotonic() + 30
        while sched.num_leases():  # the release, sent beside the failure
            assert time.monotonic() < deadline, "the consumer did not release the lease it gave up on"
            time.sleep(0.02)
        assert "p-0" in sched.build_connector_meta().finished_sending
    finally:
        d_worker.shutdown()


# ---- the failure policy ------------------------------------------------------------------------
@pytest.mark.parametrize("role,policy,warns", [("kv_consumer", "fail", True), ("kv_both", "fail", True),
                                               ("kv_consumer", "recompute", False), ("kv_producer", "fail", False)])
def test_a_consumer_that_fails_loads_says_so_at_start_up(role, policy, warns):
    from vllm.config import KVTransferConfig

    from vllm_ext.connector import connector

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    connector.logger.addHandler(handler)
    try:
        connector.warn_if_requests_can_be_lost(KVTransferConfig(kv_connector="VllmExtConnector", kv_role=role,
                                                                 kv_load_failure_policy=policy))
    finally:
        connector.logger.removeHandler(handler)
    assert bool(lines) == warns, lines
    if warns:
        assert '"kv_load_failure_policy": "recompute"' in lines[0] and "never lost" in lines[0]
