"""Live migration end to end, with real servers on 127.0.0.1: vLLM instances A and B (and C,
started by the three-instance test; kv_both, kv_load_failure_policy "recompute", a small seeded
random Llama with a word-level tokenizer, written by the test) behind the router, plus an
instance address where nothing listens (a dead instance, refused as a destination). On CPU
(gloo) and, marked gpu, on one GPU (ipc; fleet.DEVICES).

Every migrated request's greedy output equals a single instance's token for token (and its
text, and usage counts the prompt once); so does a seeded sampled one's. Faults: a destination
known to be down, a source and a destination killed during a migration, a stream broken under
a request, the router's connections to a live instance cut, a lease that expires before a slow
destination pulls, corrupted KV caught by the block digests; drain and the balancer; at the end
every live instance's KV usage is back to zero.

Deadlines (generous on purpose, never assertions on speed): start-up 420 s per server, each
request 120 s. The module's tests share the servers, in order; the last ones kill C.
"""

import json
import random
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.live_cluster import (
    Cuttable,
    Stream,
    admin,
    fault_files,
    finish,
    migrate_async,
    pin_to,
    require_vllm,
    start_instance,
    start_router,
)
from vllm_ext import fleet
from vllm_ext.fleet.servers import NO_BIND

require_vllm()

LEASE_S = 10.0  # short: the expiry test waits it out (a loaded 2-core host can take seconds per step)
# Long enough to be running when a migration starts (a tiny model decodes hundreds of tokens a
# second here; moves start within a client's first 40 tokens)
MAX_TOKENS = 1000
# The requests a drain or the balancer moves, one at a time: long enough that the last is still
# running when its turn comes on a loaded host (a first connection to a producer took 7 s there)
LONG_MAX_TOKENS = 1900
DRAIN_TIMEOUT_S = 15.0


@pytest.fixture(scope="module", params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def cluster(request, tmp_path_factory):
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"live-{device.name}")
    model = fleet.write_checkpoint(work / "model", device=device)
    fleet.write_word_tokenizer(model)
    ports = {name: fleet.free_port() for name in "ABCG"}
    faults = fault_files(work)
    started = []

    def start(name, core, *extra_args):
        server = start_instance(name, model, work, core=core, lease_ports=ports, faults=faults, lease_s=LEASE_S,
                                device=device, extra_args=extra_args)
        started.insert(0, server)
        return server

    try:
        # two instances for most tests (one core each: gloo's Python-side serving starves on a core
        # shared with a busy engine); the third (C) is started by the three-instance test
        a = start("A", "0")
        if device.sequential_start:  # vLLM sizes its cache from the GPU memory free when it starts
            a.wait_healthy()
        b = start("B", "1")
        a.wait_healthy()
        b.wait_healthy()
        dead = f"http://127.0.0.1:{fleet.free_port()}"
        router = start_router(work, "router", [a.url, b.url, dead],
                              [f"127.0.0.1:{ports['A']}", f"127.0.0.1:{ports['B']}", f"127.0.0.1:{fleet.free_port()}"])
        started.insert(0, router)
        yield {"A": a, "B": b, "router": router, "dead": dead, "work": work, **faults, "start": start,
               "leases": {n: f"127.0.0.1:{p}" for n, p in ports.items()}}
    finally:
        for p in started:
            p.stop()


def reference(cluster, prompt, max_tokens=MAX_TOKENS, url=None, **extra):
    """A single instance's greedy output (A's, or `url`'s, directly): (token ids, text). Where a
    moved request's destination must pull its KV, take the reference after the move, on its
    source: a destination that had run the prompt would find it all in its prefix cache."""
    status, body = fleet.post((url or cluster["A"].url) + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True, **extra})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["choices"][0]["text"]


def prompts(seed, lengths):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    out = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    return out + [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 29)]


def divergence(got, want) -> str:
    """Where two token lists part (an assertion's message)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"{len(got)} tokens for {len(want)}; first difference at {i}: {got[i:i + 4]} for {want[i:i + 4]}"


def wait_idle(cluster, names="AB"):
    """Every instance's KV usage back to zero (leases released or expired) within the deadline."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S + LEASE_S
    for name in names:
        while True:
            usage = fleet.metrics(cluster[name].url)["vllm:kv_cache_usage_perc"]
            if usage == 0.0:
                break
            assert time.monotonic() < deadline, f"{name}: KV usage {usage} after the requests ended"
            time.sleep(0.2)


