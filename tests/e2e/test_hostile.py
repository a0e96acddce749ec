"""Hostile clients and a saturated host, end to end (issue 34, the fronts' part): two vLLM
instances A and B (kv_both, kv_load_failure_policy "recompute", a small seeded random Llama)
behind both fronts at once: the P/D proxy (prefill A, decode B) and the router (A and B,
balancing). On CPU only (gloo).

What it shows: a request the decode server would refuse makes no lease, and every way a decode
leg fails (refused, unreachable, SIGSTOPped) frees the prefill lease at once; no backend's
kv_transfer_params, instance address or model path reaches a client; n > 1 through the proxy is
refused clearly; a client that stops reading holds no /migrate. Then a soak: for SOAK_S seconds
(default 60) many clients through both fronts, streamed and not, some hostile, some that stop
reading or leave, while A and B are SIGSTOPped and continued, or SIGKILLed and started again on
their ports, at random (one at a time, at least one kill): each answer is a single instance's
greedy output, complete, or a clear error a client can retry; at the end every instance's KV
cache is idle, no lease is left, and the fronts' memory stayed bounded.

Deadlines (generous on purpose, never assertions on speed): start-up 420 s per server, each
request 120 s, KV back to idle within KV_IDLE_S: far below LEASE_S, so that only released
leases (not expired ones) can pass.
"""

import json
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.live_cluster import TOKEN, admin
from vllm_ext import fleet

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import transformers  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")
    pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is missing")

ROOT = Path(__file__).resolve().parents[2]  # on the servers' PYTHONPATH: they import tests.e2e.live_faults
LEASE_S = 120.0  # an unreleased lease would hold its blocks this long
KV_IDLE_S = 30.0
MAX_TOKENS = 16
FIRST_BYTE_S = 3.0  # the proxy's, short: the SIGSTOP tests wait it out
SOAK_S = float(os.environ.get("SOAK_S", "60"))
SOAK_CLIENTS = 12
CORES = {"A": "0", "B": "1"}
SERVER_ENV = {"VLLM_EXT_TEST_STEP_PAUSE_S": "0.001"}  # live_faults only paces vLLM CPU's spinning engine


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    model = fleet.write_checkpoint(work / "model")
    fleet.write_word_tokenizer(model)
    ports = {name: fleet.free_port() for name in "AB"}
    started = []
    try:
        for name, core in CORES.items():  # kv_both
            other = [f"127.0.0.1:{p}" for n, p in ports.items() if n != name]
            started.insert(0, fleet.start_vllm(
                name, model, work, core=core, tokenizer=True, extra_pythonpath=str(ROOT), extra_env=SERVER_ENV,
                kv_config={"kv_connector": "LiveFaultConnector", "kv_connector_module_path": "tests.e2e.live_faults",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"lease_port": ports[name], "connect_to": other,
                                                         "lease_s": LEASE_S, "pull_timeout_s": 20.0}}))
        for server in started:
            server.wait_healthy()
        a, b = started[1], started[0]
        env = fleet.vllm_env("0")
        env["VLLM_EXT_ROUTER_TOKEN"] = TOKEN
        router = fleet.start_router("router", [a.url, b.url], [f"127.0.0.1:{ports[n]}" for n in "AB"], work, env=env,
                                    extra_args=("--balance", "--policy", "round_robin", "--health-interval-s", "0.5"))
        started.insert(0, router)
        router.wait_healthy(timeout=60)
        proxy = start_proxy(work, "proxy", [a.url], [b.url])
        started.insert(0, proxy)
        yield {"A": a, "B": b, "router": router, "proxy": proxy, "work": work, "model": model, "started": started}
    finally:
        for p in started:
            if p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGCONT)  # a stopped one must hear the SIGTERM
                except ProcessLookupError:
                    pass
            p.stop()


def start_proxy(work, name, prefill, decode):
    proc = fleet.start_proxy(name, prefill, decode, work, extra_args=("--first-byte-s", str(FIRST_BYTE_S)))
    deadline = time.monotonic() + 60
    while True:  # listening: /health answers (503 when a stage has no server up)
        try:
            with urllib.request.urlopen(proc.url + "/health", timeout=5):
                return proc
        except urllib.error.HTTPError:
            return proc
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline or proc.proc.poll() is not None:
                proc.stop()
                raise RuntimeError(f"{name} did not start:\n{proc.log_tail()}") from None
            time.sleep(0.5)


