"""What vllm-ext is for, in one command: two vLLM instances with VllmExtConnector, the router
before them and the P/D proxy; a chat answer streamed to the terminal and moved to the other
instance in mid-answer; then a prompt prefilled on one instance and decoded on the other.

    make demo                          # the real model (SmolLM2-135M-Instruct), CPU or GPU
    python -m vllm_ext.fleet.demo --model tiny      # a tiny random model: fast, gibberish
    python -m vllm_ext.fleet.demo --serve           # leave the fleet up, with curl lines to try

Everything it starts runs on 127.0.0.1 and stops when it ends, also on Ctrl-C. Progress is
printed at least every 10 s; the servers' logs are kept in the work folder it names.
"""

import argparse
import json
import secrets
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from .process import Process, events, free_port, metrics, post, stop_all
from .real_model import SERVED_NAME, real_model_folder
from .servers import DEVICES, start_proxy, start_router, vllm_env

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# Long enough to fill whole KV blocks (32 tokens each here): on CPU only whole blocks before the
# prompt's last token move, the rest is computed on the decode side.
PD_PROMPT = ("The history of the lighthouse is a history of light and of the people who kept it burning. "
             "For centuries, keepers climbed narrow stairs every evening, trimmed the wicks, polished the "
             "lenses and watched the sea through storms and fog, so that ships could find their way home. "
             "In this essay we look at three of them, and at what their lonely work taught them.")
STARTUP_S = 600.0
# a chat answer streamed again when the previous one ended before its move switched (a busy host:
# the engine runs far ahead of the client, and the move waits for its next step)
MOVE_ATTEMPTS = 3


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _device(name: str):
    if name == "auto":
        try:
            import torch

            name = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            name = "cpu"
    return DEVICES[name]