def moved_kv_is_not_shared(url, prompt):
    """The KV a migration moved sits in the destination's prefix cache under the migration's own
    salt (a failed resume may leave wrong KV there): another request with the same prompt does
    not read it. Two plain requests: the second hits every complete block of the prompt (the
    first's); the first hits fewer (at most what other plain requests left there)."""
    def counters():
        m = fleet.metrics(url)
        return m.get("vllm:prefix_cache_queries_total", 0), m.get("vllm:prefix_cache_hits_total", 0)

    complete = (len(prompt) - 1) // fleet.BLOCK_SIZE * fleet.BLOCK_SIZE  # the last token is always computed
    if not complete:
        return
    queries, hits = counters()
    for _ in range(2):
        status, body = fleet.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert status == 200, body
    deadline = time.monotonic() + 30  # the counters follow the engine's steps
    while counters()[0] - queries < 2 * len(prompt) and time.monotonic() < deadline:
        time.sleep(0.1)
    got_queries, got_hits = counters()
    assert got_queries - queries == 2 * len(prompt)
    first = got_hits - hits - complete
    assert 0 <= first < complete, f"the first plain request hit {first} of {complete} tokens: the moved KV's blocks"


# ---- tests ------------------------------------------------------------------------------------
def test_migrated_requests_equal_unmigrated(cluster):
    """Requests moved at random points of their decode (pre-copy stages, then the stop) give the
    unmigrated tokens and text; the destination loaded the moved KV (its external hits rise)."""
    rng = random.Random(15)
    before = {n: fleet.metrics(cluster[n].url)["vllm:external_prefix_cache_hits_total"] for n in "AB"}
    outcomes = []
    for prompt in prompts(15, (5, 31, 33, 64, 150)):
        results = []
        s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "return_token_ids": True,
                                           "stream_options": {"include_usage": True}})
        s.at(rng.randrange(1, 40), migrate_async(cluster, results=results))
        s.start()
        (status, record), = finish([s], results)
        # on a busy host a request may end before its move reaches the router (404: no running
        # request; its tokens may come in one burst at the end) or the switch (it then stays);
        # one with no complete block yet (a short prompt moved early) is recomputed, as it should be
        if status == 404 and "no running request" in str(record) and len(s.ids) == MAX_TOKENS:
            record = {"outcome": "finished", "reason": "ended before the move reached the router"}
        assert s.error is None and (status == 200 or record["outcome"] == "finished"), (s.error, record)
        assert record["outcome"] in ("moved", "finished") or (
            record["outcome"] == "recomputed" and "no complete block" in record["reason"]), record
        outcomes.append(record["outcome"])
        if record["outcome"] in ("moved", "recomputed"):  # the destination traced the resume (one host: one clock)
            spans = record["resume_spans"]
            # a resume that loaded KV also says how long its first token waited for the load's check
            assert set(spans) == {"to_api_server_ms", "to_scheduler_ms", "to_scheduled_ms", "to_first_token_ms",
                                  *(["load_check_ms"] if record["outcome"] == "moved" else [])}, record
            assert spans.get("load_check_ms", 0) >= 0, record
            assert spans["to_scheduled_ms"] >= 0 and spans["to_scheduler_ms"] >= 0, record
        if record["outcome"] == "moved":
            moved_kv_is_not_shared(record["destination"], prompt)
        want_ids, want_text = reference(cluster, prompt, MAX_TOKENS, url=record.get("source"))
        assert s.ids == want_ids and s.text == want_text
        assert s.usage == {"prompt_tokens": len(prompt), "completion_tokens": len(want_ids),
                           "total_tokens": len(prompt) + len(want_ids)}
    after = {n: fleet.metrics(cluster[n].url)["vllm:external_prefix_cache_hits_total"] for n in "AB"}
    moved = outcomes.count("moved")
    assert moved >= len(outcomes) // 2, outcomes
    assert sum(after.values()) - sum(before.values()) >= 32 * moved  # each moved at least one block of KV
    wait_idle(cluster)


