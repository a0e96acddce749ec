"""Both halves of VllmExtConnector against real vLLM 0.32 classes (Request, SamplingParams,
RequestStatus), in one process: leases, external-token counts, bad kv_transfer_params field by
field, mismatched layouts, and a whole P -> D hand-off over a real gloo MigrationEndpoint."""

import os
import re
import threading
import time
from types import SimpleNamespace

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from vllm_ext import ops  # noqa: E402
from vllm_ext.connector import check_vllm_version  # noqa: E402
from vllm_ext.connector.scheduler import SchedulerHalf  # noqa: E402
from vllm_ext.connector.worker import WorkerHalf  # noqa: E402
from vllm_ext.lease import messages  # noqa: E402
from vllm_ext.lease.channel import ChannelError, ChannelRefused, LeaseClient  # noqa: E402
from vllm_ext.lease.kv_params import PROTOCOL, prompt_hash  # noqa: E402

SECRET = b"unit-test-deployment-secret-0123"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT_LENGTHS = (1, 15, 16, 17, 40, 64)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_request(prompt, params=None, req_id="req-0", max_tokens=4):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request(req_id, list(prompt), sp, None)


def vllm_layers(order="LBHNC", layers=2, heads=2, c=16, seed=0):
    """Per-layer [B, H, N, C] views of one allocation, as vLLM 0.32 makes them."""
    sizes = {"L": layers, "B": NUM_BLOCKS, "H": heads, "N": BLOCK_SIZE, "C": c}
    strides, acc = {}, 1
    for axis in reversed(order):
        strides[axis] = acc
        acc *= sizes[axis]
    g = torch.Generator().manual_seed(seed)
    backing = torch.randn(acc, generator=g)
    return {f"model.layers.{i}.self_attn.attn": backing.as_strided(
        (NUM_BLOCKS, heads, BLOCK_SIZE, c), (strides["B"], strides["H"], strides["N"], strides["C"]),
        i * strides["L"]) for i in range(layers)}


STATIC = {"vllm": "0.32", "attn_backend": ["CPU_ATTN"], "kv_cache_layout": "LBHNC", "cache_dtype": "auto",
          "block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 8}


def make_worker(kv_caches, producer, static=STATIC, pull_timeout_s=10.0, allowed=(), connect_to=()):
    """`allowed`: the producers (schedulers, or "host:port") a consumer may dial."""
    allowed = [a if isinstance(a, str) else "{}:{}".format(*a.lease_address) for a in allowed]
    w = WorkerHalf(is_producer=producer, is_consumer=not producer, backend="gloo", endpoint_host="127.0.0.1",
                   endpoint_options={}, secret=SECRET, pull_timeout_s=pull_timeout_s, static_fields=dict(static),
                   connect_to=list(connect_to), allowed_producers=allowed)
    w.register_kv_caches(kv_caches)
    return w


def make_scheduler(producer, policy="fail", lease_s=30.0, clock=None, lease_port=0):
    return SchedulerHalf(is_producer=producer, is_consumer=not producer, block_size=BLOCK_SIZE, lease_s=lease_s,
                         lease_host="127.0.0.1", lease_port=lease_port, secret=SECRET, failure_policy=policy,
                         clock=clock or time.monotonic)


@pytest.fixture
def producer():
    """A producer instance's two halves (one process): scheduler with its lease channel, worker
    with its endpoint."""
    clock = Clock()
    worker = make_worker(vllm_layers(seed=1), producer=True)
    sched = make_scheduler(True, clock=clock)
    sched.set_handshake({0: worker.handshake()})
    sched.clock = clock
    try:
        yield sched, worker
    finally:
        sched.shutdown()
        worker.shutdown()


def step(sched, worker, scheduler_output=None, output=True):
    """One engine step as vLLM runs it: the scheduler's metadata to the worker, the worker's
    output (its worker metadata) back to the scheduler unless `output` is false. Returns the
    metadata."""
    meta = sched.build_connector_meta(scheduler_output)
    worker.start_load_kv(meta)
    if output:
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta()))
    return meta


