"""A consumer's pull pipeline (receiver.py) between real halves over a real gloo MigrationEndpoint:
a whole P -> D hand-off, producers it connects to ahead or may not dial, mismatched layouts, dead
and silent producers, and the seams the end-to-end tests' fault connector wraps."""

import time

import pytest
import torch

from tests.connector.halves import (
    STATIC,
    block_bytes,
    finish_prefill,
    make_request,
    make_scheduler,
    make_worker,
    receive,
    step,
    vllm_layers,
)
from vllm_ext.lease.kv_params import prompt_hash


def test_a_consumer_connects_to_a_producer_that_starts_after_it(monkeypatch):
    """connect_to names a producer not up yet (servers start together): the consumer keeps
    dialling and connects once it is ready, and its failed attempts hold no pull back."""
    import socket

    from vllm_ext.connector import receiver as receiver_mod

    monkeypatch.setattr(receiver_mod, "CONNECT_AHEAD_RETRY_S", (0.05, 0.2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    consumer = make_worker(vllm_layers(seed=2), producer=False, allowed=[address], connect_to=[address])
    sched = worker = None
    try:
        time.sleep(0.5)  # several refused dials
        assert consumer.receiver.connected_endpoints == () and consumer.receiver.backoff == {}
        worker = make_worker(vllm_layers(seed=1), producer=True)
        sched = make_scheduler(True, lease_port=port)
        time.sleep(0.3)  # its lease channel answers, with no KV cache registered yet: refused
        sched.set_handshake({0: worker.handshake()})
        deadline = time.monotonic() + 10
        while not consumer.receiver.connected_endpoints and time.monotonic() < deadline:
            time.sleep(0.05)
        assert consumer.receiver.connected_endpoints == (worker.endpoint.descriptor().endpoint_id,)
        assert consumer.receiver.backoff == {}
    finally:
        consumer.shutdown()
        for half in (sched, worker):
            if half is not None:
                half.shutdown()


def test_a_producer_connected_by_a_pull_is_not_connected_again_by_the_start_up_dial(producer):
    sched, worker = producer
    consumer = make_worker(vllm_layers(seed=2), producer=False, allowed=[sched])
    try:
        host, port = sched.lease_address
        endpoint_id = worker.endpoint.descriptor().endpoint_id
        deadline = time.monotonic() + 10
        receiver = consumer.receiver
        peer = receiver.connect_producer(host, port, endpoint_id, deadline)  # a pull's dial: by endpoint id
        connects = []
        consumer.endpoint.connect = lambda *a, **k: connects.append(a)
        assert receiver.connect_producer(host, port, None, deadline) is peer and connects == []  # the start-up dial's
    finally:
        consumer.shutdown()


@pytest.mark.parametrize("verify", [True, False])
def test_pull_moves_the_leased_blocks_and_frees_the_lease(producer, monkeypatch, verify):
    """A load's time is recorded per phase. Checked against the producer's digests, its receive
    is reported before the release (the digests vouch), which follows off the load's path;
    unchecked (verify_kv off: no digest pass), the release's answer vouches and is waited for."""
    sched, p_worker = producer
    monkeypatch.setattr("vllm_ext.connector.receiver.SLOW_LOAD_S", 0.0)  # every load counts as slow: its line
    lines = []
    monkeypatch.setattr("vllm_ext.connector.receiver.logger.info", lambda fmt, *args: lines.append(fmt % args))
    consumer_caches = vllm_layers(seed=2)
    d_sched, d_worker = make_scheduler(False), make_worker(consumer_caches, producer=False, allowed=[sched])
    d_worker.receiver.verify_kv = verify
    digest_passes = []
    digests = d_worker.receiver._digests
    monkeypatch.setattr(d_worker.receiver, "_digests", lambda *a: digest_passes.append(a) or digests(*a))
    try:
        d_sched.set_handshake({0: d_worker.handshake()})
        prompt = list(range(50))  # 4 blocks, the last partial
        _, params = finish_prefill(sched, prompt)
        step(sched, p_worker)
        req = make_request(prompt, params, req_id="d-0")
        assert d_sched.get_num_new_matched_tokens(req, 16) == (34, True)
        d_sched.update_state_after_alloc(req, [20, 21, 22, 23], 34)
        before = block_bytes(consumer_caches, 20)
        done, failed = receive(d_worker, d_sched.build_connector_meta().recvs)
        assert done == {"d-0"} and failed == set()
        p_caches = p_worker.cache.layers
        for layer, t in enumerate(consumer_caches.values()):
            assert torch.equal(t[20], before[layer])  # the local hit's block was left alone
            for src, dst in zip(params["remote_block_ids"][1:], [21, 22, 23]):
                assert torch.equal(t[dst], p_caches[layer][src])
        deadline = time.monotonic() + 10
        finished = []
        while not finished and time.monotonic() < deadline:  # the release arrives after the report
            finished = step(sched, p_worker).finished_sending
            time.sleep(0.01)
        assert finished == ["p-0"]
        assert p_worker.leased_blocks == {}  # revoked with the lease
        stats = d_worker.get_stats().data
        assert stats["transfers"] == 1 and stats["bytes"] == 3 * p_worker.cache.block_nbytes
        assert stats["sync"] == 0 and len(digest_passes) == int(verify)
        parts = ("queued", "connect", "acquire", "pull") + (("verify",) if verify else ("release",))
        assert sorted(stats["phases"]) == sorted(parts), stats
        assert all(len(v) == 1 and v[0] >= 0 for v in stats["phases"].values()), stats
        slow = [line for line in lines if line.startswith("request d-0: loading 3 blocks from")]
        assert len(slow) == 1 and all(f"{part} " in slow[0] for part in parts if part != "verify"), lines
        assert ("release " in slow[0]) is not verify, slow
    finally:
        d_sched.shutdown()
        d_worker.shutdown()


@pytest.mark.parametrize("what,static,order", [
    ("physical_order", STATIC, "LBNHC"),
    ("attn_backend", dict(STATIC, attn_backend=["FLASH_ATTN"]), "LBHNC"),
    ("vllm", dict(STATIC, vllm="0.26"), "LBHNC"),
])
def test_mismatched_layouts_are_refused_at_the_handshake(producer, what, static, order):
    sched, _ = producer
    consumer_caches = vllm_layers(order=order, seed=3)
    d_worker = make_worker(consumer_caches, producer=False, static=static, allowed=[sched])
    d_sched = make_scheduler(False)
    try:
        d_sched.set_handshake({0: d_worker.handshake()})
        prompt = list(range(40))
        _, params = finish_prefill(sched, prompt)
        before = [t.clone() for t in consumer_caches.values()]
        # the consumer's scheduler refuses the foreign fingerprint for that request ...
        req = make_request(prompt, params, req_id="d-0")
        d_sched.update_state_after_alloc(req, [1, 2, 3], 39)
        (job,) = d_sched.build_connector_meta().recvs
        assert "remote_fingerprint" in job.error
        # ... and a worker handed the job anyway refuses at the handshake, naming the field
        from vllm_ext.connector.metadata import RecvJob

        job = RecvJob(req_id="d-1", lease=params["remote_lease"],
                      lease_host=params["remote_endpoint"]["lease_host"],
                      lease_port=params["remote_endpoint"]["lease_port"],
                      endpoint_id=params["remote_endpoint"]["endpoint_id"], fingerprint=params["remote_fingerprint"],
                      src_block_ids=params["remote_block_ids"], dst_block_ids=[1, 2, 3])
        done, failed = receive(d_worker, [job])
        assert failed == {"d-1"}
        for t, b in zip(consumer_caches.values(), before):
            assert torch.equal(t, b)  # nothing written
    finally:
        d_sched.shutdown()
        d_worker.shutdown()


def test_dead_producer_fails_the_receive_within_the_deadline(producer):
    sched, _ = producer
    d_worker = make_worker(vllm_layers(seed=4), producer=False, pull_timeout_s=5.0, allowed=[sched])
    try:
        _, params = finish_prefill(sched, list(range(40)))
        from vllm_ext.connector.metadata import RecvJob

        job = RecvJob(req_id="d-0", lease=params["remote_lease"], lease_host="127.0.0.1",
                      lease_port=params["remote_endpoint"]["lease_port"],
                      endpoint_id=params["remote_endpoint"]["endpoint_id"], fingerprint=params["remote_fingerprint"],
                      src_block_ids=params["remote_block_ids"], dst_block_ids=[1, 2, 3])
        sched.shutdown()  # the producer is gone
        done, failed = receive(d_worker, [job], deadline_s=120.0)
        assert failed == {"d-0"}
        assert d_worker.take_failed_blocks() == ({1, 2, 3}, set())
    finally:
        d_worker.shutdown()


def test_a_silent_producer_fails_the_receive_at_the_jobs_deadline():
    """A lease channel that accepts the connection and never answers: the receive is reported
    failed once the job's deadline (pull_timeout_s from when it was queued) has passed, not
    later than that plus one lease-channel deadline, and not before it."""
    import socket

    from vllm_ext.connector.metadata import RecvJob
    from vllm_ext.connector.receiver import CHANNEL_TIMEOUT_S

    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts nor answers
    port = silent.getsockname()[1]
    pull_timeout_s = 3.0
    d_worker = make_worker(vllm_layers(seed=4), producer=False, pull_timeout_s=pull_timeout_s,
                           allowed=[f"127.0.0.1:{port}"])
    try:
        job = RecvJob(req_id="d-0", lease="ab" * 16, lease_host="127.0.0.1", lease_port=port, endpoint_id="ef" * 16,
                      fingerprint="cd" * 16, src_block_ids=[1], dst_block_ids=[2])
        started = time.monotonic()
        done, failed = receive(d_worker, [job], deadline_s=120.0)
        elapsed = time.monotonic() - started
        assert failed == {"d-0"}
        assert min(pull_timeout_s, CHANNEL_TIMEOUT_S) - 0.5 < elapsed < pull_timeout_s + CHANNEL_TIMEOUT_S, elapsed
    finally:
        d_worker.shutdown()
        silent.close()


def test_a_consumer_dials_only_allowed_producers(producer):
    sched, _ = producer
    _, params = finish_prefill(sched, list(range(40)))
    d_worker = make_worker(vllm_layers(seed=5), producer=False, allowed=["127.0.0.1:9"])
    try:
        from vllm_ext.connector.metadata import RecvJob

        job = RecvJob(req_id="d-0", lease=params["remote_lease"], lease_host="127.0.0.1",
                      lease_port=params["remote_endpoint"]["lease_port"],
                      endpoint_id=params["remote_endpoint"]["endpoint_id"], fingerprint=params["remote_fingerprint"],
                      src_block_ids=params["remote_block_ids"], dst_block_ids=[1, 2, 3])
        done, failed = receive(d_worker, [job])
        assert failed == {"d-0"}
        assert sched.num_leases() == 1 and not sched.build_connector_meta().finished_sending  # never dialled
    finally:
        d_worker.shutdown()


def test_the_fault_connectors_hooks_see_every_receive_and_pull(producer):
    """The end-to-end tests' fault connector wraps the `receive` and `pull` of a worker's receiver
    (and reads its `stream`): the wrappers see each job and each pull, and the receive still
    completes."""
    sched, p_worker = producer
    d_worker = make_worker(vllm_layers(seed=8), producer=False, allowed=[sched])
    seen = []
    try:
        receiver = d_worker.receiver
        inner_receive, inner_pull = receiver.receive, receiver.pull

        def wrapped_receive(job, deadline):
            seen.append(("receive", job.req_id))
            inner_receive(job, deadline)

        def wrapped_pull(peer, src, dst, deadline):
            seen.append(("pull", tuple(dst)))
            return inner_pull(peer, src, dst, deadline)

        receiver.receive, receiver.pull = wrapped_receive, wrapped_pull
        assert receiver.stream is None  # on CPU
        _, params = finish_prefill(sched, list(range(40)))
        step(sched, p_worker)
        from vllm_ext.connector.metadata import RecvJob

        job = RecvJob(req_id="d-0", lease=params["remote_lease"], lease_host="127.0.0.1",
                      lease_port=params["remote_endpoint"]["lease_port"],
                      endpoint_id=params["remote_endpoint"]["endpoint_id"], fingerprint=params["remote_fingerprint"],
                      num_tokens=40, prompt_hash=prompt_hash(range(40)),  # the request's own tokens
                      src_block_ids=params["remote_block_ids"], dst_block_ids=[1, 2, 3])
        assert receive(d_worker, [job]) == ({"d-0"}, set())
        assert seen == [("receive", "d-0"), ("pull", (1, 2, 3))]
    finally:
        d_worker.shutdown()


def test_a_failed_pull_synchronises_its_stream_before_it_is_reported(producer, monkeypatch):
    """On a GPU the pull runs on the worker's own stream: when it fails, the stream is
    synchronised before failed_recving is reported (vLLM then reuses the blocks). Stood in for
    on CPU by a stream that records its synchronisations."""
    import contextlib

    from vllm_ext.connector import receiver as receiver_mod
    from vllm_ext.migration import MigrationError

    sched, p_worker = producer
    d_worker = make_worker(vllm_layers(seed=7), producer=False, allowed=[sched])
    events = []

    class Stream:
        def synchronize(self):
            events.append("synchronize")

    def failing_pull(*args, **kwargs):
        events.append("pull")
        raise MigrationError("the source stalled past the deadline")

    try:
        d_worker.receiver.stream = Stream()
        monkeypatch.setattr(receiver_mod.torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(d_worker.endpoint, "pull", failing_pull)
        _, params = finish_prefill(sched, list(range(40)))
        step(sched, p_worker)
        from vllm_ext.connector.metadata import RecvJob

        job = RecvJob(req_id="d-0", lease=params["remote_lease"], lease_host="127.0.0.1",
                      lease_port=params["remote_endpoint"]["lease_port"],
                      endpoint_id=params["remote_endpoint"]["endpoint_id"], fingerprint=params["remote_fingerprint"],
                      num_tokens=40, prompt_hash=prompt_hash(range(40)),  # the request's own tokens
                      src_block_ids=params["remote_block_ids"], dst_block_ids=[1, 2, 3])
        done, failed = receive(d_worker, [job])
        assert failed == {"d-0"} and events == ["pull", "synchronize"]
    finally:
        d_worker.shutdown()


def test_the_acquire_holds_the_lease_as_long_as_a_gloo_pull_may_follow_its_source(producer):
    """A gloo pull follows a source that makes progress up to PATIENCE times its timeout; the
    acquire holds the lease that long. Here P's lease clock moves on 5 timeouts during the pull
    (a pull slowed down by a busy host, as the clock tells it): the lease is still held at the
    release, which vouches for the blocks, and the receive succeeds."""
    from vllm_ext.migration.gloo import PATIENCE

    sched, p_worker = producer
    timeout_s = 10.0
    d_sched = make_scheduler(False)
    d_worker = make_worker(vllm_layers(seed=3), producer=False, allowed=[sched], pull_timeout_s=timeout_s)
    receiver = d_worker.receiver
    pull = receiver.pull

    def slow_pull(*args):
        stats = pull(*args)
        sched.clock.now += (PATIENCE - 1.0) * timeout_s
        return stats

    receiver.pull = slow_pull
    try:
        d_sched.set_handshake({0: d_worker.handshake()})
        prompt = list(range(50))
        _, params = finish_prefill(sched, prompt)
        step(sched, p_worker)
        req = make_request(prompt, params, req_id="d-0")
        assert d_sched.get_num_new_matched_tokens(req, 0) == (50, True)
        d_sched.update_state_after_alloc(req, [20, 21, 22, 23], 50)
        done, failed = receive(d_worker, d_sched.build_connector_meta().recvs)
        assert done == {"d-0"} and failed == set()
        assert d_worker.get_stats().data["transfers"] == 1
    finally:
        d_sched.shutdown()
        d_worker.shutdown()


def test_a_sync_job_loads_before_start_load_kv_returns(producer):
    """A sync job (the step's forward reads its blocks) is pulled on the worker's thread inside
    start_load_kv: its blocks hold the producer's when the call returns, it has no report (vLLM
    counts it computed already), and the stats count it as a sync load, phase by phase."""
    import random

    sched, p_worker = producer
    consumer_caches = vllm_layers(seed=random.randrange(1000))
    d_sched, d_worker = make_scheduler(False), make_worker(consumer_caches, producer=False, allowed=[sched])
    try:
        d_sched.set_handshake({0: d_worker.handshake()})
        prompt = [random.randrange(3, 1000) for _ in range(random.randrange(33, 49))]  # 3 blocks, the last partial
        _, params = finish_prefill(sched, prompt, req_id="p-sync", block_ids=[40, 41, 42])
        step(sched, p_worker)
        req = make_request(prompt, dict(params, sync_load=True), req_id="d-sync")
        count = len(prompt) - 1  # its step computes the last token
        assert d_sched.get_num_new_matched_tokens(req, 0) == (count, False)
        dst = [30, 31, 32][:-(-count // 16)]
        d_sched.update_state_after_alloc(req, dst, count)
        meta = d_sched.build_connector_meta()
        d_worker.start_load_kv(meta)
        assert d_worker.take_failed_blocks() == (set(), set())
        for layer, t in enumerate(consumer_caches.values()):
            for src, b in zip(params["remote_block_ids"], dst):
                assert torch.equal(t[b], p_worker.cache.layers[layer][src])
        assert d_worker.take_results(None)[1:] == (set(), set())
        assert d_worker.build_worker_meta().loaded == ["d-sync"]
        stats = d_worker.get_stats().data
        assert stats["transfers"] == stats["sync"] == 1 and {"acquire", "pull", "verify"} <= set(stats["phases"])
    finally:
        d_sched.shutdown()
        d_worker.shutdown()


def test_a_sync_job_of_a_silent_producer_fails_at_its_own_deadline(monkeypatch):
    """A sync load holds the worker's step: a producer that never answers fails it at the sync
    deadline (sync_load_timeout_s), far before the pull's, and its blocks are reported invalid
    (vLLM recomputes them or fails the request by its policy), not as a failed receive."""
    import socket

    from vllm_ext.connector.metadata import RecvJob, VllmExtMetadata

    monkeypatch.setattr("vllm_ext.connector.receiver.CHANNEL_TIMEOUT_S", 300.0)  # only the job's deadline ends it
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts nor answers
    port = silent.getsockname()[1]
    d_worker = make_worker(vllm_layers(seed=5), producer=False, pull_timeout_s=120.0, allowed=[f"127.0.0.1:{port}"])
    d_worker.receiver.sync_timeout_s = 1.0
    try:
        job = RecvJob(req_id="d-0", lease="ab" * 16, lease_host="127.0.0.1", lease_port=port, endpoint_id="ef" * 16,
                      fingerprint="cd" * 16, src_block_ids=[1, 2], dst_block_ids=[5, 6], sync=True)
        started = time.monotonic()
        d_worker.start_load_kv(VllmExtMetadata(recvs=[job]))
        elapsed = time.monotonic() - started
        assert 1.0 <= elapsed < 60.0, elapsed  # its own deadline, not the pull's 120 s
        assert d_worker.take_failed_blocks() == ({5, 6}, {5, 6})
        assert d_worker.take_results(None)[1:] == (set(), set())
        assert d_worker.get_stats().data["failed"] == 1
    finally:
        d_worker.shutdown()
        silent.close()