def test_chat_stop_strings_and_a_second_migration(cluster):
    """A chat stream with a stop string, moved there and back: the text ends where a single
    instance's ends, with the same finish. The stop string is the pair of words of the output
    first seen latest (it may come before the second move: that move then finds it ended)."""
    prompt = " ".join(f"w{t}" for t in prompts(16, (40,))[0])
    messages = [{"role": "user", "content": prompt}]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, ref = fleet.post(cluster["A"].url + "/v1/chat/completions", body)
    assert status == 200
    text = ref["choices"][0]["message"]["content"]
    words = text.split()
    pairs = {" ".join(words[i:i + 2]) for i in range(len(words) - 1)}
    stop = max(pairs, key=text.find)
    assert text.find(stop) > len(text) // 10, "the model's output repeats from its start: pick another prompt"
    status, ref = fleet.post(cluster["A"].url + "/v1/chat/completions", dict(body, stop=[stop]))
    assert ref["choices"][0]["finish_reason"] == "stop" and ref["choices"][0]["stop_reason"] == stop
    records = []
    s = Stream(cluster["router"].url, dict(body, stop=[stop]), path="/v1/chat/completions")

    def twice(rid):  # there and back, one after the other
        def go():
            for _ in range(2):  # no pre-copy: the switch comes at once (the stop string may come early)
                records.append(admin(cluster["router"], "/migrate", {"request_id": rid, "stages": 0}))
        t = threading.Thread(target=go, daemon=True)
        t.start()
        records.append(t)
    s.at(2, twice)
    s.start()
    records = finish([s], records)
    assert s.error is None
    assert records[0] == (200, records[0][1]) and records[0][1]["outcome"] == "moved", records
    assert records[1][0] == 404 or records[1][1]["outcome"] in ("moved", "finished"), records
    assert s.text == ref["choices"][0]["message"]["content"] and s.finish == "stop"
    wait_idle(cluster)  # the router's stop string ended the request on its instance too


