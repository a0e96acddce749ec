"""The shell commands of docs/connector.md and docs/live-migration.md run as written, on the CPU
with the real test model, against the real vLLM servers, proxy and router they start: each doc's
```bash blocks run in order as one script, and what they print must show what the doc says (P/D:
D pulled P's KV; live migration: the request moved and its stream went on).

Only the ports change: the docs' 8000-8201 get a leading digit (18000-58201, the first set that is
free here), so a run never meets another's servers. Needs vLLM (make test-connector); every
process a script started is stopped with its process group.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/connector.md", "docs/live-migration.md"]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# a port of the docs: 8000, 8100, 8101, 8200, 8201, or the stem of "810$i" / "820'$i'"
PORT = re.compile(r"(?<![0-9.])(8[012]0)(?=[0-9]|\$|')")
DOC_PORTS = (8000, 8100, 8101, 8200, 8201)
SCRIPT_S = 1200.0  # a script's deadline: two first starts of vLLM on a busy 2-core host included

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector runs these)")


def script_of(doc: str) -> str:
    """The doc's ```bash blocks, in order, as one script."""
    blocks = FENCE.findall((ROOT / doc).read_text())
    assert blocks, f"{doc}: no ```bash block"
    return "\n".join(blocks)


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def moved_ports(script: str) -> str:
    """`script` with each of the docs' ports under a leading digit whose five ports are all free."""
    for digit in "12345":
        if all(free(int(f"{digit}{p}")) for p in DOC_PORTS):
            out = PORT.sub(digit + r"\g<1>", script)
            assert not re.search(r"(?<![0-9])8[012]0[01]?(?![0-9])", out), out  # no port of the doc left
            return out
    raise AssertionError(f"none of the port sets {{1..5}}{DOC_PORTS} is free here")


def run(doc: str, tmp_path: Path) -> str:
    """Runs the doc's script in `tmp_path` (its logs land there) with this Python first on PATH;
    returns what it printed. Every process it left is stopped, its whole process group."""
    script = tmp_path / "doc.sh"
    script.write_text(moved_ports(script_of(doc)))
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               PYTHONUNBUFFERED="1")
    out_path = tmp_path / "out.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(["bash", "-e", str(script)], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=SCRIPT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            status = proc.poll()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and _group_alive(proc.pid):
                    time.sleep(0.5)
            proc.wait(timeout=30)
    printed = out_path.read_text(errors="replace")
    logs = "\n".join(f"--- {p.name} (end)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(tmp_path.glob("*.log")))
    ended = f"ran past {SCRIPT_S:g} s" if status is None else f"exited with {status}"
    assert status == 0, f"{doc}: the script {ended}:\n{printed[-3000:]}\n{logs}"
    return printed


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def json_lines(printed: str):
    """Each JSON object the script printed on a line of its own (curl answers)."""
    for line in printed.splitlines():
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def test_connector_md_runs_and_moves_kv(tmp_path):
    printed = run("docs/connector.md", tmp_path)
    answers = [o for o in json_lines(printed) if isinstance(o, dict) and "choices" in o]
    assert answers and answers[0]["choices"][0]["text"], printed
    counters = dict(re.findall(r"^(vllm:vllm_ext_transfer(?:s|_bytes)_total)\{[^}]*\} ([0-9.e+]+)$", printed, re.M))
    assert float(counters.get("vllm:vllm_ext_transfers_total", 0)) >= 1, printed  # D pulled P's blocks
    assert float(counters.get("vllm:vllm_ext_transfer_bytes_total", 0)) > 0, printed


def test_live_migration_md_runs_and_moves_the_request(tmp_path):
    printed = run("docs/live-migration.md", tmp_path)
    records = [o for o in json_lines(printed) if isinstance(o, dict) and "outcome" in o]
    assert records and records[0]["outcome"] == "moved", printed
    assert re.search(r"^[1-9][0-9]*$", printed, re.M), printed  # grep -c: the stream's tokens
    (instances,) = [o for o in json_lines(printed) if isinstance(o, list)]
    assert [i["lease_state"] for i in instances] == ["ok", "ok"], instances
