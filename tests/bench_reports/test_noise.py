"""The benchmark reports on a noisy host: what was measured is printed (load average, spread of
repeats), NOISY where the host was, a ratio above its ceiling is unreliable rather than a result,
and CPU runs say their figures are not comparable with the GPU ones (the README's, Llumnix's)."""

import random
from pathlib import Path

import pytest

if not (Path(__file__).resolve().parents[2] / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not here (the test image holds tests/ only)", allow_module_level=True)

from benchmarks import kernels  # noqa: E402
from benchmarks.common import noise  # noqa: E402
from benchmarks.common.geometry import MIB  # noqa: E402
from benchmarks.migration import report as migration_report  # noqa: E402

pytest.importorskip("torch")


@pytest.fixture
def load(monkeypatch):
    """Sets the host's load average as os.getloadavg reports it."""
    def set_load(value):
        monkeypatch.setattr(noise.os, "getloadavg", lambda: (value, value, value))
        monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    return set_load


def kernel_row(op, blocks, ratio, rng, spread=0.05):
    t = rng.uniform(1e-3, 1e-1)
    ceiling_gbps = blocks * 8 * MIB / (t * ratio) / 1e6
    return {"op": op, "blocks": blocks, "bytes": blocks * 8 * MIB, "time_ms": t, "min_ms": t,
            "max_ms": t * (1 + spread),
            "gbps": ceiling_gbps * ratio, "ceiling_gbps": ceiling_gbps, "pct_of_ceiling": 100 * ratio,
            "spread": spread, "ceiling_spread": spread, "unreliable": noise.above_ceiling(ratio),
            "speedup_vs_torch": rng.uniform(1, 20), "wrong": 0}


def test_a_quiet_host_is_called_quiet(load):
    load(0.2)
    verdict = noise.Host().verdict({"a": 0.05, "b": 0.1})
    assert not verdict["noisy"] and verdict["reasons"] == [] and verdict["load_before"] == [0.2, 0.2, 0.2]
    assert "Quiet: the figures are results." in noise.markdown(verdict)[0]


@pytest.mark.parametrize("case", ["busy", "spread", "above"])
def test_a_noisy_host_is_named_with_why(load, case):
    load(9.6 if case == "busy" else 0.2)
    wide = round(random.uniform(0.3, 50), 2)
    verdict = noise.Host().verdict({"gather 8 MiB": wide if case == "spread" else 0.01, "scatter 8 MiB": 0.02},
                                   ["gather 64 MiB"] if case == "above" else [])
    text = "\n".join(noise.markdown(verdict))
    assert verdict["noisy"] and "**NOISY HOST: these figures are not results.**" in text, text
    assert {"busy": "load average 9.6 on 2 cores", "spread": f"widest: gather 8 MiB, {wide:.0%}",
            "above": "1 ratios above their ceiling (marked unreliable): gather 64 MiB"}[case] in text, text


def test_the_cpu_kernel_report_never_prints_a_ratio_above_its_ceiling_as_a_result(load):
    """The report the issue saw: a reference copy slowed by other load, a row at 2.76x of it."""
    load(0.1)
    rng = random.Random()
    rows = [kernel_row("gather", 1, 0.6, rng), kernel_row("gather", 8, 2.76, rng), kernel_row("scatter", 8, 1.02, rng)]
    host = noise.Host()
    meta = {"device_name": "CPU", "gpus": 0, "geometry": {}, "block_mib": 8, "iters": 10, "threads": 2,
            "host_us_per_call": {}, "host": kernels.host_verdict(host, rows)}
    text = kernels.markdown(rows, meta)
    assert "| unreliable (2.76x) |" in text and "| 0.60x |" in text and "| 1.02x |" in text, text
    assert "NOISY HOST" in text and "gather 64 MiB" in text, text  # the unreliable row makes the run noisy
    assert "Not comparable with GPU figures" in text and "H200" in text, text


def test_the_gpu_kernel_report_marks_ratios_and_does_not_judge_targets_on_a_noisy_host(load):
    load(9.0)
    rng = random.Random()
    rows = [kernel_row("gather", n, r, rng) for n, r in ((1, 0.6), (8, 0.95), (68, 1.3))]
    meta = {"device_name": "GPU", "gpus": 1, "geometry": {}, "block_mib": 8, "host_us_per_call": {},
            "targets": kernels.evaluate_targets(rows), "host": kernels.host_verdict(noise.Host(), rows)}
    text = kernels.markdown(rows, meta)
    assert "| unreliable (130.0) |" in text and "| 95.0 |" in text, text
    assert "not judged: noisy host" in text and "| yes |" not in text and "| NO |" not in text, text


def migration(gpus, rng):
    ours = {n: {"gibps": rng.uniform(1, 2), "samples_gibps": [1.0, 1.1, 1.05]} for n in (1, 8)}
    ceiling = {1: {"gibps": ours[1]["gibps"] * 2, "samples_gibps": [2.0, 2.1]},
               8: {"gibps": ours[8]["gibps"] / 2.5, "samples_gibps": [0.5, 2.0]}}  # slowed: ours 2.5x "above" it
    return {"meta": {"mode": "CPU, 2 cores" if not gpus else "2 GPU(s)", "gpus": gpus}, "table_sizes": [1, 8],
            "results": {"gloo (ours)": ours, "gloo send/recv, one stream (ceiling)": ceiling}, "fixed": {},
            "notes": []}


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_migration_report_marks_ratios_and_compares_with_llumnix_only_on_gpus(load, gpus):
    load(0.1)
    report = migration(gpus, random.Random())
    report["host"] = noise.Host().verdict(migration_report.spreads(report),
                                          migration_report.ratios_above_ceiling(report))
    text = migration_report.markdown(report)
    assert "| gloo (ours) / ceiling | 50% | unreliable (250%) |" in text, text
    assert report["host"]["noisy"] and "gloo (ours) at 64 MiB vs gloo send/recv" in text, text
    assert ("ours / Llumnix" in text) == bool(gpus), text
    assert ("Not comparable with GPU figures" in text) == (not gpus), text
