"""The migration benchmark's plan: which backends, sizes and samples; the two processes; rayrpc;
the report. See __init__.py for the method."""

import argparse
import os
import sys
import time

import torch

from ..common import noise
from ..common import report as common_report
from ..common.geometry import BLOCK_NBYTES, GEOMETRY
from ..common.runner import log, run_two
from .destination import dest_main
from .llumnix import LLUMNIX
from .rayrpc import measure_rayrpc
from .report import BIG_BLOCKS, RAY_CEILING, markdown, plot, ratios_above_ceiling, spreads
from .source import source_main


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.migration",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(common_report.DEFAULT_OUT))
    parser.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    parser.add_argument("--samples", type=int, default=None, help="pulls per size (default 5)")
    parser.add_argument("--fixed-samples", type=int, default=None)
    parser.add_argument("--backends", default=None,
                        help="comma list (default: ipc,nccl,gloo with 2 GPUs; gloo,rayrpc without)")
    parser.add_argument("--cpu", action="store_true", help="host caches even with GPUs")
    parser.add_argument("--set", action="append", default=[], metavar="BACKEND.OPTION=INT",
                        help="a backend option for both processes, e.g. nccl.chunk_bytes=16777216 "
                             "or gloo.stripes=8 (repeatable)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the two-process part; then both processes are stopped "
                             "and the finished stages reported (default 170 with --quick, else "
                             "1500)")
    args = parser.parse_args()
    args.options = {"gloo": {}, "nccl": {}, "ipc": {}}
    for item in args.set:
        try:
            key, value = item.split("=", 1)
            backend, option = key.split(".", 1)
            args.options.setdefault(backend, {})[option] = int(value)
        except ValueError:
            parser.error(f"--set {item!r}: expected BACKEND.OPTION=INT")
    return args


def make_plan(args, gpu_mode, have_ray):
    """Backends, sizes (all sizes for ipc/nccl, `slow` ones for the rest), table columns,
    devices and notes for this machine."""
    notes = []
    if gpu_mode:
        default = ["ipc", "nccl", "gloo"] if gpu_mode == 2 else ["ipc", "gloo"]
        sizes = list(range(1, 69)) + [BIG_BLOCKS]
        slow = [1, 2, 3, 4, 6, 8, 12, 16, 24, 29, 32, 48, 64, 68, BIG_BLOCKS]
        if args.quick:
            sizes, slow = [1, 2, 4, 8, 16, 29, 64, 68], [1, 4, 16, 64]
        table = [1, 2, 4, 8, 16, 29, 64, 68, BIG_BLOCKS]
        num_blocks = 256
        devices = ("cuda:0", "cuda:1") if gpu_mode == 2 else ("cuda:0", "cuda:0")
        if gpu_mode == 1:
            notes.append("one GPU: both processes on it; ipc's ceiling is a same-GPU copy; nccl needs two "
                         "GPUs (NCCL refuses two ranks on one GPU) and is absent.")
        if not have_ray:
            notes.append("rayrpc skipped: ray is not installed on this machine; it is measured "
                         "on a host without GPUs, with host caches (see that run's report).")
    else:
        default = ["gloo"] + (["rayrpc"] if have_ray else [])
        sizes = slow = [1, 2, 4, 8, 16, 29] if not args.quick else [1, 4, 16]
        table = sizes
        num_blocks = 64
        devices = ("cpu", "cpu")
        notes.append(f"host caches on the CPU ({os.cpu_count()} cores): "
                     + ("no GPU" if not args.cpu else "--cpu") + "; GPU rows absent.")
        if not have_ray:
            notes.append("rayrpc skipped: ray is not installed.")
    return {"backends": args.backends.split(",") if args.backends else default,
            "sizes": sizes, "slow_sizes": slow, "table": table, "num_blocks": num_blocks,
            "devices": devices, "notes": notes,
            "samples": args.samples or (3 if args.quick else 5),
            "fixed_samples": args.fixed_samples or (20 if args.quick else 100)}


def main():
    args = parse_args()
    # OpenMP workers that spin after each torch CPU op starve gloo's I/O threads on small hosts
    # (measured on 2 cores: the per-layer baseline ran 10-40x slower); children inherit this.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from vllm_ext import _lib

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and _lib.built_with_cuda() else 0
    gpu_mode = 0 if args.cpu else min(gpus, 2)  # 2: two GPUs, 1: both processes on one
    try:
        import ray  # noqa: F401

        have_ray = True
    except ImportError:
        have_ray = False
    plan = make_plan(args, gpu_mode, have_ray)
    backends, samples, slow, notes = plan["backends"], plan["samples"], plan["slow_sizes"], plan["notes"]
    mode = (f"{gpu_mode} GPU(s) ({torch.cuda.get_device_name(0)})" if gpu_mode
            else f"CPU, {os.cpu_count()} cores")
    log(f"migration benchmark: {mode}; backends {backends}; {samples} samples per size; "
        f"geometry {GEOMETRY} bf16 = 8 MiB per block")
    host = noise.Host()  # before any work of ours: the load others put on the host
    start = time.time()

    proc_backends = [b for b in backends if b != "rayrpc"]
    results, fixed, error = {}, {}, None
    if proc_backends:
        stages = {"backends": proc_backends, "sizes": plan["sizes"], "slow_sizes": slow,
                  "samples": samples, "fixed_samples": plan["fixed_samples"]}
        src_device, dst_device = plan["devices"][1], plan["devices"][0]
        out = run_two(source_main, (src_device, plan["num_blocks"], proc_backends, args.options),
                      dest_main, (dst_device, plan["num_blocks"], proc_backends, args.options, stages),
                      args.time_limit or (170.0 if args.quick else 1500.0))
        results, fixed, error = out["results"], out["fixed"], out.get("error")
        if error:
            log(f"ERROR in the two-process part:\n{error}")
    if "rayrpc" in backends and have_ray:
        log(f"[rayrpc] ours, {len(slow)} sizes x {samples} pulls (Ray actors, host caches)")
        ray_results, ray_ceiling, ray_fixed = measure_rayrpc(slow, samples, plan["fixed_samples"],
                                                             max(64, max(slow) + 1))
        results["rayrpc (ours)"] = ray_results
        results[RAY_CEILING] = ray_ceiling
        fixed["rayrpc"] = ray_fixed
        if gpu_mode:
            notes.append("rayrpc ran on host caches here (the GPU machine has Ray).")

    report = {
        "meta": {"mode": mode, "gpus": gpu_mode, "geometry": GEOMETRY, "dtype": "bfloat16", "options": args.options,
                 "block_nbytes": BLOCK_NBYTES, "samples": samples, "backends": backends,
                 "seconds": round(time.time() - start, 1)},
        "table_sizes": plan["table"], "results": results, "fixed": fixed, "notes": notes,
        "error": error,
        "llumnix_published": {k: {str(s): v for s, v in d.items()} for k, d in LLUMNIX.items()},
    }
    report["host"] = host.verdict(spreads(report), ratios_above_ceiling(report))
    if report["host"]["noisy"]:
        log("NOISY HOST: " + "; ".join(report["host"]["reasons"]))
    md = markdown(report)
    log("\n" + md)
    name = "migration-1gpu" if gpu_mode == 1 else common_report.stem("migration", not gpu_mode)
    common_report.write(args.out, name, report, md,
                        lambda path: plot(report, path))
    log(f"migration benchmark: {report['meta']['seconds']} s")
    wrong = sum(e.get("wrong", 0) for r in results.values() for e in r.values())
    if error or wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