def _wait_up(processes: List[Process], what: str) -> None:
    """Waits for every process's /health, saying where each stands at least every 10 s."""
    started, last = time.monotonic(), 0.0
    waiting = list(processes)
    while waiting:
        for p in list(waiting):
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}; its log ends:\n{p.log_tail(30)}")
            try:
                with urllib.request.urlopen(p.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        waiting.remove(p)
                        say(f"{p.name} is up after {time.monotonic() - started:.0f} s")
            except (urllib.error.URLError, OSError):
                pass
        elapsed = time.monotonic() - started
        if waiting and elapsed - last >= 10:
            last = elapsed
            for p in waiting:
                tail = p.log_tail(1).strip()[-110:]
                say(f"{what}: {p.name} starting ({elapsed:.0f} s){': ' + tail if tail else ''}")
        if elapsed > STARTUP_S:
            raise RuntimeError(f"{', '.join(p.name for p in waiting)} not up after {STARTUP_S:.0f} s")
        time.sleep(0.5)


def _admin(url: str, token: str, path: str, body: Optional[dict] = None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Fleet:
    """Instances A and B (kv_both: each can be the other's producer or consumer), the router and
    the P/D proxy, stopped together."""

    def __init__(self, model: Path, work: Path, device, served: str, max_model_len: int = 1024):
        self.work, self.device, self.served = work, device, served
        self.max_model_len = max_model_len
        self.token = secrets.token_hex(16)
        self.secret = secrets.token_hex(32)
        self.processes: List[Process] = []
        self.lease_ports = {"A": free_port(), "B": free_port()}
        self.model = model

    def _start(self, name: str, argv: List[str], env: Dict[str, str], port: int) -> Process:
        p = Process(name, argv, env, self.work / f"{name}.log", port)
        self.processes.append(p)
        return p

    def _env(self, core: str) -> Dict[str, str]:
        env = vllm_env(core, device=self.device)
        env["VLLM_EXT_AUTH_SECRET"] = self.secret
        return env

    def start(self) -> None:
        servers = []
        for name, core in (("A", "0"), ("B", "1")):
            other = "B" if name == "A" else "A"
            kv = {"kv_connector": "VllmExtConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"lease_port": self.lease_ports[name],
                                                "connect_to": [f"127.0.0.1:{self.lease_ports[other]}"]}}
            port = free_port()
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                    "--served-model-name", self.served, "--dtype", self.device.dtype,
                    "--max-model-len", str(self.max_model_len),
                    "--block-size", "32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                    *self.device.server_args, "--kv-transfer-config", json.dumps(kv)]
            say(f"starting vLLM instance {name} on port {port} (lease channel {self.lease_ports[name]})")
            servers.append(self._start(name, argv, self._env(core), port))
            if self.device.sequential_start:  # vLLM sizes its cache from the GPU memory free when it starts
                _wait_up([servers[-1]], "vLLM")
        _wait_up(servers, "vLLM (the first start compiles and warms up: a minute or two on a CPU)")
        a, b = servers
        env = self._env("0")
        env["VLLM_EXT_ROUTER_TOKEN"] = self.token
        self.router = start_router("router", [a.url, b.url], [f"127.0.0.1:{p}" for p in self.lease_ports.values()],
                                   self.work, env=env)
        self.proxy = start_proxy("proxy", [a.url], [b.url], self.work, env=env)
        self.processes += [self.router, self.proxy]
        say(f"starting the router (port {self.router.port}) and the P/D proxy (port {self.proxy.port}; prefill on A, "
            "decode on B)")
        _wait_up([self.router, self.proxy], "fronts")
        self.a, self.b = a, b

    def stop(self) -> None:
        # SIGTERM to all at once: one after the other, two vLLM servers interrupted while starting
        # could take their grace periods in turn, longer than a user (or the test) waits
        stop_all(self.processes)
        say("stopped every process it started")


def _stream_and_move(fleet: Fleet, max_tokens: int, move_after: int, ignore_eos: bool = False,
                     how: Optional[dict] = None) -> dict:
    """Streams a chat answer through the router to the terminal and moves it to the other
    instance once `move_after` tokens came (`how`: more of the /migrate body); returns the
    move's record and the client's view."""
    how = how or {}
    body = {"model": fleet.served, "messages": [{"role": "user", "content": CHAT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": ignore_eos}
    req = urllib.request.Request(fleet.router.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    seen = {"tokens": 0, "gaps": [], "text": "", "record": None}
    moved = threading.Event()

    def move():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status, running = _admin(fleet.router.url, fleet.token, "/requests")
            for r in running.get("running", []) if status == 200 else []:
                rid = r.get("request_id", r.get("id"))
                source = r.get("instance")
                if r.get("generated", 0) >= move_after and rid:
                    target = fleet.b.url if source == fleet.a.url else fleet.a.url
                    status, record = _admin(fleet.router.url, fleet.token, "/migrate",
                                            dict(how, request_id=rid, to=target))
                    seen["record"] = record if status == 200 else {"error": record, "status": status}
                    moved.set()
                    return
            time.sleep(0.05)
        moved.set()

    mover = threading.Thread(target=move, daemon=True)
    mover.start()
    last = time.monotonic()
    print("\n--- the client's stream (through the router) ---", flush=True)
    with urllib.request.urlopen(req, timeout=600) as r:
        for chunk in events(r):
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    now = time.monotonic()
                    seen["gaps"].append(now - last)
                    last = now
                    seen["tokens"] += 1
                    seen["text"] += text
                    print(text, end="", flush=True)
    print("\n--- end of the stream ---\n", flush=True)
    moved.wait(130)
    return seen


def _move_until_it_switches(stream_and_move, attempts: int = MOVE_ATTEMPTS) -> dict:
    """`stream_and_move()` (a new answer each time) until its move did not find the answer ended
    (on a busy host the engine may end it before the move reaches it: right, but no move), at
    most `attempts` times; each move reported. Returns the last one's."""
    seen = stream_and_move()
    _report_move(seen)
    for attempt in range(2, attempts + 1):
        if (seen["record"] or {}).get("outcome") != "finished":
            break
        say(f"the answer ended before the move switched: a new one (attempt {attempt} of {attempts})")
        seen = stream_and_move()
        _report_move(seen)
    return seen


def _report_move(seen: dict) -> None:
    record = seen["record"]
    if not record or "error" in record:
        say(f"no move was made: {record}")
        return
    stages = record.get("stages", [])
    say(f"the request moved from {record['source']} to {record['destination']}: outcome {record['outcome']}"
        + (f" ({record['reason']})" if record.get("reason") else ""))
    say(f"  pre-copy stages: {len(stages)}, blocks per stage {[s['blocks'] for s in stages]}, "
        f"final lease {record.get('final_blocks')} blocks; tokens moved {record.get('moved_tokens')}, "
        f"recomputed {record.get('recomputed_tokens')}")
    if record.get("stop_to_resume_ms") is not None:
        say(f"  the source's stop to the destination's first token: {record['stop_to_resume_ms']:.1f} ms; "
            f"longest gap between two pieces of text the client saw: {1e3 * max(seen['gaps'] or [0]):.0f} ms")


def _pd(fleet: Fleet) -> None:
    before = metrics(fleet.b.url)
    say("a P/D request through the proxy: A prefills the prompt, B pulls its KV and decodes")
    status, body = post(fleet.proxy.url + "/v1/completions", {"model": fleet.served, "prompt": PD_PROMPT,
                                                               "max_tokens": 40, "temperature": 0})
    if status != 200:
        say(f"the P/D request failed: {status} {body}")
        return
    print(f"\n--- the answer (decoded on B) ---\n{body['choices'][0]['text']}\n---\n", flush=True)
    after = metrics(fleet.b.url)
    moved = {k: after.get(f"vllm:vllm_ext_{k}", 0) - before.get(f"vllm:vllm_ext_{k}", 0)
             for k in ("transfers_total", "transfer_bytes_total")}
    say(f"B pulled {moved['transfers_total']:.0f} transfer(s), {moved['transfer_bytes_total'] / 1024:.0f} KiB of KV "
        f"from A (B's /metrics: vllm:vllm_ext_transfers_total, vllm:vllm_ext_transfer_bytes_total)")


def _curl_lines(fleet: Fleet) -> str:
    chat = json.dumps({"model": fleet.served, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 64, "stream": True})
    return "\n".join([
        f"  curl -N {fleet.router.url}/v1/chat/completions -H 'Content-Type: application/json' -d '{chat}'",
        f"  curl {fleet.router.url}/requests -H 'Authorization: Bearer {fleet.token}'",
        f"  curl {fleet.router.url}/migrate -H 'Authorization: Bearer {fleet.token}' "
        "-H 'Content-Type: application/json' -d '{\"request_id\": \"<an id from /requests>\"}'",
        f"  curl {fleet.proxy.url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{fleet.served}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.fleet.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("real", "tiny"), default="real",
                        help="real: SmolLM2-135M-Instruct, fetched and converted once; tiny: a random model")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--max-tokens", type=int, default=None, help="the chat answer's length")
    parser.add_argument("--serve", action="store_true", help="leave the fleet up until Ctrl-C, with curl lines")
    parser.add_argument("--work", type=Path, default=None, help="folder for the logs (default: a new temporary one)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-ext-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    device = _device(args.device)
    say(f"device {device.name}; logs in {work}")
    if args.model == "real":  # float32 on disk; the GPU serves it in its own dtype
        model, served = real_model_folder("float32", say=say), SERVED_NAME
        max_tokens = args.max_tokens or 160
    else:
        from .models import CHAT_MODEL_MAX_POSITIONS, write_chat_model

        model, served = work / "tiny-model", "tiny"
        write_chat_model(model)
        # long enough that its engine, hundreds of tokens a second ahead of the client on a CPU,
        # still decodes when the move switches (at 600 the move found it ended, seen on 2 cores)
        max_tokens = args.max_tokens or CHAT_MODEL_MAX_POSITIONS - 256
    fleet = Fleet(model, work, device, served, 1024 if args.model == "real" else CHAT_MODEL_MAX_POSITIONS)
    # Ctrl-C and a kill stop the fleet. SIGINT's handler is set too: a process started in the
    # background by a non-interactive shell (nohup make demo &, a CI job) inherits SIGINT ignored,
    # and Python then raises no KeyboardInterrupt for it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    try:
        fleet.start()
        say(f"fleet up in {time.monotonic() - started:.0f} s")
        if args.serve:
            say("the fleet is up; try:\n" + _curl_lines(fleet) + "\nCtrl-C stops it")
            threading.Event().wait()
        # the tiny model decodes hundreds of tokens a second on a CPU: it is moved early, or its
        # engine would end the answer while the client (and the router's count) still lag behind
        move_after = 8 if args.model == "tiny" else max(8, max_tokens // 5)
        # the random tiny model may write its end of text at any token: it runs its max_tokens
        # and it moves by stop-and-copy: pre-copy rounds last longer than its whole answer on a CPU
        tiny = args.model == "tiny"
        seen = _move_until_it_switches(lambda: _stream_and_move(fleet, max_tokens, move_after=move_after,
                                                                ignore_eos=tiny, how={"stages": 0} if tiny else None))
        _pd(fleet)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except (RuntimeError, OSError) as e:
        say(f"failed: {e}")
        return 1
    finally:
        fleet.stop()
        say(f"done in {time.monotonic() - started:.0f} s")
    return 0 if seen["record"] and seen["record"].get("outcome") in ("moved", "recomputed") else 1


def _interrupted(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
