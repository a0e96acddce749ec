"""The figures of one topology's run, from `vllm bench serve --save-detailed`'s result JSON, and
the checks that the run is complete and sane. Needs numpy only (no vLLM): the tests feed it
canned results.

Llumnix's table (its CI's `prefill_latencies` / `decode_latencies`, pooled over requests):
  prefill  a request's time to first token
  decode   a request's mean gap between streamed outputs after the first (0 with one output)
vLLM's figures are vLLM's own keys (`mean_ttft_ms`, `p99_itl_ms`, `request_throughput`, ...), as is.
"""

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from .load import METRICS, PERCENTILES

# What a topology's JSON entry keeps of vLLM's result: every scalar, and these per-request lists
# (the pooled `itls` and the texts stay in the raw file).
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "start_times", "errors")


def percentile_key(p: float, metric: str) -> str:
    """vLLM's key for a percentile: p99_ttft_ms, p99.9_ttft_ms."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def stats(values_ms: Sequence[float]) -> Dict[str, float]:
    """p25, p50, p75, p95, p99 (numpy's linear interpolation, as both Llumnix and vLLM) and mean."""
    a = np.asarray(values_ms, dtype=float)
    out = {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}
    out["mean"] = float(a.mean())
    return out


def per_request(result: dict) -> Dict[str, List[float]]:
    """Per successful request, in ms: Llumnix's prefill and decode latencies, and vLLM's TPOT
    ((e2el - ttft) / (output tokens - 1), requests of one token left out, as vLLM does)."""
    prefill, decode, tpots = [], [], []
    for ttft, itl, n, err in zip(result["ttfts"], result["itls"], result["output_lens"], result["errors"]):
        if err or not ttft:
            continue
        prefill.append(ttft * 1000)
        decode.append(sum(itl) / len(itl) * 1000 if itl else 0.0)
        if n > 1:
            tpots.append(sum(itl) / (n - 1) * 1000)
    return {"prefill_latencies": prefill, "decode_latencies": decode, "tpots": tpots}


def summarise(result: dict) -> dict:
    """A topology's entry: vLLM's scalars, the per-request lists, and Llumnix's table."""
    entry = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    entry.update({k: result[k] for k in PER_REQUEST_KEYS if k in result})
    entry.update(per_request(result))
    entry["llumnix"] = {"prefill": stats(entry["prefill_latencies"]) if entry["prefill_latencies"] else None,
                        "decode": stats(entry["decode_latencies"]) if entry["decode_latencies"] else None}
    return entry


def problems(result: dict, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> List[str]:
    """Why a run is not complete and sane (empty when it is): every request of the dataset answered
    without error with exactly its token counts (ignore_eos), finite positive TTFTs and
    non-negative gaps, percentiles in order, positive throughput. `prompt_lens` / `output_lens`: the
    dataset's lengths, in any order."""
    out = []
    n = len(output_lens)
    for key in ("ttfts", "itls", "output_lens", "input_lens", "errors"):
        if not isinstance(result.get(key), list):
            return [f"{key}: missing (run vllm bench serve with --save-detailed)"]
        if len(result[key]) != n:
            out.append(f"{key}: {len(result[key])} entries for {n} requests")
    if result.get("completed") != n:
        out.append(f"completed: {result.get('completed')} of {n} requests")
    if result.get("failed"):
        out.append(f"failed: {result['failed']} requests")
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        out.append(f"errors: {len(errors)} requests, the first: {errors[0][:300]}")
    if sorted(result.get("output_lens", [])) != sorted(output_lens):
        out.append("output_lens: the answered token counts differ from the dataset's "
                   f"({sum(result.get('output_lens', []))} tokens for {sum(output_lens)})")
    if sorted(result.get("input_lens", [])) != sorted(prompt_lens):
        out.append("input_lens: the prompts' token counts differ from the dataset's")
    if result.get("total_output_tokens") != sum(output_lens):
        out.append(f"total_output_tokens: {result.get('total_output_tokens')}, expected {sum(output_lens)}")
    for i, (ttft, itl) in enumerate(zip(result.get("ttfts", []), result.get("itls", []))):
        gaps = list(itl or [])
        if not _finite_positive(ttft) or any(not _finite(g) or g < 0 for g in gaps):
            out.append(f"request {i}: TTFT {ttft!r} or an inter-token gap is not a finite positive time")
            break
    for metric in METRICS:
        values = [result.get(percentile_key(p, metric)) for p in PERCENTILES]
        out += _ordered(f"{metric} (vLLM)", values, result.get(f"mean_{metric}_ms"))
    if out:
        return out
    table = per_request(result)
    for row in ("prefill_latencies", "decode_latencies"):
        s = stats(table[row])
        out += _ordered(f"{row} (Llumnix)", [s[f"p{p}"] for p in PERCENTILES], s["mean"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        if not _finite_positive(result.get(key)):
            out.append(f"{key}: {result.get(key)!r}, expected a positive number")
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite_positive(x) -> bool:
    return _finite(x) and x > 0


def _ordered(name: str, values: List[Optional[float]], mean: Optional[float]) -> List[str]:
    """p25 <= p50 <= ... <= p99, all finite and >= 0, and a finite mean >= 0."""
    labels = [f"p{p}" for p in PERCENTILES]
    if any(not _finite(v) or v < 0 for v in values) or not _finite(mean) or mean < 0:
        return [f"{name}: missing or invalid figures {dict(zip(labels + ['mean'], values + [mean]))}"]
    bad = [f"{a} {x:.3f} > {b} {y:.3f}" for a, b, x, y in zip(labels, labels[1:], values, values[1:]) if x > y]
    return [f"{name}: percentiles out of order ({'; '.join(bad)})"] if bad else []
