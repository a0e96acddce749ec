"""Tensor parallelism between real halves: a TP = 2 producer (one scheduler, a worker per rank,
each with its own shard of the KV heads and its own gloo endpoint) and TP = 2 consumers, their
steps' outputs aggregated by vLLM's own KVOutputAggregator as its executor does. Each consumer
rank pulls its shard from the producer's rank of the same number; a lease is served once every
rank serves it, taken once per rank and ended once every rank released it; a request whose pull
fails on one rank fails as a whole. At unequal TP sizes (2 -> 1, 1 -> 2) a consumer rank gathers
its heads from the producer ranks that hold them, each checked against that rank's digests."""

import os
import time

import pytest
import torch

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402

from tests.connector.halves import (
    STATIC,
    Instance,
    assert_every_rank_received_once,
    expect,
    finish_prefill,
    lease_client,
    make_request,
    make_scheduler,
    make_worker,
    vllm_layers,
)
from vllm_ext.lease.channel import ChannelError

TP = 2
HEADS = STATIC["num_kv_heads"]  # the model's; each rank holds HEADS // its TP size
DEADLINE_S = 30.0  # generous: a stated bound, never a speed assertion


def instance(producer: bool, tp: int, seed: int, allowed=()) -> Instance:
    """An instance of `tp` ranks; rank r's shard is drawn with seed `seed + r` (every shard differs)."""
    workers = [make_worker(vllm_layers(heads=HEADS // tp, seed=seed + rank), producer, allowed=allowed,
                           tp_rank=rank, tp_size=tp) for rank in range(tp)]
    return Instance.of(workers, producer)


@pytest.fixture
def prefill():
    p = instance(True, TP, seed=10)
    try:
        yield p
    finally:
        p.shutdown()


def decode_instance(p: Instance, tp=TP, seed=20) -> Instance:
    return instance(False, tp, seed, allowed=[p.sched])


def reported(worker, deadline_s=DEADLINE_S):
    """A worker's (finished_recving, failed_recving) once it reported a receive."""
    deadline = time.monotonic() + deadline_s
    while True:
        _, done, failed = worker.take_results(None)
        if done:
            return done, failed
        assert time.monotonic() < deadline, "no receive reported within the deadline"
        time.sleep(0.01)


def admit(d: Instance, prompt, params, req_id="d-0", local=(20, 21, 22, 23)):
    """D admits the request (no local hit): its receive job, handed to its ranks at its next step."""
    req = make_request(prompt, params, req_id=req_id)
    matched, is_async = d.sched.get_num_new_matched_tokens(req, 0)
    assert is_async and matched > 0
    d.sched.update_state_after_alloc(req, list(local), matched)
    return req


def test_every_rank_pulls_its_own_shard_and_the_lease_ends_after_the_last_rank(prefill):
    p = prefill
    d = decode_instance(p)
    try:
        prompt = list(range(50))  # 4 blocks
        _, params = finish_prefill(p.sched, prompt)
        p.step()  # both ranks grant the lease
        admit(d, prompt, params)
        meta = d.sched.build_connector_meta(None)
        d.workers[0].start_load_kv(meta)  # rank 0 alone first: the lease outlives its release
        assert reported(d.workers[0]) == ({"d-0"}, set())
        assert p.step().finished_sending is None and p.sched.num_leases() == 1
        d.workers[1].start_load_kv(meta)
        assert reported(d.workers[1]) == ({"d-0"}, set())
        for rank in range(TP):
            src, dst = p.workers[rank].cache.layers, d.workers[rank].cache.layers
            other = p.workers[1 - rank].cache.layers
            for layer in range(len(src)):
                for s, t in zip(params["remote_block_ids"], [20, 21, 22, 23]):
                    assert torch.equal(dst[layer][t], src[layer][s])  # its own rank's shard
                    assert not torch.equal(dst[layer][t], other[layer][s])
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}
        assert p.sched.num_leases() == 0 and all(w.leased_blocks == {} for w in p.workers)
        stats = [w.get_stats() for w in d.workers]
        assert [s.data["transfers"] for s in stats] == [1, 1]  # every rank's transfer counted
        nbytes = 4 * p.workers[0].cache.block_nbytes
        assert stats[0].aggregate(stats[1]).reduce()["ranks"] == {"0": {"transfers": 1, "failed": 0, "bytes": nbytes},
                                                                  "1": {"transfers": 1, "failed": 0, "bytes": nbytes}}
    finally:
        d.shutdown()


