"""`make demo` as a new user runs it (vllm_ext.fleet.demo), on the tiny random model (the real
one decodes too slowly for CI's time): it runs to the end, moves the chat answer in mid-stream,
pulls a P/D request's KV, says what it does at least every 10 s, and leaves no process behind,
also when it is interrupted while its servers start."""

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

RUN_TIMEOUT_S = 600.0
QUIET_S = 20.0  # the demo says something at least every 10 s; slack for a loaded host


def _marked(mark: str):
    """Pids of live processes whose environment carries `mark` (the demo's and its children's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if mark.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


class Demo:
    """The demo as a child process; its output lines with the time each came."""

    def __init__(self, work: Path, *args: str):
        self.mark = f"demo-test-{secrets.token_hex(8)}"
        env = dict(os.environ, FLEET_DEMO_TEST_MARK=self.mark, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_ext.fleet.demo", "--model", "tiny", "--work",
                                      str(work), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     text=True, errors="replace", start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for _, line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.reader.join(10)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)[-6000:]

    def longest_quiet(self) -> float:
        """The longest time without a progress line ([demo] ...), the stream's text aside."""
        times = [t for t, line in self.lines if line.startswith("[demo]")]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def _no_process_left(mark: str) -> None:
    deadline = time.monotonic() + 30
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _marked(mark) == [], f"processes left behind: {_marked(mark)}"


def test_the_demo_runs_to_the_end_and_leaves_nothing_behind(tmp_path):
    demo = Demo(tmp_path / "run")
    code = demo.finish()
    out = demo.output()
    assert code == 0, out
    assert "outcome moved" in out or "outcome recomputed" in out, out
    assert "pre-copy stages:" in out and "the source's stop to the destination's first token" in out, out
    pulled = [line for _, line in demo.lines if "B pulled" in line]
    assert pulled and "B pulled 0 transfer" not in pulled[0], out
    assert "stopped every process it started" in out, out
    assert demo.longest_quiet() <= QUIET_S, out
    _no_process_left(demo.mark)


def test_an_interrupted_demo_stops_what_it_started(tmp_path):
    demo = Demo(tmp_path / "run")
    demo.wait_for("starting vLLM instance B", timeout=120)
    time.sleep(2)  # its servers are starting
    os.killpg(demo.proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
    code = demo.finish(timeout=120)
    assert code == 130, demo.output()
    assert "interrupted" in demo.output() and "stopped every process it started" in demo.output()
    _no_process_left(demo.mark)