def complete(url, prompt, max_tokens=MAX_TOKENS, **extra):
    return fleet.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                                **extra})


def reference(hosts, prompt, max_tokens=MAX_TOKENS):
    status, body = complete(hosts["A"].url, prompt, max_tokens)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def leased_and_used(url):
    m = fleet.metrics(url)
    return m.get("vllm:vllm_ext_leased_blocks", 0.0), m.get("vllm:kv_cache_usage_perc", 0.0)


def assert_idle(hosts, names="AB", within_s=KV_IDLE_S):
    """Every instance's KV cache idle and no P/D lease left within `within_s` (far below LEASE_S)."""
    deadline = time.monotonic() + within_s
    for name in names:
        while True:
            leased, used = leased_and_used(hosts[name].url)
            if leased == 0 and used == 0:
                break
            assert time.monotonic() < deadline, f"{name}: {leased:g} blocks leased, KV {used:.3f} used after " \
                                                f"{within_s:g} s (an unreleased lease holds them {LEASE_S:g} s)"
            time.sleep(0.2)


class Refusing(threading.Thread):
    """A decode server that refuses every request (400), as vLLM does one it finds invalid."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked = 0

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                while len(rest) < length:
                    rest += conn.recv(65536)
                if not head.startswith(b"POST"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    continue
                self.asked += 1
                body = json.dumps({"error": {"message": "refused", "type": "BadRequestError", "code": 400}}).encode()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def test_what_the_decode_server_would_refuse_makes_no_lease(hosts):
    """The finding: `{"stream": false, "stream_options": {...}}` passed the prefill server (the
    proxy stripped stream_options for it) and was refused by the decode server's validation,
    where vLLM's rejection hook does not run: the prefill server kept the blocks leased. The
    proxy now refuses it first, as vLLM would (400), and no lease is made; n > 1 too."""
    prompt = list(range(100, 180))
    bodies = ({"stream": False, "stream_options": {"include_usage": True}}, {"n": 2}, {"max_tokens": -1})
    for extra in bodies:
        status, body = complete(hosts["proxy"].url, prompt, **extra)
        assert status == 400 and body["error"]["type"] == "BadRequestError", (extra, status, body)
    assert "Stream options can only be defined" in complete(hosts["proxy"].url, prompt, **bodies[0])[1]["error"][
        "message"]
    assert_idle(hosts, "A")


@pytest.mark.parametrize("decode", ["refuses", "unreachable", "stopped"])
def test_a_failed_decode_leg_frees_the_prefill_lease_at_once(hosts, decode):
    """A proxy whose decode server refuses every request, is not there, or is SIGSTOPped (B):
    the client gets a clear error (400, 503, 504) and A's lease is released at once, not after
    LEASE_S."""
    fake = Refusing() if decode == "refuses" else None
    if fake is not None:
        fake.start()
    url = {"refuses": fake.url if fake else "", "unreachable": f"http://127.0.0.1:{fleet.free_port()}",
           "stopped": hosts["B"].url}[decode]
    proxy = start_proxy(hosts["work"], f"proxy-{decode}", [hosts["A"].url], [url])
    try:
        if decode == "stopped":
            os.killpg(hosts["B"].proc.pid, signal.SIGSTOP)
        try:
            status, body = complete(proxy.url, [(7 * i + len(decode)) % 1000 + 3 for i in range(90)])
        finally:
            if decode == "stopped":
                os.killpg(hosts["B"].proc.pid, signal.SIGCONT)
        assert status == {"refuses": 400, "unreachable": 503, "stopped": 504}[decode], (status, body)
        assert url not in json.dumps(body)
        assert_idle(hosts, "A")
        assert "released: its decode leg failed" in proxy.log_tail(200), proxy.log_tail()
    finally:
        proxy.stop()
        if fake is not None:
            fake.sock.close()
    assert_idle(hosts)


def test_clients_get_no_backend_params_addresses_or_model_path(hosts):
    model_path = str(hosts["model"])
    for front in ("proxy", "router"):
        url = hosts[front].url
        status, body = complete(url, list(range(300, 340)))
        assert status == 200 and "kv_transfer_params" not in body, body
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            text = r.read().decode()
        assert "tiny" in text and model_path not in text, text
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            text = r.read().decode()
        assert hosts["A"].url not in text and hosts["B"].url not in text, text
    status, body = complete(hosts["router"].url, list(range(300, 340)), n=2, temperature=0.8, seed=3)  # as is
    assert status == 200 and len(body["choices"]) == 2 and "kv_transfer_params" not in body, body


def test_a_client_that_stops_reading_holds_no_migration(hosts):
    """The finding: a client that stopped reading held an admin /migrate for 113 s. A stream
    whose client reads nothing (a small receive buffer, full) is moved all the same: /migrate
    answers with the move's record."""
    prompt = list(range(400, 460))
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", hosts["router"].port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        rid, deadline = None, time.monotonic() + fleet.REQUEST_TIMEOUT_S
        while rid is None:  # read the head of the stream only, then nothing more
            data = sock.recv(4096).decode(errors="replace")
            if '"id": "' in data:
                rid = data.split('"id": "')[1].split('"')[0]
            assert time.monotonic() < deadline
        time.sleep(3)  # the router's writes to it now wait
        status, record = admin(hosts["router"], "/migrate", {"request_id": rid})
        assert status == 200 and record["outcome"] in ("moved", "recomputed", "finished"), record
    finally:
        sock.close()
    assert_idle(hosts)