def test_a_lease_is_served_once_every_rank_serves_it_with_each_ranks_digests(prefill):
    p = prefill
    client0, client1 = lease_client(p.sched), lease_client(p.sched)
    try:
        _, params = finish_prefill(p.sched, list(range(40)))
        p.step(ranks={0})  # rank 1's output is late: its endpoint may not serve the blocks yet
        with pytest.raises(ChannelError, match="not served yet"):
            client0.acquire(params["remote_lease"], 0.3, 5, *expect(params), 0, TP)
        p.step()  # the next step brings both ranks' grants
        got = [c.acquire(params["remote_lease"], 5, 5, *expect(params), rank, TP)
               for rank, c in enumerate((client0, client1))]
        assert [g[0] for g in got] == [params["remote_block_ids"]] * 2
        from vllm_ext import ops

        for rank, (_, _, _, digests) in enumerate(got):  # each rank's shard's own digests
            assert digests == ops.block_digests(p.workers[rank].cache, params["remote_block_ids"])
        assert got[0][3] != got[1][3]
        with pytest.raises(ChannelError, match=r"already taken by another pull \(rank 1\)"):
            client1.acquire(params["remote_lease"], 5, 5, *expect(params), 1, TP)
        assert client0.release(params["remote_lease"], 5, 0, TP) is True
        assert p.step().finished_sending is None  # rank 1 still holds it
        assert client1.release(params["remote_lease"], 5, 1, TP) is True
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}
    finally:
        client0.close()
        client1.close()


def test_a_routers_release_ends_a_tp_lease_at_once(prefill):
    """A front's release (rank 0 of 1: it pulls nothing) frees every rank's blocks."""
    p = prefill
    client = lease_client(p.sched)
    try:
        _, params = finish_prefill(p.sched, list(range(40)))
        p.step()
        assert client.release(params["remote_lease"], 5) is True
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}
    finally:
        client.close()


def test_a_pull_that_fails_on_one_rank_fails_the_request_on_all(prefill):
    """Rank 1's blocks change after P digested them (its pull fails the check twice); rank 0's
    pull succeeds. vLLM's aggregation reports the request received and failed, once, so the
    scheduler recomputes (or fails) it as a whole: no rank decodes on a partial KV."""
    p = prefill
    d = decode_instance(p)
    try:
        prompt = list(range(50))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        for t in p.workers[1].cache.layers:
            t[params["remote_block_ids"][2]].add_(1.0)
        admit(d, prompt, params)
        outputs = []
        deadline = time.monotonic() + DEADLINE_S
        while not any(o.finished_recving for o in outputs):
            assert time.monotonic() < deadline
            outputs.append(d.step())
            time.sleep(0.01)
        done = [o for o in outputs if o.finished_recving]
        assert len(done) == 1 and done[0].finished_recving == {"d-0"} and done[0].failed_recving == {"d-0"}
        assert not any(o.finished_recving for o in outputs[:-1])  # not before the last rank reported
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}  # both ranks released
        stats = [w.get_stats().data for w in d.workers]
        block_nbytes = p.workers[0].cache.block_nbytes
        assert [s["transfers"] for s in stats] == [1, 0] and [s["failed"] for s in stats] == [0, 1]
        assert [s["ranks"] for s in stats] == [{"0": {"transfers": 1, "failed": 0, "bytes": 4 * block_nbytes}},
                                               {"1": {"transfers": 0, "failed": 1, "bytes": 0}}]
    finally:
        d.shutdown()


def all_heads(inst: Instance, blocks):
    """Every layer's blocks `blocks` with the heads of all the instance's ranks, in order."""
    return [torch.cat([w.cache.layers[layer][blocks] for w in inst.workers], dim=1)
            for layer in range(len(inst.workers[0].cache.layers))]


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_unequal_tp_sizes_gather_or_slice_the_heads(p_tp, d_tp, monkeypatch):
    """P at TP 2 -> D at TP 1 (D's rank gathers its heads from both P ranks) and P at TP 1 -> D
    at TP 2 (each D rank takes its slice of P's heads), through staging caches smaller than the
    pull (chunks): every head of every block lands where a single instance holds it."""
    monkeypatch.setattr("vllm_ext.connector.receiver.STAGING_BLOCKS", 3)
    p = instance(True, p_tp, seed=30)
    d = instance(False, d_tp, seed=40, allowed=[p.sched])
    try:
        prompt = list(range(75))  # 5 blocks, the last partial
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        local = [20, 21, 22, 23, 24]
        before = all_heads(d, [25])
        admit(d, prompt, params, local=local)
        out = d.until(lambda o: o.finished_recving)
        assert out.finished_recving == {"d-0"} and not out.failed_recving
        for got, want in zip(all_heads(d, local), all_heads(p, params["remote_block_ids"])):
            assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(all_heads(d, [25]), before))  # nothing else written
        assert_every_rank_received_once(p, d)
    finally:
        d.shutdown()
        p.shutdown()


