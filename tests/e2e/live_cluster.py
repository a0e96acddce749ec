"""The live-migration tests' cluster and client (test_live.py, test_real_text.py): vLLM
instances (kv_both, kv_load_failure_policy "recompute", the test-only LiveFaultConnector of
live_faults.py) behind the router, the router's admin API, a streamed client that acts at its
k-th token, and a TCP proxy whose connections can be cut."""

import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_ext import fleet

# The servers import the test-only fault connector as tests.e2e.<module>, from the repository root
# (the folder holding tests/) on their PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]

TOKEN = "live-tests-admin-token"
STEP_PAUSE_S = "0.001"


def require_vllm():
    """At a test module's import: skips it where vLLM is not installed, fails it where it must be
    (make test-connector sets VLLM_EXT_REQUIRE_VLLM=1)."""
    if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")
        pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is missing")


def require_vllm_found():
    """require_vllm for a module that only starts servers: vLLM and transformers found, not
    imported (that takes 10-30 s); skips the module where they are missing, fails it where they
    must be (make test-connector)."""
    import importlib.util

    missing = [name for name in ("vllm", "transformers") if importlib.util.find_spec(name) is None]
    if missing and os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":
        raise ImportError(f"{' and '.join(missing)} not installed for {sys.executable}")
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed here (make test-connector installs vllm)",
                    allow_module_level=True)


def start_instance(name, model, work, *, core, lease_ports, faults, lease_s, device=fleet.CPU, extra_args=()):
    """A kv_both instance `name` of `model` whose lease channel listens on lease_ports[name] and
    dials the others'; `faults` names the files that switch live_faults.py's faults on. Returns
    at once (wait_healthy waits)."""
    others = [f"127.0.0.1:{p}" for n, p in lease_ports.items() if n != name]
    return fleet.start_vllm(
        name, model, work, core=core, tokenizer=True, device=device, extra_args=extra_args,
        extra_pythonpath=str(ROOT),
        extra_env={"VLLM_EXT_TEST_CORRUPT": str(faults["corrupt"]),
                   "VLLM_EXT_TEST_PULL_DELAY": str(faults["delay"]),
                   "VLLM_EXT_TEST_UNSAFE_LOADS": str(faults["unsafe"]),
                   "VLLM_EXT_TEST_SERVER": name,
                   # vLLM CPU's spinning engine would starve its API server (live_faults.py)
                   "VLLM_EXT_TEST_STEP_PAUSE_S": STEP_PAUSE_S if device.name == "cpu" else "0"},
        kv_config={"kv_connector": "LiveFaultConnector", "kv_connector_module_path": "tests.e2e.live_faults",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"lease_port": lease_ports[name], "connect_to": others,
                                                 "lease_s": lease_s, "pull_timeout_s": 20.0}})


def start_pair(work, model, *, lease_s, extra_args=(), router_args=(), proxy=False, device=fleet.CPU):
    """Instances A (core 0) and B (core 1) of `model` (start_instance) behind a router (its
    `router_args`) and, with `proxy`, the P/D proxy (A prefills, B decodes); yields the cluster
    (A, B, router, proxy, work, leases: name -> host:port, model, device) and stops it all at the
    end. On a GPU (`device`: fleet.DEVICES) both share it, started one after the other."""
    ports = {name: fleet.free_port() for name in "AB"}
    faults = fault_files(work)
    started = []
    try:
        for name, core in (("A", "0"), ("B", "1")):
            started.insert(0, start_instance(name, model, work, core=core, lease_ports=ports, faults=faults,
                                             lease_s=lease_s, device=device, extra_args=extra_args))
            if device.sequential_start:  # vLLM sizes its cache from the GPU memory free when it starts
                started[0].wait_healthy()
        b, a = started
        a.wait_healthy()
        b.wait_healthy()
        leases = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
        router = start_router(work, "router", [a.url, b.url], [leases["A"], leases["B"]], *router_args)
        started.insert(0, router)
        cluster = {"A": a, "B": b, "router": router, "work": work, "leases": leases, "model": model,
                   "device": device, **faults}
        if proxy:
            cluster["proxy"] = fleet.start_proxy("proxy", [a.url], [b.url], work, device=device)
            started.insert(0, cluster["proxy"])
            cluster["proxy"].wait_healthy(timeout=60)
        yield cluster
    finally:
        fleet.stop_all(started)


def fault_files(work):
    """The files that switch live_faults.py's faults on (none exists yet)."""
    return {"corrupt": work / "corrupt-now", "delay": work / "delay-now", "unsafe": work / "unsafe-now"}