def test_a_non_streaming_request_migrates(cluster):
    prompt = prompts(17, (70,))[0]
    want_ids, want_text = reference(cluster, prompt, logprobs=1)
    box = {}

    def call():
        box["answer"] = fleet.post(cluster["router"].url + "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True})
    t = threading.Thread(target=call, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while True:
        running = admin(cluster["router"], "/requests")[1]["running"]
        if running and running[0]["generated"] >= 3:
            break
        assert time.monotonic() < deadline and t.is_alive(), "the request did not start"
        time.sleep(0.01)
    status, record = admin(cluster["router"], "/migrate", {"request_id": running[0]["request_id"]})
    t.join(fleet.REQUEST_TIMEOUT_S)
    assert status == 200 and record["outcome"] == "moved", record
    status, answer = box["answer"]
    assert status == 200
    choice = answer["choices"][0]
    assert choice["token_ids"] == want_ids and choice["text"] == want_text
    assert len(choice["logprobs"]["token_logprobs"]) == len(want_ids)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    wait_idle(cluster)


def test_a_seeded_request_moved_twice_keeps_its_random_stream(cluster):
    """Sampled (temperature 1, a seed), moved there and back at random points: the tokens equal
    a single instance's for that seed, and another seed gives others (the stream is the seed's)."""
    rng = random.Random()
    prompt = prompts(26, (45,))[0]
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True, **sampling}
    other_ids, _ = reference(cluster, prompt, **dict(sampling, seed=sampling["seed"] + 1))
    records = []

    def twice(rid):
        def go():
            for stages in (rng.randrange(0, 3), 0):
                records.append(admin(cluster["router"], "/migrate", {"request_id": rid, "stages": stages}))
        t = threading.Thread(target=go, daemon=True)
        t.start()
        records.append(t)
    s = Stream(cluster["router"].url, body)
    s.at(rng.randrange(2, 40), twice)
    s.start()
    records = finish([s], records)
    want_ids, want_text = reference(cluster, prompt, **sampling)
    assert s.error is None and records[0][0] == 200 and records[0][1]["outcome"] == "moved", records
    assert records[1][0] == 404 or records[1][1]["outcome"] in ("moved", "finished"), records
    assert s.ids == want_ids and s.text == want_text
    assert other_ids != want_ids
    wait_idle(cluster)


def test_a_stop_token_held_back_by_min_tokens_across_a_move(cluster):
    """stop_token_ids and min_tokens straddling the hand-off: the destination keeps the stop
    token masked until min_tokens (counted from the request's start), then stops on it, as a
    single instance does. The stop token first comes, in the free greedy output, where
    min_tokens still masks it (the output then goes another way); the move comes before."""
    rng = random.Random(28)
    prompt = prompts(28, (50,))[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 300, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    free, _ = reference(cluster, prompt, 300)
    # (where it first comes, the token), the most frequent first: one that comes again once masked
    firsts = sorted(((j, t) for j, t in enumerate(free) if j >= 8 and t not in free[:j]),
                    key=lambda jt: -free.count(jt[1]))
    for j, t in firsts[:20]:
        rule = {"stop_token_ids": [t], "min_tokens": j + 1}
        status, ref = fleet.post(cluster["A"].url + "/v1/completions", dict(body, **rule))
        assert status == 200, ref
        if ref["choices"][0]["finish_reason"] == "stop" and len(ref["choices"][0]["token_ids"]) > j + 10:
            break
    else:
        raise AssertionError("no stop token of the free output comes again once masked: pick another prompt")
    want = ref["choices"][0]["token_ids"]
    assert want[:j] == free[:j] and want[j] != t and want[-1] == t and len(want) > j + 1
    for _ in range(3):  # on a busy host the request may end before its move reaches it: again
        results = []
        s = Stream(cluster["router"].url, dict(body, **rule))
        s.at(rng.randrange(2, max(3, j // 2)), migrate_async(cluster, results=results, stages=0))  # switch at once
        s.start()
        (status, record), = finish([s], results)
        assert s.error is None and s.ids == want and s.finish == "stop", (s.error, divergence(s.ids, want), record)
        if status == 200 and record["outcome"] != "finished":
            assert record["outcome"] == "moved" or (record["outcome"] == "recomputed" and "no complete block"
                                                    in record["reason"]), record
            break
        assert (status == 404 and "no running request" in str(record)) or record["outcome"] == "finished", record
    else:
        raise AssertionError("the request ended before each of three moves reached it")
    wait_idle(cluster)


def test_requests_that_cannot_move_are_refused_by_name(cluster):
    body = {"model": "tiny", "prompt": prompts(18, (20,))[0], "max_tokens": MAX_TOKENS, "temperature": 0.7,
            "frequency_penalty": 0.5}
    s = Stream(cluster["router"].url, body)
    s.start()
    s.first.wait(60)
    status, running = admin(cluster["router"], "/requests")
    finish([s])
    # relayed as is (not held by the router): never among the movable requests (an unmovable one
    # is listed under the router's relay key, with its reason)
    assert status == 200 and all(r["request_id"] != s.rid for r in running["running"]) and s.error is None
    assert all(not r["migratable"] and r["why_not"] for r in running["running"] if r["request_id"].startswith("relay-"))
    assert s.rid.startswith("cmpl-") and len(s.ids) == 0  # the instance's own stream, untouched


def test_migration_to_a_dead_destination_keeps_the_request(cluster):
    """The router has marked the dead instance down: /migrate refuses it (409, naming `to`) and the
    request goes on, unmoved, on its instance. (A destination that dies during a move is the
    three-instance test's.)"""
    deadline = time.monotonic() + 30
    while True:  # the router's watch marks it down at its first failed poll
        status, listed = admin(cluster["router"], "/instances")
        assert status == 200, listed
        if not next(i for i in listed if i["url"] == cluster["dead"])["healthy"]:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
    prompt = prompts(19, (50,))[0]
    want_ids, _ = reference(cluster, prompt)
    results = []
    s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "return_token_ids": True})
    s.at(5, migrate_async(cluster, to=cluster["dead"], results=results))
    s.start()
    (status, body), = finish([s], results)
    assert status == 409 and "to" in body["error"]["message"] and "down" in body["error"]["message"], body
    assert s.error is None and s.ids == want_ids
    _, listed = admin(cluster["router"], "/requests")
    assert not any(m["request_id"] == s.rid for m in listed["migrations"]), listed
    wait_idle(cluster)


def test_corrupted_kv_is_caught_and_recomputed(cluster):
    """The destination's pulls of the final lease return noise: both differ from the source's
    digests, it recomputes, and the output is still right."""
    prompt = prompts(20, (90,))[0]
    results = []

    def corrupt_then_migrate(rid):
        cluster["corrupt"].touch()
        migrate_async(cluster, results=results, stages=0)(rid)
    before = {n: fleet.metrics(cluster[n].url).get("vllm:vllm_ext_digest_mismatches_total", 0) for n in "AB"}
    s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "return_token_ids": True})
    s.at(8, corrupt_then_migrate)
    s.start()
    try:
        (status, record), = finish([s], results)
    finally:
        cluster["corrupt"].unlink(missing_ok=True)
    want_ids, _ = reference(cluster, prompt, url=record["source"])
    assert status == 200 and s.error is None and s.ids == want_ids, (record, s.error, divergence(s.ids, want_ids))
    after = {n: fleet.metrics(cluster[n].url).get("vllm:vllm_ext_digest_mismatches_total", 0) for n in "AB"}
    assert sum(after.values()) - sum(before.values()) == 2
    # nothing moved: recomputed in place (one step at a time, CPU), or dropped and recomputed
    # (a step in flight, GPU)
    assert record["outcome"] == "failed" or (record["outcome"] == "recomputed" and record["moved_tokens"] == 0), record
    wait_idle(cluster)


def test_a_lease_that_expires_before_the_pull_is_recomputed(cluster):
    """The destination's load fails (the lease expired while it waited) and says so as an engine
    with a step in flight does: the router drops what it sent and recomputes the request."""
    prompt = prompts(21, (60,))[0]
    expired_before = sum(fleet.metrics(cluster[n].url)["vllm:vllm_ext_expired_leases_total"] for n in "AB")
    cluster["delay"].write_text(str(LEASE_S + 3))
    cluster["unsafe"].touch()
    results = []
    try:
        s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "return_token_ids": True})
        s.at(5, migrate_async(cluster, results=results, stages=0))
        s.start()
        (status, record), = finish([s], results)
    finally:
        cluster["delay"].unlink(missing_ok=True)
        cluster["unsafe"].unlink(missing_ok=True)
    want_ids, _ = reference(cluster, prompt, url=record["source"])
    assert status == 200 and s.error is None and s.ids == want_ids, (record, s.error, divergence(s.ids, want_ids))
    assert record["outcome"] == "failed", record  # dropped at the destination, continued by recomputing
    wait_idle(cluster)
    expired_after = sum(fleet.metrics(cluster[n].url)["vllm:vllm_ext_expired_leases_total"] for n in "AB")
    assert expired_after - expired_before >= 1


