"""The serving benchmark's run: write the model folder and the dataset, then per phase start the
instances, per topology start its router or proxy, run `vllm bench serve` against it, stop it;
stop the instances; check and write the report. Everything started is stopped on the way out,
also on failure, Ctrl-C or SIGTERM. Exits 1 when a topology that could run failed or its output
is not complete and sane (figures.problems), 130 when interrupted.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from vllm_ext import fleet
from vllm_ext.fleet import models

from ..common import report as common_report
from . import figures, load, report, servers
from .dataset import Lengths, check_lengths, write_dataset

# Llumnix's CI: ShareGPT-GPT4, Poisson, 5 req/s per instance (300 prompts per client). Lengths:
# log-normal, long-tailed prompts and answers (medians 100 and 350 tokens), the CPU presets scaled
# down so that one core keeps up with most of the load.
PRESETS = {
    "gpu": {"shape": "7b", "dtype": "bfloat16", "num_prompts": 600, "request_rate": 10.0, "time_limit": 570.0,
            "lengths": Lengths(prompt_median=100, prompt_sigma=1.2, output_median=350, output_sigma=0.7)},
    "cpu": {"shape": "tiny", "dtype": "float32", "num_prompts": 600, "request_rate": 10.0, "time_limit": 1800.0,
            "lengths": Lengths(prompt_median=25, prompt_sigma=1.2, output_median=90, output_sigma=0.7)},
    "ci": {"shape": "tiny", "dtype": "float32", "num_prompts": 24, "request_rate": 4.0, "time_limit": 600.0,
           "lengths": Lengths(prompt_median=16, prompt_sigma=1.0, output_median=24, output_sigma=0.7,
                              max_prompt=128, max_total=256)},
}
MAX_MODEL_LEN = 2048
SERVED_NAME = "serving-bench"
NUM_WARMUPS = 4
KEEP_ALIVE_S = "3600"  # vLLM closes idle HTTP connections after 5 s: a pooled one could close under a request


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="load and model (default: gpu with a CUDA GPU, else cpu)")
    parser.add_argument("--topologies", default=",".join(servers.TOPOLOGIES),
                        help=f"comma list of {', '.join(servers.TOPOLOGIES)} (default: all)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None, help="requests/s for every topology")
    parser.add_argument("--seed", type=int, default=0, help="dataset and arrivals")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.40, help="per instance (two share a GPU)")
    parser.add_argument("--cuda-graphs", action="store_true", help="GPU: CUDA graphs and torch.compile (default eager)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG[=VALUE]",
                        help="an extra vLLM server flag for every instance (repeatable)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds; topologies not started by then are reported as not run")
    parser.add_argument("--out", default=str(common_report.DEFAULT_OUT))
    args = parser.parse_args()
    if args.preset is None:
        import torch

        args.preset = "gpu" if torch.cuda.is_available() else "cpu"
    args.topologies = args.topologies.split(",")
    unknown = set(args.topologies) - set(servers.TOPOLOGIES)
    if unknown:
        parser.error(f"--topologies: unknown {sorted(unknown)}")
    preset = PRESETS[args.preset]
    args.num_prompts = args.num_prompts or preset["num_prompts"]
    args.request_rate = args.request_rate or preset["request_rate"]
    args.time_limit = args.time_limit or preset["time_limit"]
    return args, preset


def server_config(args, preset, model_dir: Path, log_dir: Path) -> servers.ServerConfig:
    gpu = args.preset == "gpu"
    flags = ["--dtype", preset["dtype"], "--max-model-len", str(MAX_MODEL_LEN),
             "--max-num-seqs", "256" if gpu else "128"]
    env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": KEEP_ALIVE_S}
    if gpu:  # FlashInfer is not on the GPU machine; vLLM's own sampler instead
        flags += ["--block-size", "16", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        flags += [] if not args.cuda_graphs else ["--no-enforce-eager"]
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    flags += [part for arg in args.server_arg for part in arg.split("=", 1)]
    return servers.ServerConfig(model_dir, SERVED_NAME, flags, env, sequential=gpu, log_dir=log_dir,
                                client_prefix=[] if gpu else servers.AHEAD_OF_SERVERS)


def layout(topology: str, specs, gpu: bool) -> str:
    where = "GPU 0" if gpu else "core"
    places = [f"{s['name']} ({where}{'' if gpu else ' ' + s['core']})" for s in specs]
    inst = ", ".join(places) if topology != "single" else places[0] + "".join(
        f"; {p} idles meanwhile" for p in places[1:])
    front = {"single": "clients talk to it directly", "router": "`python -m vllm_ext.router`",
             "balance": "`python -m vllm_ext.router --balance`",
             "pd": "`python -m vllm_ext.proxy`, KV over VllmExtConnector"}[topology]
    return f"{inst}; {front}"


class Run:
    """One benchmark run: its requests, its settings, and each topology's entry as it goes."""

    def __init__(self, args, preset, work: Path):
        self.args, self.preset, self.work = args, preset, work
        self.gpu = args.preset == "gpu"
        self.start, self.load_before = time.monotonic(), os.getloadavg()
        self.deadline = self.start + args.time_limit
        self.model_dir = models.write_text_model(work / "model", preset["shape"], MAX_MODEL_LEN)
        self.dataset = work / "dataset.json"
        self.dataset_record = write_dataset(self.dataset, self.model_dir, args.num_prompts, preset["lengths"],
                                            args.seed)
        check_lengths(self.dataset, self.model_dir)
        conversations = json.loads(self.dataset.read_text())
        self.prompt_lens = [c["prompt_tokens"] for c in conversations]
        self.output_lens = [c["output_tokens"] for c in conversations]
        self.cfg = server_config(args, preset, self.model_dir, work)
        self.results = {t: {"topology": t, "title": servers.TITLES[t], "status": "not selected",
                            "reason": "not in --topologies", "layout": "-"} for t in servers.TOPOLOGIES}
        for t in args.topologies:
            reason = servers.unavailable(t)
            self.results[t].update(status="not available" if reason else "pending", reason=reason)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:.0f}s] {msg}", flush=True)

    def pending(self, topologies) -> list:
        """Those still pending; past the deadline, each is marked not run instead."""
        for t in topologies:
            if self.results[t]["status"] == "pending" and time.monotonic() > self.deadline:
                self.results[t].update(status="not run", reason=f"time limit ({self.args.time_limit:g} s)")
        return [t for t in topologies if self.results[t]["status"] == "pending"]

    def fail(self, topologies, error: Exception) -> None:
        for t in topologies:
            if self.results[t]["status"] == "pending":
                self.results[t].update(status="failed", reason=str(error).strip().splitlines()[0][:300])

    def phases(self) -> None:
        """Each phase: start its instances, run its topologies, stop the instances."""
        for phase in dict.fromkeys(servers.PHASES.values()):
            todo = self.pending([t for t in servers.TOPOLOGIES if servers.PHASES[t] == phase])
            if not todo:
                continue
            specs = servers.phase_instances(phase, todo)
            for t in todo:
                self.results[t]["layout"] = layout(t, specs, self.gpu)
            self.log(f"phase {phase}: starting {', '.join(s['name'] for s in specs)}")
            instances = []
            try:
                instances = servers.start_instances(self.cfg, specs)
                for t in todo:
                    if self.pending([t]):
                        self.topology(t, specs, instances)
            except (RuntimeError, TimeoutError, OSError) as e:
                self.fail(todo, e)
                self.log(f"phase {phase} failed: {e}")
            finally:
                fleet.stop_all(instances)

    def topology(self, topology: str, specs, instances) -> None:
        """One load run through the topology's router or proxy (or straight to the instance)."""
        self.log(f"{topology}: {self.args.num_prompts} requests at {self.args.request_rate:g}/s")
        urls = [s.url for s in instances]
        port = fleet.free_port()
        argv = servers.front_argv(topology, specs, urls, port)
        front = None
        try:
            front = servers.start_front(self.cfg, argv, topology, port) if argv else None
            raw = self.work / f"{topology}.json"
            bench = load.bench_argv(base_url=front.url if front else urls[0], model_dir=self.model_dir,
                                    served_model_name=SERVED_NAME, dataset=self.dataset,
                                    num_prompts=self.args.num_prompts, request_rate=self.args.request_rate,
                                    seed=self.args.seed, num_warmups=NUM_WARMUPS, result_dir=self.work,
                                    result_filename=raw.name, label=topology)
            result = load.run(bench, fleet.vllm_env("0"),
                              self.work / f"{topology}-bench.log", raw, max(self.deadline - time.monotonic(), 60.0),
                              self.cfg.client_prefix, watch=[*instances, *([front] if front else [])])
        except (RuntimeError, TimeoutError, OSError) as e:
            self.fail([topology], e)
            self.log(f"{topology} failed: {e}")
            return
        finally:
            if front:
                front.stop()
        entry = figures.summarise(result)
        # the model folder as the report names it, not this machine's path
        entry["model_id"] = entry["tokenizer_id"] = f"{self.work.name}/{self.model_dir.name}"
        entry["problems"] = figures.problems(result, self.prompt_lens, self.output_lens)
        self.results[topology].update(entry, status="ok", reason=None)
        self.log(f"{topology}: {entry['completed']} completed, {entry['failed']} failed, median TTFT "
                 f"{entry['median_ttft_ms']:.1f} ms, median TPOT {entry['median_tpot_ms']:.2f} ms"
                 + "".join(f"\n  problem: {p}" for p in entry["problems"]))

    def record(self, vllm_version: str) -> dict:
        """What the JSON holds (beside the provenance the common report adds)."""
        return {"bench": "serving", "preset": self.args.preset, "device": device_name(self.gpu),
                "vllm_version": vllm_version,
                "model": {"shape": self.preset["shape"], "dtype": self.preset["dtype"], "load_format": "dummy",
                          "config": json.loads((self.model_dir / "config.json").read_text()),
                          "tokenizer": "byte-level BPE trained on generated text (vllm_ext/fleet/tokenizers.py)"},
                "load": {"generator": "vllm bench serve (vllm.benchmarks.serve)", "dataset": self.dataset_record,
                         "num_prompts": self.args.num_prompts, "request_rate": self.args.request_rate,
                         "burstiness": 1.0, "seed": self.args.seed, "ignore_eos": True, "temperature": 0,
                         "num_warmups": NUM_WARMUPS, "endpoint": "/v1/completions", "stream": True},
                "servers": {"args": ["--load-format", "dummy", "--no-enable-prefix-caching", *self.cfg.args],
                            "env": self.cfg.env},
                "notes": notes(self.gpu, self.load_before, os.getloadavg()),
                "topologies": [self.results[t] for t in servers.TOPOLOGIES]}


