"""Child processes on 127.0.0.1 and the HTTP calls that watch them: a server started in a
process group of its own with its log in a file, a free port for it, its /health awaited with
the log's tail on failure, and its stop (the whole group, so that nothing outlives its owner).

Standard library only, so that a test or a benchmark that only starts servers loads neither
torch, vLLM nor aiohttp in its own process.
"""

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Tuple

STARTUP_TIMEOUT_S = 420.0  # a vLLM CPU server starts in ~60 s on 2 idle cores; shared hosts are slower
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0  # SIGTERM's grace before SIGKILL

_HANDED_OUT: set = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a server started later: below the kernel's ephemeral range, so that
    no socket bound to port 0 meanwhile (a lease channel, an endpoint, a client's connect) can
    take it first, and never the same twice in one process."""
    top = _ephemeral_start()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, top - 12000), top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # a crowded range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process with its log file; stop() kills its whole process group."""

    def __init__(self, name: str, argv: List[str], env: Dict[str, str], log_path: Path, port: int):
        self.name, self.port, self.log_path = name, port, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n=60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Returns once GET /health answers 200; raises with the log's tail when the process
        exits first or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:g} s:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the process group, SIGKILL after `timeout` seconds; closes the log."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=timeout)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would (no clean shutdown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


def stop_all(processes: Iterable[Process], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stops processes: SIGTERM to every group at once (vLLM takes seconds to exit), then each
    one's stop (SIGKILL after its grace period), last started first."""
    processes = list(processes)
    for p in processes:
        if p.proc.poll() is None:
            try:
                os.killpg(p.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in reversed(processes):
        p.stop(timeout)


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> Tuple[int, dict]:
    """(status, parsed JSON body) of a POST; an error status is returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def events(response) -> Iterator[dict]:
    """The parsed `data:` events of an OpenAI server-sent stream (an open HTTP response), up to
    `[DONE]`."""
    for raw in response:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])


def metrics(url: str) -> Dict[str, float]:
    """Prometheus samples of /metrics, name{labels} -> value, summed over labels by name too."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        name = key.split("{")[0]
        out[key] = v
        out[name] = out.get(name, 0.0) + v if name != key else v
    return out