# ---- the soak --------------------------------------------------------------------------------
SOAK_PROMPTS = 8


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.losses = []

    def add(self, kind, loss=None):
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if loss is not None:
                self.losses.append(loss)


def soak_client(hosts, refs, tally, stop_at, seed):
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        front = rng.choice(("proxy", "router"))
        url = hosts[front].url
        i = rng.randrange(SOAK_PROMPTS)
        prompt, want = refs[i]
        kind = rng.choices(["plain", "stream", "hostile", "leaves", "stalls"], [4, 4, 1, 1, 1])[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        try:
            if kind == "hostile":
                bad = rng.choice([{"stream": False, "stream_options": {"include_usage": True}}, {"n": 3},
                                  {"max_tokens": "x"}, {"prompt": "w " * (3 << 20)}])
                status, answer = fleet.post(url + "/v1/completions", dict(body, **bad), timeout=60)
                tally.add(f"{front} hostile {status}", None if status in (400, 413, 503) else
                          f"{front} hostile {bad.keys()} -> {status} {str(answer)[:200]}")
            elif kind in ("leaves", "stalls"):
                raw = json.dumps(dict(body, stream=True, max_tokens=200)).encode()
                with socket.create_connection(("127.0.0.1", hosts[front].port), timeout=30) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
                    s.recv(512)
                    time.sleep(rng.uniform(0.2, 3.0) if kind == "stalls" else 0.0)
                tally.add(f"{front} {kind}")
            else:
                stream = kind == "stream"
                status, ids, err = (post_stream if stream else post_plain)(url, body)
                if status == 200 and err is None:
                    tally.add(f"{front} {kind} right", None if ids == want else
                              f"{front} {kind}: {ids} != {want} (prompt {i})")
                elif status in (200, 502, 503, 504):  # an error event, or a clear error to retry
                    tally.add(f"{front} {kind} retryable {status}")
                else:
                    tally.add(f"{front} {kind} other {status}", f"{front} {kind}: status {status}: {err}")
        except (OSError, urllib.error.URLError) as e:
            if kind in ("leaves", "stalls"):
                tally.add(f"{front} {kind}")
            else:
                tally.add(f"{front} {kind} lost", f"{front} {kind}: {type(e).__name__}: {e}")


def post_plain(url, body):
    status, answer = fleet.post(url + "/v1/completions", body)
    if status != 200:
        return status, None, str(answer)[:300]
    choice = answer["choices"][0]
    complete_ = choice.get("finish_reason") == "length"
    return status, choice.get("token_ids"), None if complete_ else f"finish {choice.get('finish_reason')}"


def post_stream(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    ids, finish, err = [], None, None
    try:
        with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
            for event in fleet.events(r):
                if "error" in event:
                    err = event["error"]
                    continue
                for choice in event.get("choices") or []:
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as e:
        return e.code, None, e.read()[:300]
    if err is None and finish != "length":
        err = f"the stream ended without its finish ({finish})"
    return 200, ids, err


def restart(hosts, name, n):
    """`name`'s server started again after a kill, on the same ports and arguments (the fronts know
    its URL, its peer its lease channel); returns at once (wait_healthy waits)."""
    old = hosts[name]
    env = fleet.vllm_env(CORES[name], str(ROOT))
    env.update(SERVER_ENV)
    again = fleet.Process(f"{name}-again{n}", list(old.proc.args), env, hosts["work"] / f"{name}-again{n}.log",
                          old.port)
    hosts["started"].append(again)
    hosts[name] = again
    return again


def test_soak(hosts):
    """SOAK_S seconds of SOAK_CLIENTS clients through both fronts, while A and B are SIGSTOPped
    for a few seconds, or SIGKILLed and started again, at random (one instance at a time, at
    least one kill): no answer is wrong or incomplete, none is lost (each is right or a clear
    error to retry: the router recovers a killed instance's requests on the other, the proxy has
    no other prefill or decode server to try), every KV cache is idle and no lease is left at
    the end, and the fronts' memory stays bounded."""
    rng = random.Random(34)
    refs = []
    for _ in range(SOAK_PROMPTS):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(20, 120))]
        refs.append((prompt, reference(hosts, prompt)))
    fronts = {name: hosts[name].proc.pid for name in ("router", "proxy")}
    rss_before = {name: rss_kib(pid) for name, pid in fronts.items()}
    tally = Tally()
    start = time.monotonic()
    stop_at = start + SOAK_S
    clients = [threading.Thread(target=soak_client, args=(hosts, refs, tally, stop_at, k), daemon=True)
               for k in range(SOAK_CLIENTS)]
    for c in clients:
        c.start()
    faults, kills = [], 0
    restarting = None  # the killed instance, until it answers /health again
    while time.monotonic() < stop_at - 10:
        time.sleep(rng.uniform(3, 8))
        if restarting is not None and restarting.proc.poll() is None:
            try:
                with urllib.request.urlopen(restarting.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        faults.append(f"{restarting.name} healthy again at {time.monotonic() - start:.0f} s")
                        restarting = None
            except (urllib.error.URLError, OSError):
                pass
        up = [name for name in "AB" if restarting is None or hosts[name] is not restarting]
        name = rng.choice(up)
        at = time.monotonic() - start
        # a kill while both are up: at random, and at least once, before the soak's second half ends
        if restarting is None and (rng.random() < 0.3 or (kills == 0 and at > SOAK_S / 3)):
            hosts[name].kill()
            kills += 1
            faults.append(f"{name} killed at {at:.0f} s")
            restarting = restart(hosts, name, kills)
            continue
        pause = rng.uniform(1, 6)
        os.killpg(hosts[name].proc.pid, signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            os.killpg(hosts[name].proc.pid, signal.SIGCONT)
        faults.append(f"{name} stopped {pause:.1f} s at {at:.0f} s")
    for c in clients:
        c.join(SOAK_S + 2 * fleet.REQUEST_TIMEOUT_S)
    if restarting is not None:
        restarting.wait_healthy()
    rss_after = {name: rss_kib(pid) for name, pid in fronts.items()}
    total = sum(tally.counts.values())
    summary = {"seconds": SOAK_S, "requests": total, "faults": faults, "counts": dict(sorted(tally.counts.items())),
               "losses": tally.losses[:20], "rss_kib": {n: (rss_before[n], rss_after[n]) for n in fronts}}
    print("soak:", json.dumps(summary))
    (hosts["work"] / "soak.json").write_text(json.dumps(summary, indent=1))
    assert kills >= 1, summary
    assert not any(c.is_alive() for c in clients), summary
    assert not tally.losses, summary
    assert sum(v for k, v in tally.counts.items() if k.endswith(" right")) > 0, summary
    for name in fronts:
        assert rss_after[name] - rss_before[name] < 256 << 10, summary  # KiB: bounded, not a leak per request
    assert_idle(hosts, within_s=60.0)