def start_streams(router, prompts_, max_tokens=MAX_TOKENS):
    """Greedy streams of `prompts_` through `router`, one after the other, each once the one
    before has its first token."""
    out = []
    for p in prompts_:
        s = Stream(router.url, {"model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True})
        s.start()
        s.first.wait(60)
        out.append(s)
    return out


def until_generated(streams_, k):
    """Waits until each of `streams_` has k tokens (within a minute, all still running)."""
    deadline = time.monotonic() + 60
    for s in streams_:
        while len(s.ids) < k:
            assert time.monotonic() < deadline and s.is_alive(), (s.error, len(s.ids))
            time.sleep(0.01)


def test_drain_moves_every_running_request(cluster):
    router = cluster["router"]
    ps = prompts(22, (20, 45, 77))
    refs = [reference(cluster, p, LONG_MAX_TOKENS)[0] for p in ps]

    streams_ = pin_to(cluster, router, "A", lambda: start_streams(router, ps, LONG_MAX_TOKENS),
                      [cluster["A"].url, cluster["B"].url, cluster["dead"]])
    status, report = admin(router, "/drain", {"instance": cluster["A"].url})
    admin(router, "/undrain", {"instance": cluster["A"].url})
    finish(streams_)
    assert status == 200 and report["left"] == [], report
    # a request that ends before its turn is not moved, one whose turn comes before its first
    # complete block is recomputed there (nothing to move); every other one is moved
    moved = [m for m in report["migrations"] if m["outcome"] == "moved"]
    assert moved and all(m["outcome"] in ("moved", "finished") or
                         m["outcome"] == "recomputed" and "no complete block" in m["reason"]
                         for m in report["migrations"]), report
    assert all(s.error is None for s in streams_), [s.error for s in streams_]
    assert [s.ids for s in streams_] == refs, [divergence(s.ids, r) for s, r in zip(streams_, refs)]
    wait_idle(cluster)


def test_the_balancer_moves_load_off_the_busiest_instance(cluster):
    work = cluster["work"]
    router = start_router(work, "balancer", [cluster["A"].url, cluster["B"].url],
                          [cluster["leases"][n] for n in "AB"], "--balance", "--balance-threshold", "2",
                          "--balance-interval-s", "0.1")
    try:
        ps = prompts(23, (30, 50, 70, 90))
        refs = [reference(cluster, p, LONG_MAX_TOKENS)[0] for p in ps]
        admin(router, "/drain", {"instance": cluster["B"].url})
        streams_ = start_streams(router, ps, LONG_MAX_TOKENS)
        admin(router, "/undrain", {"instance": cluster["B"].url})
        finish(streams_)
        history = admin(router, "/requests")[1]["migrations"]
    finally:
        router.stop()
    assert [s.ids for s in streams_] == refs and all(s.error is None for s in streams_)
    # the first move is off the busy instance (later ones may even the load back as requests end)
    moved = [m for m in history if m["outcome"] == "moved"]
    assert moved and moved[0]["source"] == cluster["A"].url, history
    wait_idle(cluster)


@pytest.mark.parametrize("how", ["cut", "frozen"])
def test_a_connection_the_router_loses_is_continued_elsewhere(cluster, how):
    """The router reaches A through a proxy, which cuts every connection while A streams a
    request and refuses new ones ("cut"), or passes nothing and sends no FIN or RST ("frozen":
    the router finds it by its failing polls, after --silent-s): the request continues on B
    (recomputed from the router's tokens) with the unmigrated output; A, alive all along, aborts
    the request it can no longer send once its connections are cut (its KV usage goes back to
    zero); the router marks A down, and back up once the proxy lets it through again."""
    a_port = int(cluster["A"].url.rsplit(":", 1)[1])
    proxy = Cuttable(a_port)
    proxy.start()
    router = start_router(cluster["work"], "cut", [proxy.url, cluster["B"].url],
                          [cluster["leases"][n] for n in "AB"], "--health-timeout-s", "2", "--silent-s", "5")
    try:
        prompt = prompts(26, (64,))[0]
        want_ids, _ = reference(cluster, prompt)
        admin(router, "/drain", {"instance": cluster["B"].url, "timeout_s": 0})  # it goes to A
        s = Stream(router.url, {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "return_token_ids": True})
        s.at(10, lambda rid: proxy.cut() if how == "cut" else proxy.freeze())
        s.start()
        s.first.wait(60)
        admin(router, "/undrain", {"instance": cluster["B"].url})
        finish([s])
        assert s.error is None and s.ids == want_ids, (s.error, divergence(s.ids, want_ids))
        proxy.cut()  # (frozen: the partition ends with its connections reset)
        wait_idle(cluster, "AB")  # A aborted the request whose connection was cut

        def until(healthy):  # the router's view of A (through the proxy) and B, polled each 0.5 s
            deadline = time.monotonic() + 30
            while True:
                listed = admin(router, "/instances")[1]
                if [i["healthy"] for i in listed] == [healthy, True]:
                    return
                assert time.monotonic() < deadline, listed
                time.sleep(0.2)
        until(False)
        proxy.restore()
        until(True)
    finally:
        router.stop()
        proxy.close()


def test_a_moved_request_keeps_the_generation_configs_output_limit(cluster):
    """G serves with a generation config that limits output (--override-generation-config
    max_new_tokens 1000: the default of a request without a limit, and the cap of every request);
    B has none. A chat request without a limit and a completions request asking for more, each
    begun on G and moved to B at a random point, end at G's 1000 tokens ("length"), with the
    unmigrated output; a resumed leg under B's own limits would run on to the model's length."""
    limit = 1000
    g = cluster["G"] = cluster["start"]("G", "0", "--override-generation-config",
                                        json.dumps({"max_new_tokens": limit}))
    try:
        g.wait_healthy()
        urls = [g.url, cluster["B"].url]
        router = start_router(cluster["work"], "routerG", urls, [cluster["leases"][n] for n in "GB"])
        try:
            rng = random.Random(27)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": " ".join(
                f"w{t}" for t in prompts(27, (30,))[0])}], "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
            unstreamed = {k: v for k, v in chat.items() if k != "stream_options"}
            status, ref = fleet.post(g.url + "/v1/chat/completions", unstreamed)
            assert status == 200 and ref["usage"]["completion_tokens"] == limit, ref
            prompt = prompts(28, (50,))[0]
            want_ids, _ = reference(cluster, prompt, limit + 500, url=g.url)
            assert len(want_ids) == limit
            completion = {"model": "tiny", "prompt": prompt, "max_tokens": limit + 500, "temperature": 0,
                          "ignore_eos": True, "return_token_ids": True}
            for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
                results, undrained = [], threading.Event()

                def begin(body=body, path=path, results=results, undrained=undrained):
                    # on G: its first token came before B takes new requests again; the move to B
                    # waits until it does (a fast stream reaches its move point before: 409)
                    s = Stream(router.url, body, path).at(rng.randrange(40, 120), migrate_async(
                        cluster, to=cluster["B"].url, results=results, router=router, after=undrained, stages=0))
                    s.start()
                    assert s.first.wait(60), "no first token in 60 s"
                    return s
                s = pin_to(cluster, router, "G", begin, urls)
                undrained.set()
                (status, record), = finish([s], results)
                assert s.error is None and status == 200 and record["outcome"] == "moved", (s.error, record)
                assert s.finish == "length", s.finish
                if path == "/v1/completions":
                    assert s.ids == want_ids
                else:
                    assert s.text == ref["choices"][0]["message"]["content"]
                    assert s.usage["completion_tokens"] == limit, s.usage
        finally:
            router.stop()
    finally:
        g.stop()
        del cluster["G"]
    wait_idle(cluster, "AB")


