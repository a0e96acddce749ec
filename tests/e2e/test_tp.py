"""Tensor parallelism end to end on CPU: two vLLM instances at tensor_parallel_size 2 (A and B,
kv_both, kv_load_failure_policy "recompute", each TP = 2 server computing on both cores of the
host: VLLM_CPU_OMP_THREADS_BIND "0|1"), the P/D proxy (A prefills, B decodes) and the router
(live migration between them), with the seeded random Llama of fleet.CPU (2 KV heads: one per
rank). Every rank's worker moves its own shard; the outputs (token ids and text) equal a single
instance's, each rank's transfers show in /metrics (tp_rank label), and no block stays leased
on either instance at the end.

Deadlines (generous on purpose, never assertions on speed): start-up 420 s per server, each
request 120 s, KV usage back to zero within LEASE_S + 15 s of the last request.
"""

import random
import threading
import time

import pytest

from tests.e2e.live_cluster import (
    Stream,
    fault_files,
    finish,
    migrate_async,
    pin_to,
    require_vllm,
    start_instance,
    start_router,
)
from vllm_ext import fleet

require_vllm()

TP = 2
LEASE_S = 30.0
MAX_TOKENS = 12
LIVE_MAX_TOKENS = 400  # long enough to be running when the move starts (within its first 20 tokens)
IDLE_TIMEOUT_S = LEASE_S + 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp")
    model = fleet.write_checkpoint(work / "model")
    fleet.write_word_tokenizer(model)
    ports = {name: fleet.free_port() for name in "AB"}
    faults = fault_files(work)  # none is ever created: the instances run as plain connectors
    started = []
    try:
        for name in "AB":
            started.insert(0, start_instance(name, model, work, core="0|1", lease_ports=ports, faults=faults,
                                             lease_s=LEASE_S, extra_args=("--tensor-parallel-size", str(TP))))
        b, a = started
        a.wait_healthy()
        b.wait_healthy()
        leases = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
        router = start_router(work, "router", [a.url, b.url], [leases["A"], leases["B"]])
        started.insert(0, router)
        proxy = fleet.start_proxy("proxy", [a.url], [b.url], work)
        started.insert(0, proxy)
        proxy.wait_healthy(timeout=60)
        yield {"A": a, "B": b, "router": router, "proxy": proxy, "work": work, "leases": leases}
    finally:
        fleet.stop_all(started)


def complete(url, prompt, max_tokens=MAX_TOKENS):
    status, body = fleet.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["choices"][0]["text"]


def rank_counters(url):
    """tp_rank -> (transfers, failed transfers) of the instance's connector, from /metrics."""
    out = {}
    for key, value in fleet.metrics(url).items():
        for name, i in (("vllm:vllm_ext_rank_transfers_total{", 0), ("vllm:vllm_ext_rank_failed_transfers_total{", 1)):
            if key.startswith(name):
                rank = int(key.split('tp_rank="')[1].split('"')[0])
                counts = out.setdefault(rank, [0, 0])
                counts[i] += int(value)
    return {rank: tuple(c) for rank, c in out.items()}


def delta(after, before):
    return {rank: tuple(a - b for a, b in zip(after[rank], before.get(rank, (0, 0)))) for rank in after}


def wait_idle(cluster):
    """Every instance's KV usage and P/D leases back to zero within the deadline."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    for name in "AB":
        while True:
            m = fleet.metrics(cluster[name].url)
            usage, leased = m["vllm:kv_cache_usage_perc"], m.get("vllm:vllm_ext_leased_blocks", 0.0)
            if usage == 0.0 and leased == 0.0:
                break
            assert time.monotonic() < deadline, f"{name}: KV usage {usage}, {leased} leased blocks after the requests"
            time.sleep(0.2)


def test_pd_between_tp2_instances_equals_a_single_instance(cluster):
    """Prompts of 1 to 4 blocks through the proxy: each of B's two ranks pulls its shard of every
    whole block before the last token from A's rank of the same number; the outputs equal A's own."""
    rng = random.Random(35)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (40, 70, 100, 129)]
    before = rank_counters(cluster["B"].url)
    for prompt in prompts:
        got = complete(cluster["proxy"].url, prompt)
        want = complete(cluster["A"].url, prompt)
        assert got == want, f"prompt of {len(prompt)} tokens: P/D {got} != single instance {want}"
    assert delta(rank_counters(cluster["B"].url), before) == {rank: (len(prompts), 0) for rank in range(TP)}
    wait_idle(cluster)


@pytest.mark.parametrize("source,destination", [("A", "B"), ("B", "A")])
def test_live_migration_between_tp2_instances(cluster, source, destination):
    """A request moved from one TP = 2 instance to the other mid-decode: the destination's ranks
    each load their shard of the moved blocks, and the client's tokens and text equal a single
    instance's."""
    rng = random.Random(36 + len(source))
    prompt = [rng.randrange(3, 1000) for _ in range(70)]
    before = rank_counters(cluster[destination].url)
    results = []
    s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": LIVE_MAX_TOKENS,
                                       "temperature": 0, "return_token_ids": True})
    pin = cluster[source].url
    undrained = threading.Event()  # the move waits until the destination takes requests again
    s.at(rng.randrange(5, 20), migrate_async(cluster, to=cluster[destination].url, results=results, after=undrained))

    def begin():  # the router places a new request on its own: on the source, the other draining
        s.start()
        assert s.first.wait(fleet.REQUEST_TIMEOUT_S)

    try:
        pin_to(cluster, cluster["router"], source, begin, [cluster[n].url for n in "AB"])
    finally:
        undrained.set()
    (status, record), = finish([s], results)
    assert s.error is None and status == 200, (s.error, status, record)
    assert record["outcome"] == "moved" and record["source"] == pin, record
    want_ids, want_text = complete(pin, prompt, LIVE_MAX_TOKENS)
    assert s.ids == want_ids and s.text == want_text
    moved = delta(rank_counters(cluster[destination].url), before)
    assert all(moved[rank][0] >= 1 and moved[rank][1] == 0 for rank in range(TP)), moved
    wait_idle(cluster)
