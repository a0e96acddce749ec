"""The serving report: Llumnix's table and vLLM's per topology (Markdown), the run's record
(JSON, vLLM's key names), and CDFs of TTFT and TPOT per topology (PNG)."""

import json
import sys
from pathlib import Path
from typing import List

from ..common import report as common_report
from .figures import PERCENTILES, percentile_key

VLLM_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
HEADER = "| {} | {} | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | mean |\n" + \
    "| --- | --- | " + " | ".join("---" for _ in PERCENTILES) + " | --- |\n"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 100 else f"{x:.2f}"


def _not_run(t: dict) -> str:
    return f"{t['status']}: {t['reason']}"


def markdown(data: dict) -> str:
    load, model, ran = data["load"], data["model"], [t for t in data["topologies"] if t["status"] == "ok"]
    cfg = model["config"]
    lines = [f"# Serving: {len(data['topologies'])} topologies, one load\n\n",
             f"vLLM {data['vllm_version']} on {data['device']}; model `{model['shape']}` ({cfg['num_hidden_layers']} "
             f"layers, hidden {cfg['hidden_size']}, {cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, "
             f"vocab {cfg['vocab_size']}, {model['dtype']}, dummy weights).\n\n",
             f"Load: `vllm bench serve`, {load['num_prompts']} requests, Poisson arrivals at {load['request_rate']:g} "
             f"req/s, seed {load['seed']}, ignore_eos, greedy; ShareGPT-format requests generated with seed "
             f"{load['dataset']['seed']}: prompt tokens median {load['dataset']['prompt_lens']['p50']}, p99 "
             f"{load['dataset']['prompt_lens']['p99']}, max {load['dataset']['prompt_lens']['max']}; output tokens "
             f"median {load['dataset']['output_lens']['p50']}, p99 {load['dataset']['output_lens']['p99']}, max "
             f"{load['dataset']['output_lens']['max']}.\n\n",
             "## Llumnix's table\n\n",
             "prefill = time to first token, decode = a request's mean gap between tokens after the first; "
             "pooled over requests.\n\n",
             HEADER.format("topology", "latency (ms)")]
    for t in data["topologies"]:
        if t["status"] != "ok":
            lines.append(f"| {t['title']} | {_not_run(t)} |" + " |" * (len(PERCENTILES) + 1) + "\n")
            continue
        for row in ("prefill", "decode"):
            s = t["llumnix"][row] or {}
            lines.append(f"| {t['title'] if row == 'prefill' else ''} | {row} | "
                         + " | ".join(_ms(s.get(f"p{p}")) for p in PERCENTILES) + f" | {_ms(s.get('mean'))} |\n")
    lines += ["\n## vLLM's figures\n\n", HEADER.format("topology", "metric (ms)")]
    for t in ran:
        for i, (key, name) in enumerate(VLLM_METRICS):
            lines.append(f"| {t['title'] if i == 0 else ''} | {name} | "
                         + " | ".join(_ms(t.get(percentile_key(p, key))) for p in PERCENTILES)
                         + f" | {_ms(t.get(f'mean_{key}_ms'))} |\n")
    lines += ["\n| topology | completed | failed | duration (s) | requests/s | output tokens/s | total tokens/s "
              "| peak concurrent |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n"]
    for t in data["topologies"]:
        if t["status"] != "ok":
            lines.append(f"| {t['title']} | {_not_run(t)} |" + " |" * 6 + "\n")
            continue
        lines.append(f"| {t['title']} | {t['completed']} | {t['failed']} | {t['duration']:.1f} | "
                     f"{t['request_throughput']:.2f} | {t['output_throughput']:.0f} | "
                     f"{t['total_token_throughput']:.0f} | {t.get('max_concurrent_requests', '-')} |\n")
    lines.append("\n" + "".join(f"- {t['title']}: {t['layout']}\n" for t in ran))
    lines += [f"- {n}\n" for n in data["notes"]]
    return "".join(lines)


def plot(data: dict, path) -> bool:
    """CDFs of per-request TTFT and TPOT, a line per topology that ran."""
    plt = common_report.pyplot()
    if plt is None or not any(t["status"] == "ok" for t in data["topologies"]):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t in data["topologies"]:
        if t["status"] != "ok":
            continue
        for ax, key in zip(axes, ("prefill_latencies", "tpots")):
            values = sorted(t[key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=t["title"])
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM {data['vllm_version']}, {data['device']}, {data['load']['num_prompts']} requests at "
                 f"{data['load']['request_rate']:g} req/s")
    common_report.save_figure(plt, fig, path)
    return True


def write(out_dir, name: str, data: dict) -> None:
    common_report.write(out_dir, name, data, markdown(data), plot=lambda path: plot(data, path))


def problems_of(data: dict) -> List[str]:
    """Every topology's problems, and a failed topology's reason, as `title: problem` lines."""
    out = []
    for t in data["topologies"]:
        if t["status"] == "failed":
            out.append(f"{t['title']}: failed: {t['reason']}")
        out += [f"{t['title']}: {p}" for p in t.get("problems", [])]
    return out


if __name__ == "__main__":  # python -m benchmarks.serving.report RUN.json: RUN.md and RUN.png again, from the JSON
    source = Path(sys.argv[1])
    data = json.loads(source.read_text())
    source.with_suffix(".md").write_text(markdown(data) + common_report.provenance_line(data["provenance"]))
    if not plot(data, source.with_suffix(".png")):
        sys.exit("no PNG: matplotlib is not installed")