def test_unequal_tp_checks_each_source_ranks_digests(prefill):
    """P at TP 2 -> D at TP 1: a block of P's rank 1 changed after P digested it: D's pull from
    that rank fails its check twice and the receive fails (recomputed), its lease released."""
    p = prefill
    d = decode_instance(p, tp=1)
    try:
        prompt = list(range(50))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        for t in p.workers[1].cache.layers:
            t[params["remote_block_ids"][1]].add_(1.0)
        admit(d, prompt, params)
        out = d.until(lambda o: o.finished_recving)
        assert out.failed_recving == {"d-0"}
        assert d.workers[0].get_stats().data["mismatches"] == 2
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}
    finally:
        d.shutdown()


def test_heads_that_do_not_split_evenly_are_refused_naming_the_sizes():
    from vllm_ext.lease.kv_params import shard_plan

    assert shard_plan(6, 1, 2, 3) == [(1, 1, 0, 1), (2, 0, 1, 2)]  # D rank 1 of 2 from P ranks 1 and 2 of 3
    assert shard_plan(4, 1, 2, 1) == [(0, 2, 0, 2)]
    with pytest.raises(ValueError, match="2 KV heads do not split evenly over the producer's 4 tensor-parallel ranks"):
        shard_plan(2, 0, 1, 4)
    with pytest.raises(ValueError, match="3 KV heads do not split evenly over this instance's 2"):
        shard_plan(3, 0, 2, 1)


def test_describe_of_a_rank_the_producer_lacks_is_refused(prefill):
    client = lease_client(prefill.sched)
    try:
        with pytest.raises(ChannelError, match="rank: this instance runs 2 tensor-parallel rank"):
            client.describe(5, rank=2)
        _, params = finish_prefill(prefill.sched, list(range(40)))
        prefill.step()
        with pytest.raises(ChannelError, match="rank: expected a tensor-parallel rank below ranks 2, got 2"):
            client.acquire(params["remote_lease"], 5, 5, *expect(params), 2, 2)
    finally:
        client.close()


def test_handshakes_of_every_rank_with_one_layout_are_required():
    workers = [make_worker(vllm_layers(heads=1, seed=rank), True, tp_rank=rank, tp_size=TP) for rank in range(TP)]
    odd = make_worker(vllm_layers(heads=2, seed=5), True, tp_rank=1, tp_size=TP)
    sched = make_scheduler(True)
    try:
        with pytest.raises(ValueError, match=r"TP ranks 0 to n-1, got ranks \[0, 2\]"):
            sched.set_handshake({0: workers[0].handshake(), 2: workers[1].handshake()})
        with pytest.raises(ValueError, match="shards differ"):
            sched.set_handshake({0: workers[0].handshake(), 1: odd.handshake()})
        with pytest.raises(ValueError, match=r"tp_rank: expected 0 to 1 \(tp_size 2\), got 2"):
            make_worker(vllm_layers(heads=1), True, tp_rank=2, tp_size=TP)
    finally:
        for half in (sched, odd, *workers):
            half.shutdown()


