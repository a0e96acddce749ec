"""benchmarks/pd.py's figures from samples, without servers: requests interleave request by
request, the issue's targets are met, missed or unknown (never met for lack of a figure), a
skipped or failed configuration says why, and bad options are refused naming the option.
tests/e2e/test_pd_bench.py runs the benchmark itself against real vLLM servers."""

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

if not (Path(__file__).resolve().parents[2] / "benchmarks").is_dir():
    pytest.skip("benchmarks/ is not here (the test image holds tests/ only)", allow_module_level=True)

from benchmarks import pd  # noqa: E402

LENGTHS = [128, 2048]
PD_CONFIGS = ["ext", "ext-proxy", "nixl", "nixl-proxy", "nixl-push", "nixl-push-proxy"]


def sample(config, tokens, ttft, transfer=None, itl=0.005, wrong=0, prefill=None):
    s = {"config": config, "tokens": tokens, "ttft_s": ttft, "itl_s": itl, "wrong": wrong, "prefill_s": prefill}
    if config != "single":
        s["decode_s"] = ttft - prefill if prefill is not None else None
        if transfer is not None:
            s["transfer_s"] = transfer
            s["transfer_bytes"] = 1 << 20
    return s


def test_each_round_asks_every_configuration_once_and_rotates_the_start():
    configs = list(pd.CONFIGS)
    rounds = [pd.interleaved(configs, k) for k in range(len(configs))]
    for order in rounds:
        assert sorted(order) == sorted(configs)
    for position in range(len(configs)):  # each configuration goes first, second, ... once
        assert sorted(order[position] for order in rounds) == sorted(configs)
    flat = [c for order in rounds for c in order]
    assert all(a != b for a, b in zip(flat, flat[1:]))  # never two requests of one configuration in a row


def test_targets_met_missed_and_unknown():
    rng = random.Random()
    single = rng.uniform(0.02, 0.2)
    step = rng.uniform(0.002, 0.01)
    transfer = rng.uniform(0.001, 0.006)
    budget = transfer + step + pd.SLACK_S
    samples = []
    for n in LENGTHS:
        samples += [sample("single", n, single, itl=step),
                    sample("ext", n, single + 0.5 * budget, transfer, prefill=single),           # within
                    sample("ext-proxy", n, single + 2.0 * budget, transfer, prefill=single),     # beyond
                    sample("nixl", n, single + 0.9 * budget, None, prefill=single),              # no transfer figure
                    sample("nixl-proxy", n, single + 1.0 * budget, None, prefill=single)]
    ceiling = 0.9 * transfer
    ceilings = [{"tokens": n, "round": 0, "ceiling_s": ceiling, "ceiling_bytes": 1 << 20} for n in LENGTHS]
    out = pd.summarise(samples, ceilings, ["single", "ext", "ext-proxy", "nixl", "nixl-proxy"], LENGTHS)
    t = {(x["tokens"], x["config"]): x for x in out["targets"]}
    for n in LENGTHS:
        assert t[n, "ext"]["gap_met"] is True
        assert t[n, "ext"]["budget_s"] == pytest.approx(budget)
        assert t[n, "ext-proxy"]["gap_met"] is False
        assert t[n, "nixl"]["gap_met"] is None  # unknown, not met: its transfer time is not known
        assert t[n, "ext"]["nixl_met"] is True and t[n, "ext-proxy"]["nixl_met"] is False  # same path each
        assert t[n, "ext"]["to_nixl"] == pytest.approx((single + 0.5 * budget) / (single + 0.9 * budget))
        assert "nixl_met" not in t[n, "nixl"]
    assert "ceiling_met" not in t[128, "ext"]  # the ceiling target starts at 1024 tokens
    assert t[2048, "ext"]["of_ceiling"] == pytest.approx(0.9) and t[2048, "ext"]["ceiling_met"] is True
    rows = {(r["tokens"], r["config"]): r for r in out["rows"]}
    assert rows[128, "ext"]["to_single"] == pytest.approx((single + 0.5 * budget) / single)
    assert rows[128, "ext"]["decode_s"] == pytest.approx(0.5 * budget)
    assert rows[128, "ext"]["decode_to_nixl"] == pytest.approx(0.5 / 0.9)
    assert rows[128, "ext"]["transfer_to_nixl"] is None  # NIXL's transfer is unknown here