def test_three_instances_drain_and_instances_killed_mid_migration(cluster):
    """A third instance, C, and a router over all three: a drain of A spreads its requests over
    B and C; then C is killed while it is the source of a move to A (C has stopped the request,
    A waits to pull it) and the destination of one from B (B has stopped it, C waits to pull
    it), with a third request only streaming from it: all three finish elsewhere with the
    unmigrated tokens, none lost or doubled, and B's lease on its blocks is let go."""
    # C is bound to no core: vLLM CPU binds every thread of a worker, ours included, to its cores,
    # and a worker spins between steps; bound beside A, C's pulls from A starved (20 s pull
    # deadlines, a drain past 120 s in CI)
    c = cluster["start"]("C", NO_BIND)
    c.wait_healthy()
    cluster["C"] = c
    # a fresh CPU server's first request takes seconds (lazy start-up): not in the first timed move
    reference(cluster, prompts(99, (40,))[0], 16, url=c.url)
    urls = [cluster[n].url for n in "ABC"]
    router = start_router(cluster["work"], "router3", urls, [cluster["leases"][n] for n in "ABC"])
    try:
        ps = prompts(24, (20, 45, 77, 101))[:4]
        n = LONG_MAX_TOKENS  # every request still runs when it is moved or its instance is killed
        refs = [reference(cluster, p, n)[0] for p in ps]
        drained = pin_to(cluster, router, "A", lambda: start_streams(router, ps, n), urls)
        # each has complete blocks to lease (the first prompt is under one block: moved at once it
        # would be recomputed, with nothing to move)
        until_generated(drained, 2 * fleet.BLOCK_SIZE)
        status, report = admin(router, "/drain", {"instance": cluster["A"].url})
        admin(router, "/undrain", {"instance": cluster["A"].url})
        assert status == 200 and report["left"] == [], report
        # spread over B and C (each move to the least loaded); KV moved in at least one. A move
        # may end "finished" (the request ended on A first: on this 2-core host a pull can wait
        # out its deadline) or "recomputed", saying why (a pull that failed so); the moves' data
        # path is the two-instance tests' subject
        moves = [(m["destination"], m["outcome"], m["reason"], m["state"], m["stages"]) for m in report["migrations"]]
        assert {m["destination"] for m in report["migrations"]} == {cluster["B"].url, c.url}, moves
        assert "moved" in {m["outcome"] for m in report["migrations"]}, moves
        assert all(m["outcome"] in ("moved", "finished") or m["outcome"] == "recomputed" and m["reason"]
                   for m in report["migrations"]), moves
        finish(drained)
        assert [s.ids for s in drained] == refs and all(s.error is None for s in drained)

        out_of = pin_to(cluster, router, "C", lambda: start_streams(router, ps[:1], n), urls)
        incoming = pin_to(cluster, router, "B", lambda: start_streams(router, ps[2:3], n), urls)
        assert all(s.is_alive() for s in out_of + incoming)
        out_of_c, into_c = [], []

        def held(name, stream):  # the pull of `name` waits (the delay fault): the move is under way
            waiting, deadline = Path(f"{cluster['delay']}.{name}.waiting"), time.monotonic() + 60
            while not waiting.exists():
                assert time.monotonic() < deadline and stream.is_alive(), (
                    f"{name} did not start to pull", stream.error, len(stream.ids), into_c, out_of_c)
                time.sleep(0.01)

        # each destination waits before its pull, its engine with it (C is killed then); a source
        # must step within 2 s to grant its lease, so each move has a source that is not held, and
        # B (the second source) has a core of its own while A's engine spins on its held worker
        # C's request has complete blocks to lease (its prompt is under one block: a move right
        # after its first token would have nothing to pull, and recompute)
        until_generated(out_of, 2 * fleet.BLOCK_SIZE)
        cluster["delay"].write_text("15")
        try:
            # C as the source: it has stopped its request, A waits to pull it from C
            migrate_async(cluster, to=cluster["A"].url, results=out_of_c, router=router, stages=0)(out_of[0].rid)
            held("A", out_of[0])
            # a request only streaming from C (started now: it runs when C is killed)
            streams_ = out_of + pin_to(cluster, router, "C", lambda: start_streams(router, ps[1:2], n), urls)
            # C as the destination: B has stopped the request, C waits to pull it
            migrate_async(cluster, to=c.url, results=into_c, router=router, stages=0)(incoming[0].rid)
            held("C", incoming[0])
            assert streams_[1].is_alive()
            c.kill()
            (status, record), = finish(streams_ + incoming, into_c)
            (out_status, out_record), = finish([], out_of_c)
        finally:
            cluster["delay"].unlink(missing_ok=True)
        assert all(s.error is None for s in streams_ + incoming), [s.error for s in streams_ + incoming]
        assert [s.ids for s in streams_ + incoming] == refs[:3]
        # the stop came, C never resumed it: continued (recomputed) where it was
        assert status == 200 and record["outcome"] == "failed" and record["destination"] == c.url, record
        # A's pull from the dead C failed: A recomputed it in place (an engine that schedules one
        # step at a time; A's trace says the load failed), or the router dropped that leg and
        # recomputed it (asynchronous scheduling); never recorded as moved
        assert out_status == 200 and out_record["source"] == c.url and out_record["outcome"] in (
            "recomputed", "failed") and out_record["stop_tokens"] > 0, out_record
    finally:
        router.stop()
    wait_idle(cluster, "AB")


def test_servers_keep_answering_and_no_block_is_leaked(cluster):
    prompt = prompts(25, (33,))[0]
    s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
                                       "return_token_ids": True})
    s.start()
    finish([s])
    assert s.error is None and s.ids == reference(cluster, prompt, 20)[0]
    wait_idle(cluster, "AB")