@pytest.mark.parametrize("field", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused_by_name(field):
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_ext.connector.connector import _tensor_parallel

    sizes = {"tensor_parallel_size": 2, field: 2}
    with pytest.raises(ValueError, match=rf"VllmExtConnector: {field} 2: only 1 is supported"):
        _tensor_parallel(ParallelConfig(**sizes), KVConnectorRole.SCHEDULER)
    assert _tensor_parallel(ParallelConfig(tensor_parallel_size=2), KVConnectorRole.SCHEDULER) == (0, 2)


def test_a_producer_restarted_between_two_ranks_describes_fails_the_transfer_naming_both(prefill, monkeypatch,
                                                                                      caplog):
    """D's rank 1 describes P's rank 0, then P restarts (other workers, other endpoint ids, the
    same lease channel) before it describes P's rank 1: that rank's reply is another instance's,
    so the transfer fails naming both ids rather than storing the new rank under the old id."""
    p = prefill
    d = decode_instance(p)
    restarted = instance(True, TP, seed=50)
    receiver = d.workers[1].receiver
    connect_rank = receiver._connect_rank

    def restart_then_connect(describe, reply, *args):
        p.sched.set_handshake({rank: w.handshake() for rank, w in enumerate(restarted.workers)})
        return connect_rank(describe, reply, *args)

    monkeypatch.setattr(receiver, "_connect_rank", restart_then_connect)
    try:
        prompt = list(range(50))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        old_id = params["remote_endpoint"]["endpoint_id"]
        new_id = restarted.workers[0].handshake().descriptor["endpoint_id"]
        assert old_id != new_id
        admit(d, prompt, params)
        out = d.until(lambda o: o.finished_recving)
        assert out.failed_recving == {"d-0"}
        assert any(f"rank 1 belongs to instance {new_id[:8]}, rank 0 to {old_id[:8]}" in r.getMessage()
                   for r in caplog.records)
        assert old_id not in receiver.connected_endpoints
    finally:
        d.shutdown()
        restarted.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fixed_endpoint_port_is_refused_under_tp_and_staging_endpoints_take_a_free_one():
    """backend_options.port at TP 2 would bind every rank's endpoint to it: refused at start,
    naming the key and the TP size. At TP 1 it is this rank's endpoint's; the staging endpoint
    of a pull from a TP 2 producer takes a free port, so the pull works."""
    from tests.connector.halves import SECRET
    from vllm_ext.connector.worker import WorkerHalf

    port = free_port()
    common = dict(backend="gloo", endpoint_host="127.0.0.1", endpoint_options={"port": port}, secret=SECRET,
                  pull_timeout_s=10.0, static_fields=dict(STATIC), connect_to=[])
    with pytest.raises(ValueError, match=rf"backend_options.port: a fixed port \({port}\) with "
                                         "tensor_parallel_size 2"):
        WorkerHalf(is_producer=True, is_consumer=False, tp_rank=1, tp_size=2, **common)
    p = instance(True, 2, seed=60)
    worker = WorkerHalf(is_producer=False, is_consumer=True, allowed_producers=["{}:{}".format(*p.sched.lease_address)],
                        **common)
    worker.register_kv_caches(vllm_layers(heads=HEADS, seed=70))
    sched = make_scheduler(False, policy="recompute")
    sched.set_handshake({0: worker.handshake()})
    d = Instance(sched, [worker], KVOutputAggregator(1))
    try:
        assert worker.endpoint.descriptor().port == port
        prompt = list(range(50))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        admit(d, prompt, params)
        out = d.until(lambda o: o.finished_recving)
        assert out.finished_recving == {"d-0"} and not out.failed_recving
        for got, want in zip(all_heads(d, [20, 21, 22, 23]), all_heads(p, params["remote_block_ids"])):
            assert torch.equal(got, want)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_rank_that_fails_before_its_acquire_still_releases_its_part_of_the_lease():
    """D's rank 1 has P in back-off (a pull of it failed just before): its receive fails at once,
    before any acquire. It still releases the lease for its rank (releases are not held back by
    back-off), so P's lease ends once rank 0 released too: P's lease clock stands still, so
    without that release it would never end (taken holds expire only on that clock)."""
    from tests.connector.halves import Clock

    clock = Clock()
    workers = [make_worker(vllm_layers(heads=HEADS // TP, seed=80 + rank), True, tp_rank=rank, tp_size=TP)
               for rank in range(TP)]
    sched = make_scheduler(True, policy="recompute", clock=clock)
    sched.set_handshake({rank: w.handshake() for rank, w in enumerate(workers)})
    p = Instance(sched, workers, KVOutputAggregator(TP))
    d = decode_instance(p)
    try:
        receiver = d.workers[1].receiver
        receiver._backoff[p.sched.lease_address] = time.monotonic() + 3600.0
        prompt = list(range(50))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        admit(d, prompt, params)
        out = d.until(lambda o: o.finished_recving)
        assert out.failed_recving == {"d-0"}
        stats = [w.get_stats().data for w in d.workers]
        assert [s["transfers"] for s in stats] == [1, 0] and [s["failed"] for s in stats] == [0, 1]
        assert p.until(lambda o: o.finished_sending).finished_sending == {"p-0"}  # both ranks released
    finally:
        d.shutdown()
        p.shutdown()