def main() -> int:
    args, preset = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    name = "serving-ci" if args.preset == "ci" else common_report.stem("serving", args.preset != "gpu")
    work = Path(args.out) / f"{name}-work"  # model, dataset, every process's log, vLLM's raw results
    work.mkdir(parents=True, exist_ok=True)
    import vllm

    print(f"serving: preset {args.preset}, vLLM {vllm.__version__}, work folder {work}", flush=True)
    run = Run(args, preset, work)
    interrupted = False
    try:
        run.phases()
    except KeyboardInterrupt:
        interrupted = True
        run.log("interrupted: everything started is stopped; writing what finished")
        for entry in run.results.values():
            if entry["status"] == "pending":
                entry.update(status="not run", reason="interrupted")
    data = run.record(vllm.__version__)
    report.write(args.out, name, data)
    found = report.problems_of(data)
    for p in found:
        print(f"PROBLEM {p}", file=sys.stderr)
    run.log("done: " + ", ".join(f"{t['topology']} {t['status']}" for t in data["topologies"]))
    return 130 if interrupted else 1 if found else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the run as Ctrl-C does: through every finally


def device_name(gpu: bool) -> str:
    if gpu:
        import torch

        return f"1x {torch.cuda.get_device_name(0)}"
    return f"CPU, {os.cpu_count()} cores"


def notes(gpu: bool, load_before, load_after):
    out = [f"Host load average (1 min) {load_before[0]:.2f} before the run, {load_after[0]:.2f} after it.",
           "Prefix caching is off on every instance (each topology replays the same prompts).",
           "TTFT is measured by the client (vLLM's definition); Llumnix's CI measures prefill at its API server."]
    if gpu:
        out.append("Both instances share one GPU (--gpu-memory-utilization each), started one after the other.")
    else:
        out.append("Each instance is pinned to one core (VLLM_CPU_OMP_THREADS_BIND), so one instance has half the "
                   "machine and two have all of it. The router or proxy shares those cores with them; the load "
                   "generator too, at nice -10, so that its clock is not delayed by the servers.")
    return out


if __name__ == "__main__":
    sys.exit(main())