def finish_prefill(sched, prompt, req_id="p-0", block_ids=None):
    """Runs the producer's request_finished as the engine does after a 1-token prefill."""
    req = make_request(prompt, {"do_remote_decode": True}, req_id=req_id, max_tokens=1)
    req.num_computed_tokens = len(prompt)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    nblocks = -(-len(prompt) // BLOCK_SIZE)
    block_ids = block_ids if block_ids is not None else list(range(3, 3 + nblocks))
    delay, params = sched.request_finished(req, block_ids)
    return delay, params


# ---- versions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.33.1"])
def test_supported_releases(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.34.0", "1.0.0", "dev"])
def test_unsupported_release_is_refused_with_the_range(version):
    with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.26 to 0\.33; this is vLLM {version}"):
        check_vllm_version(version)


def test_an_unsupported_release_is_named_before_any_import_fails():
    """Each module that imports release-specific vLLM symbols checks the release first (one
    subprocess: importing vLLM takes a while)."""
    import subprocess
    import sys

    code = ("import sys, vllm\nvllm.__version__ = '0.40.0'\n"
            "for m in ('connector', 'metadata', 'stats'):\n"
            "    for k in [k for k in sys.modules if k.startswith('vllm_ext.connector.')]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        __import__('vllm_ext.connector.' + m)\n"
            "    except RuntimeError as e:\n        print(m, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    for m in ("connector", "metadata", "stats"):
        assert f"{m} vllm-ext's VllmExtConnector supports vLLM 0.26 to 0.33; this is vLLM 0.40.0" in out.stdout, \
            out.stdout + out.stderr


# ---- producer: leases -------------------------------------------------------------------------
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


class Raw:
    """A hand-made request header (what a buggy or hostile client might send)."""

    def __init__(self, op, **fields):
        self.op, self.fields = op, fields

    def header(self):
        return dict(self.fields, op=self.op)


def refusal(sched, message):
    """The lease channel's refusal of `message`, sent as is over an authenticated connection
    (as LeaseClient sends its own): the error it answers with."""
    from vllm_ext.lease.messages import LEASE_PROTOCOL, LEASE_SERVER_ID
    from vllm_ext.migration.control import open_connection
    from vllm_ext.migration.timing import Deadline

    host, port = sched.lease_address
    conn = open_connection(host, port, "", Deadline(10), client_id="c" * 32, server_id=LEASE_SERVER_ID,
                           secret=SECRET, version=LEASE_PROTOCOL)
    try:
        conn.send_message(message, b"", Deadline(10))
        header, _ = conn.recv(Deadline(10))
    finally:
        conn.close()
    assert header.get("ok") is not True, header
    return str(header.get("error"))


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


def lease_client(sched):
    host, port = sched.lease_address
    return LeaseClient(SECRET, host, port)


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
        lease_client(sched).acquire(params["remote_lease"], 5, 5)


def test_acquire_extends_the_lease_for_the_pull_then_release_frees(producer):
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    step(sched, worker)
    client = lease_client(sched)
    sched.clock.now += 25.0
    block_ids, num_tokens, hash_, digests = client.acquire(params["remote_lease"], 20, 5)
    assert block_ids == params["remote_block_ids"] and num_tokens == 40 and hash_ == params["remote_prompt_hash"]
    # the worker digested the blocks it serves, as a consumer digests what it pulled
    assert digests == ops.block_digests(worker.cache, block_ids)
    sched.clock.now += 10.0  # past the 30 s lease, within the pull's hold
    assert sched.build_connector_meta().finished_sending == []
    client.release(params["remote_lease"], 5)
    assert sched.build_connector_meta().finished_sending == ["p-0"]
    client.close()


def test_duplicate_and_unknown_leases_are_refused(producer):
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    step(sched, worker)
    client = lease_client(sched)
    client.acquire(params["remote_lease"], 5, 5)
    with pytest.raises(ChannelError, match="already taken"):
        client.acquire(params["remote_lease"], 5, 5)
    with pytest.raises(ChannelError, match="unknown, released or expired"):
        client.acquire("0" * 32, 5, 5)
    with pytest.raises(ChannelError, match="hold_s"):
        _, other = finish_prefill(sched, list(range(20)), req_id="p-1")
        step(sched, worker)
        client.acquire(other["remote_lease"], 1e9, 5)
    from vllm_ext.migration import protocol

    # field checks of protocol.py
    assert re.search("lease.acquire: unexpected steal",
                     refusal(sched, Raw("lease.acquire", lease=other["remote_lease"], hold_s=5, steal=1)))
    assert re.search("unknown request 'steal'", refusal(sched, Raw("steal", lease=params["remote_lease"])))
    assert re.search("unknown request 'gloo.pull'", refusal(sched, protocol.GlooPull(1, 5.0)))  # an endpoint's
    client.close()


def test_lease_channel_refuses_another_secret(producer):
    sched, _ = producer
    host, port = sched.lease_address
    with pytest.raises(ChannelError, match="did not prove it holds the secret"):
        LeaseClient(b"some-other-deployment-secret!!", host, port).describe(5)


# ---- consumer: external tokens ----------------------------------------------------------------
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


def good_params():
    return {"do_remote_prefill": True, "do_remote_decode": False, "vllm_ext": PROTOCOL, "remote_lease": "ab" * 16,
            "remote_block_ids": [4, 5, 6], "remote_num_tokens": 40, "remote_prompt_hash": prompt_hash(range(40)),
            "remote_fingerprint": "cd" * 16,
            "remote_endpoint": {"lease_host": "127.0.0.1", "lease_port": 9, "endpoint_id": "ef" * 16,
                                "backend": "gloo"}, "remote_lease_s": 30.0}


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
    asynchronous hit, and the worker's job says so."""
    sched = make_scheduler(False)
    try:
        from vllm_ext.connector.metadata import VllmExtHandshake

        sched.set_handshake({0: VllmExtHandshake(descriptor={}, fingerprint="cd" * 16, fingerprint_fields={})})
        req = make_request(range(40), dict(good_params(), sync_load=True), req_id="s")
        assert sched.get_num_new_matched_tokens(req, 0) == (40, False)
        sched.update_state_after_alloc(req, [4, 5, 6], 40)
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


# ---- the hand-off between the workers ---------------------------------------------------------
def receive(consumer_worker, recvs, deadline_s=30.0):
    """Runs the worker's per-step calls until every job is reported (a stated, generous deadline)."""
    from vllm_ext.connector.metadata import VllmExtMetadata

    consumer_worker.start_load_kv(VllmExtMetadata(recvs=recvs))
    done, failed = set(), set()
    deadline = time.monotonic() + deadline_s
    while len(done) < len(recvs):
        assert time.monotonic() < deadline, "receives not reported within the deadline"
        _, d, f = consumer_worker.take_results(None)
        done |= d
        failed |= f
        time.sleep(0.01)
    return done, failed


def block_bytes(kv_caches, block):
    return [t[block].clone() for t in kv_caches.values()]


def test_pull_moves_the_leased_blocks_and_frees_the_lease(producer, monkeypatch):
    sched, p_worker = producer
    monkeypatch.setattr("vllm_ext.connector.receiver.SLOW_LOAD_S", 0.0)  # every load counts as slow: its line
    lines = []
    monkeypatch.setattr("vllm_ext.connector.receiver.logger.info", lambda fmt, *args: lines.append(fmt % args))
    consumer_caches = vllm_layers(seed=2)
    d_sched, d_worker = make_scheduler(False), make_worker(consumer_caches, producer=False, allowed=[sched])
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
        slow = [line for line in lines if line.startswith("request d-0: loading 3 blocks from")]
        assert len(slow) == 1 and all(f"{part} " in slow[0] for part in ("queued", "connect", "lease", "pull",
                                                                         "release")), lines
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


def test_lease_channel_bounds_frames_and_never_trusts_unauthenticated_input(producer):
    """Before authentication the lease server answers at most a refusal, then closes; it keeps
    serving authenticated clients."""
    import socket
    import struct

    from vllm_ext.migration import protocol

    sched, _ = producer
    host, port = sched.lease_address
    describe = protocol.encode_frame(messages.LeaseDescribe().header())
    for payload in (struct.pack("!II", protocol.MAX_HEADER_BYTES + 1, 0), struct.pack("!II", 5, 0) + b"\x80\x04N.\x00",
                    struct.pack("!II", 2, 0) + b"[]", describe):
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(payload)
            data = b""
            while True:  # until the server closes (a timeout fails the test)
                try:
                    chunk = s.recv(1 << 16)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
            assert b'"ok":true' not in data and b"descriptor" not in data, data
    assert lease_client(sched).describe(5).fingerprint  # and keeps serving


def test_the_lease_channel_describes_the_output_limits_it_was_given(producer):
    """lease.describe says the instance's generation-config output limits (the router keeps a
    moved request's limit by them); an instance given none says 0 for both."""
    sched, worker = producer
    reply = lease_client(sched).describe(5)
    assert (reply.default_max_tokens, reply.max_tokens_cap) == (0, 0)
    limited = SchedulerHalf(is_producer=True, is_consumer=False, block_size=BLOCK_SIZE, lease_s=30.0,
                            lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="fail",
                            max_tokens_limits=(300, 200))
    try:
        limited.set_handshake({0: worker.handshake()})
        reply = lease_client(limited).describe(5)
        assert (reply.default_max_tokens, reply.max_tokens_cap) == (300, 200)
        assert reply.fingerprint == lease_client(sched).describe(5).fingerprint
    finally:
        limited.shutdown()


def test_the_output_limits_are_read_as_vllms_openai_server_reads_them():
    """(default, cap) from the model config, as vLLM's serving classes derive them; 0: none."""
    from types import SimpleNamespace

    from vllm_ext.connector.connector import max_tokens_limits

    def model(generation_config="auto", diff=None, override=None, fails=False):
        def diff_params():
            if fails:
                raise OSError("generation_config.json: unreadable")
            return dict(diff or {})
        return SimpleNamespace(generation_config=generation_config, get_diff_sampling_param=diff_params,
                               override_generation_config=dict(override or {}))

    assert max_tokens_limits(model()) == (0, 0)
    assert max_tokens_limits(model(diff={"max_tokens": 300})) == (300, 0)  # the model's generation config
    assert max_tokens_limits(model(diff={"max_tokens": 200}, override={"max_new_tokens": 200})) == (200, 200)
    assert max_tokens_limits(model("vllm", override={"max_new_tokens": 50})) == (0, 50)
    assert max_tokens_limits(model("/a/folder", diff={"max_tokens": 400})) == (400, 400)
    assert max_tokens_limits(model(diff={"max_tokens": True}, override={"max_new_tokens": 0})) == (0, 0)
    assert max_tokens_limits(model(fails=True)) == (0, 0)


def test_an_endpoint_serves_no_lease_message(producer):
    """The producer's MigrationEndpoint refuses the lease messages (they have a registry of their
    own), also from an authenticated peer."""
    from vllm_ext.migration import MigrationError, PeerDescriptor
    from vllm_ext.migration.control import open_connection
    from vllm_ext.migration.timing import Deadline

    _, worker = producer
    peer = PeerDescriptor(**worker.handshake().descriptor)
    conn = open_connection(peer.host, peer.port, "", Deadline(10), client_id="c" * 32, server_id=peer.endpoint_id,
                           secret=SECRET)
    try:
        conn.send_message(messages.LeaseDescribe(), b"", Deadline(10))
        with pytest.raises(MigrationError, match="unknown request 'lease.describe'"):
            conn.recv_reply(Deadline(10), "describe")
    finally:
        conn.close()


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


# ---- the data path serves only live leases ----------------------------------------------------
def test_acquire_waits_for_the_worker_to_serve_the_lease(producer):
    """A lease made but not yet granted by the producer's worker is not handed out."""
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    client = lease_client(sched)
    try:
        with pytest.raises(ChannelError, match="not served yet"):
            client.acquire(params["remote_lease"], 5, 10)
        step(sched, worker)
        assert client.acquire(params["remote_lease"], 5, 10)[0] == params["remote_block_ids"]
    finally:
        client.close()


def test_an_authenticated_peer_cannot_pull_blocks_outside_live_leases(producer):
    """The producer's endpoint (gloo, serve="granted") refuses blocks of no lease, serves a live
    lease's blocks, and refuses them again once the lease was released."""
    from vllm_ext import KVCache
    from vllm_ext.migration import MigrationEndpoint, MigrationError, PeerDescriptor

    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))  # blocks 3, 4, 5
    step(sched, worker)
    peer = PeerDescriptor(**worker.handshake().descriptor)
    thief = MigrationEndpoint(KVCache.from_layers([t.clone() for t in vllm_layers(seed=9).values()],
                                                  layout="blocks"), "gloo", secret=SECRET)
    try:
        with pytest.raises(MigrationError, match="block 40 is not granted"):
            thief.pull(peer, [40], [0], timeout=10)
        thief.pull(peer, params["remote_block_ids"], [0, 1, 2], timeout=10)  # a live lease's blocks
        client = lease_client(sched)
        client.release(params["remote_lease"], 5)
        client.close()
        assert step(sched, worker).finished_sending == ["p-0"]
        with pytest.raises(MigrationError, match="block 3 is not granted"):
            thief.pull(peer, params["remote_block_ids"], [0, 1, 2], timeout=10)
    finally:
        thief.close()


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


# ---- a lease the consumer does not pull is released at once -----------------------------------
def released(sched, worker, deadline_s=30.0):
    """The producer's finished_sending once a release arrived (a stated, generous deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        finished = step(sched, worker).finished_sending
        if finished:
            return finished
        assert time.monotonic() < deadline, "the lease was not released within the deadline"
        time.sleep(0.01)


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


# ---- live migration: the source side ----------------------------------------------------------
def _running(sched, prompt, mid, block_ids, req_id="m-0"):
    """A migratable request admitted and run until it computed its prompt plus one token."""
    req = make_request(prompt, {"migration_id": mid}, req_id=req_id, max_tokens=100)
    req.status = RequestStatus.RUNNING
    sched.update_state_after_alloc(req, list(block_ids), 0)
    req.append_output_token_ids(7)
    req.num_computed_tokens = len(prompt) + 1
    return req


def _step_output(req, scheduled=1):
    return SimpleNamespace(num_scheduled_tokens={req.request_id: scheduled}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=None)


def step_until_answered(sched, worker, req, asker, output=True):
    """Engine steps, as a running request makes them, until one answers the pre-copy that `asker`
    (a thread) asks: that step's metadata (it makes the lease), or None when the ask was refused."""
    deadline = time.monotonic() + 5
    while True:
        meta = step(sched, worker, _step_output(req), output=output)
        if meta.new_leases:
            return meta
        if not asker.is_alive():
            return None
        assert time.monotonic() < deadline, "the pre-copy ask was not answered within the deadline"
        time.sleep(0.01)


def _precopy(sched, worker, client, mid, req, grant=True):
    """A router's pre-copy ask, answered at the engine's next step (which this runs); `grant`:
    the worker's output of that step reaches the scheduler too (the lease's blocks are served).
    Returns the lease and that step's metadata; raises the ask's refusal."""
    got = {}

    def ask():
        try:
            got["lease"] = client.precopy(mid, 5)
        except ChannelError as e:
            got["error"] = e

    asker = threading.Thread(target=ask)
    asker.start()
    meta = step_until_answered(sched, worker, req, asker, output=grant)
    asker.join(5)
    if "error" in got:
        raise got["error"]
    return got["lease"], meta


def test_a_migration_pre_copies_complete_blocks_and_keeps_them_past_the_abort(producer):
    sched, worker = producer
    mid = "ab" * 16
    req = _running(sched, list(range(3, 3 + 50)), mid, [5, 6, 9, 11])
    client = lease_client(sched)
    pre, meta = _precopy(sched, worker, client, mid, req)
    assert meta.digest_from == {}  # the first lease: every block digested
    # 51 computed, one scheduled this step, one more may be in flight: 49 valid -> 3 whole blocks
    assert pre.block_ids == [5, 6, 9] and pre.num_tokens == 48 and pre.token_ids[:50] == list(range(3, 53))
    assert pre.block_size == BLOCK_SIZE and pre.num_prompt_tokens == 50
    assert pre.prompt_hash == prompt_hash(pre.token_ids[:48])
    ids, _, _, digests = client.acquire(pre.lease, 5, 5)
    assert ids == [5, 6, 9] and digests == ops.block_digests(worker.cache, ids)
    assert client.release(pre.lease, 5) is True  # not preempted meanwhile: the pull may be used

    # the final lease is one more pre-copy; then the router closes the stream
    final, meta = _precopy(sched, worker, client, mid, req)
    assert final.block_ids == [5, 6, 9] and final.num_tokens == 48 and final.lease != pre.lease
    # its blocks are the first lease's, unchanged since (no preemption): not digested again
    assert meta.digest_from == {final.lease: 3}
    assert client.acquire(final.lease, 5, 5)[3] == digests  # the destination's pull is under way
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
    req = _running(sched, list(range(3, 3 + 40)), mid, [4, 7, 8])
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
    ids, _, _, digests = client.acquire(lease_id, 5, 5)  # no wait left
    assert ids == [4, 7] and digests == ops.block_digests(worker.cache, ids)
    assert client.release(lease_id, 5) is True
    client.close()


def test_a_pre_copy_whose_blocks_are_not_served_in_time_still_replies(producer, monkeypatch):
    sched, worker = producer
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.PRECOPY_GRANT_WAIT_S", 0.05)
    mid = "34" * 16
    req = _running(sched, list(range(3, 3 + 40)), mid, [4, 7, 8])
    client = lease_client(sched)
    lease, _ = _precopy(sched, worker, client, mid, req, grant=False)  # the step's output never came
    with pytest.raises(ChannelRefused, match="not served yet"):  # the acquire waits as before, up to its hold
        client.acquire(lease.lease, 0.5, 5)
    client.close()


def test_a_pre_copy_of_a_request_preempted_meanwhile_is_not_vouched_for(producer, monkeypatch):
    sched, worker = producer
    # its blocks are never served
    monkeypatch.setattr("vllm_ext.connector.scheduler.lease_requests.PRECOPY_GRANT_WAIT_S", 0.05)
    mid = "cd" * 16
    req = _running(sched, list(range(3, 3 + 40)), mid, [1, 2, 3])
    client = lease_client(sched)
    lease, _ = _precopy(sched, worker, client, mid, req, grant=False)
    req.num_preemptions += 1  # vLLM preempted it: its blocks went back to the pool
    assert client.release(lease.lease, 5) is False
    # an unknown migration, a finished request: refused by name
    with pytest.raises(ChannelRefused, match="no running request"):
        client.precopy("ef" * 16, 5)
    req.status = RequestStatus.PREEMPTED  # not running, not ended: refused as such
    with pytest.raises(ChannelRefused, match="preempted") as refused:
        _precopy(sched, worker, client, mid, req)
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
    req = _running(sched, list(range(3, 3 + 50)), mid, [5, 6, 9, 11])
    client = lease_client(sched)
    first, meta = _precopy(sched, worker, client, mid, req)
    assert first.block_ids == [5, 6, 9] and meta.digest_from == {}
    # 16 more tokens decoded; the step that scheduled the last of them allocated block 12
    req.append_output_token_ids([8] * 16)
    req.num_computed_tokens += 16
    grown = SimpleNamespace(req_ids=[req.request_id], new_block_ids=[([12],)], resumed_req_ids=set())
    step(sched, worker, SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=grown))
    second, meta = _precopy(sched, worker, client, mid, req)
    assert second.block_ids == [5, 6, 9, 11] and meta.digest_from == {second.lease: 3}
    assert client.acquire(second.lease, 5, 5)[3] == ops.block_digests(worker.cache, [5, 6, 9, 11])
    assert client.release(second.lease, 5) is True
    # preempted (and resumed in the same blocks): nothing known is trusted, every block is digested
    req.num_preemptions += 1
    third, meta = _precopy(sched, worker, client, mid, req)
    assert third.block_ids == [5, 6, 9, 11] and meta.digest_from == {}
    assert client.acquire(third.lease, 5, 5)[3] == ops.block_digests(worker.cache, [5, 6, 9, 11])
    client.end(mid, 5)
    client.close()


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


def test_block_digests_of_vllms_layers_follow_the_definition():
    """vLLM's own per-layer tensors (layout `blocks`) as the worker wraps them: the digests
    equal the header's definition over each block's row (fresh random KV)."""
    from tests.helpers.reference import ref_block_digests
    from vllm_ext.connector.worker import wrap_kv_caches

    cache, _ = wrap_kv_caches(vllm_layers(seed=int(time.time())))
    ids = list(range(NUM_BLOCKS))[::-1][:70] + [3, 3]
    assert ops.block_digests(cache, ids) == ref_block_digests(cache, ids)


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
            req = make_request(range(40), dict(params, sync_load=True, migration_id=mid), req_id=req_id)
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