def start_router(work, name, urls, leases, *extra):
    port = fleet.free_port()
    env = fleet.vllm_env("0")
    env["VLLM_EXT_ROUTER_TOKEN"] = TOKEN
    proc = fleet.Process(name, [sys.executable, "-m", "vllm_ext.router", "--instance", *urls, "--lease", *leases,
                            "--port", str(port), "--policy", "round_robin", "--health-interval-s", "0.5", *extra],
                     env, work / f"{name}.log", port)
    try:
        proc.wait_healthy(timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc


def complete(url, prompt, max_tokens):
    """A greedy completion of token ids `prompt` on the tiny model: (token ids, text)."""
    status, body = fleet.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["choices"][0]["text"]


def admin(router, path, body=None):
    req = urllib.request.Request(router.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Stream(threading.Thread):
    """A streamed request through the router; `at(k, fn)` calls fn(request id) once k tokens came."""

    def __init__(self, url, body, path="/v1/completions"):
        super().__init__(daemon=True)
        # ignore_eos: as the references (a request must still run when it is moved)
        self.url, self.body, self.path = url, dict(body, stream=True, ignore_eos=True), path
        self.ids, self.text, self.rid, self.usage, self.error = [], "", None, None, None
        self.finish = None
        self.choices = []  # every choice of every event, as it came
        self.hooks = []
        self.first = threading.Event()

    def at(self, k, fn):
        self.hooks.append([k, fn])
        return self

    def run(self):
        try:
            req = urllib.request.Request(self.url + self.path, data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=fleet.REQUEST_TIMEOUT_S) as r:
                for event in fleet.events(r):
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    self.rid = event["id"]
                    self.first.set()
                    if event.get("usage"):
                        self.usage = event["usage"]
                    self.choices += event["choices"]
                    for choice in event["choices"]:
                        self.ids += choice.get("token_ids") or []
                        self.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                        self.finish = choice.get("finish_reason") or self.finish
                    for hook in self.hooks:
                        if hook[0] is not None and len(self.ids) >= hook[0]:
                            hook[0] = None
                            hook[1](self.rid)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            self.first.set()


def migrate_async(cluster, to=None, results=None, router=None, after=None, again_while=None, **extra):
    """A hook that moves the request to `to` (default: the router's choice, another instance)
    through `router` (default: the cluster's); `after`: an Event the move waits for first;
    `again_while`: a Stream while which a 409 (the destination queues requests or its cache is
    full for now, by the router's last /metrics poll) is asked again, as an operator would."""

    def hook(rid):
        def go():
            if after is not None:
                assert after.wait(120), "the move's go-ahead never came"
            body = dict(extra, request_id=rid, **({"to": to} if to else {}))
            answer = admin(router or cluster["router"], "/migrate", body)
            while answer[0] == 409 and again_while is not None and again_while.is_alive():
                time.sleep(0.2)
                answer = admin(router or cluster["router"], "/migrate", body)
            results.append(answer)
        t = threading.Thread(target=go, daemon=True)
        t.start()
        results.append(t)
    return hook


def finish(streams_, results=()):
    for s in streams_:
        s.join(fleet.REQUEST_TIMEOUT_S)
        assert not s.is_alive(), "a stream did not end"
    out = []
    for r in results:
        if isinstance(r, threading.Thread):
            r.join(fleet.REQUEST_TIMEOUT_S)
        else:
            out.append(r)
    return out


def pin_to(cluster, router, name, fn, urls):
    """Runs fn() while every other instance of `router` (`urls`) is draining: new requests go
    to `name`. (A drain with no time to move anything: their running requests stay.)"""
    others = [u for u in urls if u != cluster[name].url]
    for url in others:
        assert admin(router, "/drain", {"instance": url, "timeout_s": 0})[0] in (200, 504)
    try:
        return fn()
    finally:
        for url in others:
            admin(router, "/undrain", {"instance": url})


class Cuttable(threading.Thread):
    """A TCP proxy to a port of 127.0.0.1 whose connections can be cut, both ways at once, and
    which refuses new ones until restored: the router loses its connection to a live instance.
    Frozen, it passes nothing and accepts connections it never serves (a partition that sends
    no FIN or RST), until cut."""

    def __init__(self, port):
        super().__init__(daemon=True)
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.lock = threading.Lock()
        self.conns, self.down, self.frozen = [], False, False

    def run(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                try:
                    if self.down:
                        raise OSError("cut")
                    if self.frozen:
                        self.conns.append(client)
                        continue
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                except OSError:
                    client.close()
                    continue
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                while self.frozen:
                    time.sleep(0.05)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (a, b):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def freeze(self):
        self.frozen = True

    def cut(self):
        with self.lock:
            self.down, self.frozen = True, False
            for sock in self.conns:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self.conns = []

    def restore(self):
        with self.lock:
            self.down = False

    def close(self):
        self.server.close()
        self.cut()
