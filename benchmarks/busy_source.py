"""Pulls from a source whose Python is busy: what the GIL does to a pull's source side.

A serving process runs Python on its main thread (scheduler, engine loop). A pull's source side
runs on the endpoint's server thread, which needs the GIL to read the request, enqueue its half
of the transfer and answer. This benchmark pulls with the source process in three modes:

  idle              nothing else runs in the source process
  busy              a thread runs a pure-Python loop that never blocks; the server thread gets
                    the GIL when the interpreter's switch interval (sys.getswitchinterval(),
                    5 ms by default) forces a hand-over, at every acquisition
  busy + short I/O  the same loop with a non-blocking syscall (select with a zero timeout) every
                    ~1000 iterations, as an event loop's or a queue's poll does: the loop gives
                    the GIL up and takes it straight back, so a waiting thread's forced
                    hand-over is never requested and it waits until it happens to win the GIL

Per backend and mode: 1-block pulls from a cache of 4 KiB blocks (the control cost) and 8-block
pulls of Llumnix's geometry (64 MiB), 5 ms apart so that the source's server is not spinning
on a previous pull. Reported: median, p90 and max wall time of the destination's pull. ipc
makes no request per pull (the source is not involved), so its figures show the destination
alone.

    python -m benchmarks.busy_source [--backends nccl,ipc,gloo] [--samples 10] [--out DIR]
                                     [--switch-interval MS]

With two GPUs: destination on cuda:0, source on cuda:1, backends nccl, ipc and gloo; without:
host caches and gloo. Outputs: busy-source[-cpu].md, .json, .png (with matplotlib).
"""

import argparse
import os
import random
import select
import statistics
import sys
import threading
import time

import torch

from .common import report as common_report
from .common.geometry import TINY_BLOCKS, make_cache, make_tiny_cache
from .common.runner import WAIT_S, log, recv_within, spawn, stop

MODES = ["idle", "busy", "busy + short I/O"]
BIG_BLOCKS = 8  # 64 MiB of Llumnix's geometry
NUM_BLOCKS = 16
GAP_S = 5e-3  # between pulls: past the server's post-pull spin (2 ms)
PULL_TIMEOUT_S = 60.0


def busy_loop(stop: threading.Event, short_io: bool) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i
        if short_io:
            select.select([], [], [], 0)


def source_main(conn, device, backends, switch_interval):
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from vllm_ext.migration import MigrationEndpoint

    endpoints = {}
    for backend in backends:
        endpoints[backend] = MigrationEndpoint(make_cache(device, NUM_BLOCKS, seed=1),
                                               backend=backend)
        endpoints[f"{backend}:tiny"] = MigrationEndpoint(make_tiny_cache(device, seed=3),
                                                         backend=backend)
    conn.send({k: ep.descriptor() for k, ep in endpoints.items()})
    stop, thread = threading.Event(), None
    while True:
        cmd, arg = conn.recv()
        if thread is not None:  # every command ends the current busy thread
            stop.set()
            thread.join()
            stop, thread = threading.Event(), None
        if cmd == "exit":
            break
        if cmd == "mode" and arg != "idle":
            thread = threading.Thread(target=busy_loop, args=(stop, arg == "busy + short I/O"),
                                      daemon=True)
            thread.start()
        conn.send("ok")
    for ep in endpoints.values():
        ep.close()


def measure(conn, device, backends, samples, budget_s):
    """Destination side: {backend: {mode: {"control": [...s], "64 MiB": [...s]}}}."""
    from vllm_ext.migration import MigrationEndpoint

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    descs = recv_within(conn, "the source's descriptors", 2 * WAIT_S)
    rng = random.Random(0)
    results = {}
    for backend in backends:
        eps = {"control": (MigrationEndpoint(make_tiny_cache(device, seed=4), backend=backend),
                           descs[f"{backend}:tiny"], 1, TINY_BLOCKS),
               "64 MiB": (MigrationEndpoint(make_cache(device, NUM_BLOCKS, seed=2),
                                            backend=backend), descs[backend], BIG_BLOCKS, NUM_BLOCKS)}
        for ep, desc, _, _ in eps.values():
            ep.pull(desc, [0], [0], timeout=PULL_TIMEOUT_S)  # builds the pair
        for mode in MODES:
            conn.send(("mode", mode))
            assert recv_within(conn, "mode") == "ok"
            entry = results.setdefault(backend, {}).setdefault(mode, {})
            for kind, (ep, desc, n, blocks) in eps.items():
                times, end = [], time.monotonic() + budget_s
                while len(times) < samples and (len(times) < 3 or time.monotonic() < end):
                    time.sleep(GAP_S)
                    src, dst = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
                    t = time.perf_counter()
                    ep.pull(desc, src, dst, timeout=PULL_TIMEOUT_S)
                    times.append(time.perf_counter() - t)
                entry[kind] = times
                log(f"  {backend:<5} {mode:<17} {kind:<8} median "
                           f"{statistics.median(times) * 1e3:9.3f} ms, max {max(times) * 1e3:9.3f} ms"
                           f" ({len(times)} pulls)")
        conn.send(("mode", "idle"))
        recv_within(conn, "mode")
        for ep, _, _, _ in eps.values():
            ep.close()
    conn.send(("exit", None))
    return results