def test_a_ratio_above_the_ceiling_is_unknown_and_a_slow_transfer_misses():
    samples = [sample("single", 4096, 0.2), sample("ext", 4096, 0.25, 0.010, prefill=0.2),
               sample("single", 8192, 0.4), sample("ext", 8192, 0.45, 0.001, prefill=0.4)]
    ceilings = [{"tokens": 4096, "round": 0, "ceiling_s": 0.004}, {"tokens": 8192, "round": 0, "ceiling_s": 0.002}]
    t = {x["tokens"]: x for x in pd.summarise(samples, ceilings, ["single", "ext"], [4096, 8192])["targets"]}
    assert t[4096]["ceiling_met"] is False  # 40% of the ceiling
    assert t[8192]["ceiling_met"] is None  # 200%: the ceiling's timing was noise, not a result
    assert t[8192]["nixl_met"] is None  # no NIXL row: unknown


def test_the_report_says_why_a_configuration_is_missing_and_what_is_unknown():
    configs = ["single", "ext", "nixl", "nixl-push"]
    samples = [sample("single", 128, 0.05), sample("ext", 128, 0.07, 0.002, prefill=0.04),
               sample("nixl", 128, 0.08, None, prefill=0.04)]
    samples[-1]["transfer_note"] = "no transfer counted on /metrics within 10 s"
    summary = pd.summarise(samples, [], configs, [128])
    status = {"single": {"status": "measured"}, "ext": {"status": "measured"}, "nixl": {"status": "measured"},
              "nixl-push": {"status": "failed", "reason": "a request of 128 tokens failed: TimeoutError: x"}}
    args = SimpleNamespace(device="cuda", max_tokens=8, repeats=1, configs=configs)
    verdict = {"noisy": False, "reasons": [], "cores": 16, "load_before": [0.1] * 3, "load_after": [0.1] * 3,
               "median_spread": None, "max_spread": None, "unreliable": []}
    text = pd.markdown(args, "ipc", {"stopped": None, "metric_notes": {}}, summary, status, verdict,
                       {"vllm": "0.26.0", "nixl": "1.5.1"})
    assert "| nixl-push | NixlPushConnector, client -> P, then D | failed: a request of 128 tokens failed" in text
    assert "no transfer counted on /metrics within 10 s" in text
    assert "| 128 | ext | " in text and "| 128 | nixl-push |" not in text  # no row made up for it


def test_phase_deltas_read_the_connectors_split_per_label():
    name = "vllm:vllm_ext_load_phase_seconds_sum"
    key = '%s{engine="0",model_name="m",phase="%s"}'
    before = {"decode": {key % (name, "acquire"): 1.0, key % (name, "pull"): 2.0}}
    after = {"decode": {key % (name, "acquire"): 1.25, key % (name, "pull"): 2.5, key % (name, "verify"): 0.125},
             "prefill": {}}
    assert pd.phase_deltas(before, after, name) == {"acquire": 0.25, "pull": 0.5, "verify": 0.125}


@pytest.mark.parametrize("argv, named", [
    (["--configs", "single,nixl-pull"], "--configs"),
    (["--configs", ""], "--configs"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--lengths", "128", "1"], "--lengths"),
    (["--repeats", "0"], "--repeats"),
    (["--request-timeout", "0"], "--request-timeout"),
])
def test_bad_options_are_refused_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit):
        pd.parse_args(argv)
    assert named in capsys.readouterr().err


def test_single_is_always_measured_and_the_order_is_fixed():
    args = pd.parse_args(["--configs", "nixl,ext"])
    assert args.configs == ["single", "ext", "nixl"]
    assert args.start == "together" and pd.parse_args(["--device", "cuda"]).start == "sequential"
