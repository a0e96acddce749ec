"""What the connector's tests share: its two halves against real vLLM 0.32 classes (Request,
SamplingParams, RequestStatus) in one process, vLLM-shaped KV caches and requests, one engine
step, a producer's lease channel and a pre-copy asked on it. Importing it skips the importing
test module where vLLM is not installed (make test-connector installs it); the fixtures that use
it are in conftest.py."""

import contextlib
import dataclasses
import os
import threading
import time
from types import SimpleNamespace

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from vllm_ext.connector.scheduler import SchedulerHalf  # noqa: E402
from vllm_ext.connector.worker import WorkerHalf  # noqa: E402
from vllm_ext.lease.channel import ChannelError, LeaseClient  # noqa: E402
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


def make_worker(kv_caches, producer, static=STATIC, pull_timeout_s=10.0, allowed=(), connect_to=(), tp_rank=0,
                tp_size=1):
    """`allowed`: the producers (schedulers, or "host:port") a consumer may dial; `tp_rank` of
    `tp_size`: the worker's tensor-parallel rank (`kv_caches` are its shard)."""
    allowed = [a if isinstance(a, str) else "{}:{}".format(*a.lease_address) for a in allowed]
    w = WorkerHalf(is_producer=producer, is_consumer=not producer, backend="gloo", endpoint_host="127.0.0.1",
                   endpoint_options={}, secret=SECRET, pull_timeout_s=pull_timeout_s, static_fields=dict(static),
                   connect_to=list(connect_to), allowed_producers=allowed, tp_rank=tp_rank, tp_size=tp_size)
    w.register_kv_caches(kv_caches)
    return w


def make_scheduler(producer, policy="fail", lease_s=30.0, clock=None, lease_port=0):
    return SchedulerHalf(is_producer=producer, is_consumer=not producer, block_size=BLOCK_SIZE, lease_s=lease_s,
                         lease_host="127.0.0.1", lease_port=lease_port, secret=SECRET, failure_policy=policy,
                         clock=clock or time.monotonic)


@contextlib.contextmanager
def producer_halves():
    """A producer instance's two halves (one process): scheduler with its lease channel, worker
    with its endpoint; `sched.clock` is its leases' clock, which a test moves on."""
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


@dataclasses.dataclass
class Instance:
    """One instance's scheduler half and its TP ranks' worker halves, stepped as vLLM's executor
    does (their outputs aggregated by vLLM's own KVOutputAggregator)."""

    sched: object
    workers: list
    aggregator: object

    @classmethod
    def of(cls, workers, producer: bool, policy: str = "recompute") -> "Instance":
        """A scheduler half (`policy`) over `workers` (rank r at index r), handshakes set."""
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        sched = make_scheduler(producer, policy=policy)
        sched.set_handshake({rank: w.handshake() for rank, w in enumerate(workers)})
        return cls(sched, workers, KVOutputAggregator(len(workers)))

    def step(self, ranks=None):
        """One engine step: the metadata to every rank's worker, their outputs aggregated (of
        `ranks` only: the others' outputs do not reach the scheduler this step)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

        meta = self.sched.build_connector_meta(None)
        outputs = []
        for rank, worker in enumerate(self.workers):
            worker.start_load_kv(meta)
            if ranks is not None and rank not in ranks:
                continue
            sending, recving, failed = worker.take_results(meta)
            out = dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT)  # fields differ by release
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None, failed_recving=failed,
                kv_connector_worker_meta=worker.build_worker_meta())
            outputs.append(out)
        output = self.aggregator.aggregate(outputs).kv_connector_output
        self.sched.update_connector_output(output)
        return output

    def until(self, what, deadline_s=30.0):
        """Steps until `what(output)` holds (a stated, generous deadline); that step's output."""
        deadline = time.monotonic() + deadline_s
        while True:
            output = self.step()
            if what(output):
                return output
            assert time.monotonic() < deadline, "not reached within the deadline"
            time.sleep(0.01)

    def shutdown(self):
        for half in (self.sched, *self.workers):
            half.shutdown()


def assert_every_rank_received_once(p: Instance, d: Instance) -> None:
    """P's lease "p-0" ended (every D rank released it), and each D rank made one transfer, none
    failed."""
    assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}
    stats = [w.get_stats().data for w in d.workers]
    assert [s["transfers"] for s in stats] == [1] * len(d.workers) and all(s["failed"] == 0 for s in stats)


def finish_prefill(sched, prompt, req_id="p-0", block_ids=None):
    """Runs the producer's request_finished as the engine does after a 1-token prefill."""
    req = make_request(prompt, {"do_remote_decode": True}, req_id=req_id, max_tokens=1)
    req.num_computed_tokens = len(prompt)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    nblocks = -(-len(prompt) // BLOCK_SIZE)
    block_ids = block_ids if block_ids is not None else list(range(3, 3 + nblocks))
    delay, params = sched.request_finished(req, block_ids)
    return delay, params


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


def expect(lease):
    """(num_tokens, prompt_hash) an acquire names for a lease: of a producer's answer
    (kv_transfer_params) or of a migration lease (MigrationLease): all of its tokens."""
    if isinstance(lease, dict):
        return lease["remote_num_tokens"], lease["remote_prompt_hash"]
    return lease.num_tokens, lease.prompt_hash


def lease_client(sched):
    host, port = sched.lease_address
    return LeaseClient(SECRET, host, port)


def good_params():
    return {"do_remote_prefill": True, "do_remote_decode": False, "vllm_ext": PROTOCOL, "remote_lease": "ab" * 16,
            "remote_block_ids": [4, 5, 6], "remote_num_tokens": 40, "remote_prompt_hash": prompt_hash(range(40)),
            "remote_fingerprint": "cd" * 16,
            "remote_endpoint": {"lease_host": "127.0.0.1", "lease_port": 9, "endpoint_id": "ef" * 16,
                                "backend": "gloo"}, "remote_lease_s": 30.0}


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


def released(sched, worker, deadline_s=30.0):
    """The producer's finished_sending once a release arrived (a stated, generous deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        finished = step(sched, worker).finished_sending
        if finished:
            return finished
        assert time.monotonic() < deadline, "the lease was not released within the deadline"
        time.sleep(0.01)


def running(sched, prompt, mid, block_ids, req_id="m-0"):
    """A migratable request admitted and run until it computed its prompt plus one token."""
    req = make_request(prompt, {"migration_id": mid}, req_id=req_id, max_tokens=100)
    req.status = RequestStatus.RUNNING
    sched.update_state_after_alloc(req, list(block_ids), 0)
    req.append_output_token_ids(7)
    req.num_computed_tokens = len(prompt) + 1
    return req


def step_output(req, scheduled=1):
    return SimpleNamespace(num_scheduled_tokens={req.request_id: scheduled}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=None)


def step_until_answered(sched, worker, req, asker, output=True):
    """Engine steps, as a running request makes them, until one answers the pre-copy that `asker`
    (a thread) asks: that step's metadata (it makes the lease), or None when the ask was refused."""
    deadline = time.monotonic() + 5
    while True:
        meta = step(sched, worker, step_output(req), output=output)
        if meta.new_leases:
            return meta
        if not asker.is_alive():
            return None
        assert time.monotonic() < deadline, "the pre-copy ask was not answered within the deadline"
        time.sleep(0.01)


def precopy(sched, worker, client, mid, req, grant=True):
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