def summary(times):
    v = sorted(times)
    return {"median_ms": statistics.median(v) * 1e3, "p90_ms": v[min(len(v) - 1, int(0.9 * len(v)))] * 1e3,
            "max_ms": v[-1] * 1e3, "pulls": len(v)}


def markdown(report):
    lines = [f"# Pulls from a busy source ({report['meta']['mode']})", "",
             "Wall time of the destination's pull in ms, median / p90 / max; the source process "
             "idle, or running a busy Python thread (see benchmarks/busy_source.py). "
             f"The source's switch interval: {report['meta']['switch_interval_ms']:g} ms.", "",
             "| backend | source | control cost (1 block of 4 KiB) | 64 MiB (8 blocks) |",
             "| --- | --- | --- | --- |"]
    for backend, modes in report["results"].items():
        for mode, kinds in modes.items():
            cells = [f"{s['median_ms']:.3f} / {s['p90_ms']:.3f} / {s['max_ms']:.3f}"
                     for s in (kinds["control"], kinds["64 MiB"])]
            lines.append(f"| {backend} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report, path):
    plt = common_report.pyplot()
    if plt is None:
        return False
    backends = list(report["results"])
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs = [b + (i - (len(MODES) - 1) / 2) * width for b in range(len(backends))]
        ax.bar(xs, [report["results"][b][mode]["control"]["median_ms"] for b in backends], width,
               label=f"source {mode}")
    ax.set_xticks(range(len(backends)), backends)
    ax.set_yscale("log")
    ax.set_ylabel("control cost, median (ms)")
    ax.set_title(f"Pulls from a busy source, {report['meta']['mode']}")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    common_report.save_figure(plt, fig, path)
    return True


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_source", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(common_report.DEFAULT_OUT))
    parser.add_argument("--backends", default=None, help="comma list (default: nccl,ipc,gloo with 2 "
                        "GPUs, else gloo)")
    parser.add_argument("--samples", type=int, default=10, help="pulls per backend, mode and size")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                        help="the source process's sys.setswitchinterval, in ms (default: "
                             "Python's, 5 ms)")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds per backend, mode and size after which no new pull starts "
                             "(at least 3 are made)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from vllm_ext import _lib

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and _lib.built_with_cuda() else 0
    gpu_mode = gpus >= 2
    devices = ("cuda:0", "cuda:1") if gpu_mode else ("cpu", "cpu")
    backends = (args.backends.split(",") if args.backends
                else ["nccl", "ipc", "gloo"] if gpu_mode else ["gloo"])
    mode = (f"2 GPUs ({torch.cuda.get_device_name(0)})" if gpu_mode
            else f"CPU, {os.cpu_count()} cores")
    log(f"busy-source benchmark: {mode}; backends {backends}")
    start = time.time()
    switch_s = args.switch_interval / 1e3 if args.switch_interval else None
    conn, src = spawn(source_main, devices[1], backends, switch_s)
    try:
        raw = measure(conn, devices[0], backends, args.samples, args.budget)
    finally:
        stop([src], 20)
    report = {
        "meta": {"mode": mode, "backends": backends, "samples": args.samples,
                 "switch_interval_ms": (switch_s or sys.getswitchinterval()) * 1e3,
                 "seconds": round(time.time() - start, 1)},
        "results": {b: {m: {k: summary(v) for k, v in kinds.items()} for m, kinds in modes.items()}
                    for b, modes in raw.items()},
        "samples_s": raw,
    }
    name = common_report.stem("busy-source", not gpu_mode) + (
        f"-switch{args.switch_interval:g}ms" if args.switch_interval else "")
    md = markdown(report)
    log("\n" + md)
    common_report.write(args.out, name, report, md, lambda path: plot(report, path))
    log(f"busy-source benchmark: {report['meta']['seconds']} s")


if __name__ == "__main__":
    main()
