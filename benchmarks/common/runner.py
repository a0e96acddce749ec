"""Running a benchmark across two processes: spawn them, talk over a pipe with deadlines, start
both sides of a transfer together, and stop whatever is left.

Nothing may hang: every wait here has a deadline (a host-blocking synchronize behind an NCCL
receive whose sender is gone would never return).
"""

import multiprocessing as mp
import time
from queue import Empty

import torch

WAIT_S = 60.0  # any single wait: set-up, a peer's answer, a raw transfer


def log(msg):
    print(msg, flush=True)


def sync(device, what="device work"):
    """Waits for the current stream of `device`, at most WAIT_S."""
    if device.type == "cuda":
        from vllm_ext.migration.base import Deadline, wait_cuda_event

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        wait_cuda_event(event, Deadline(WAIT_S), what)


def spin_until(at):
    """Busy-waits until time.monotonic() reaches `at` (CLOCK_MONOTONIC: one clock for both
    processes of one host), so that both sides of a transfer start within microseconds."""
    while time.monotonic() < at:
        pass


def recv_within(conn, what, seconds=WAIT_S):
    """The next message on the pipe between the two processes, or TimeoutError."""
    if not conn.poll(seconds):
        raise TimeoutError(f"{what}: no message from the other process within {seconds:g} s")
    return conn.recv()


def spawn(target, *args):
    """Starts `target(conn, *args)` in a spawned daemon process; returns (our end, process)."""
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=target, args=(theirs, *args), daemon=True)
    proc.start()
    return ours, proc


def stop(procs, grace_s):
    """Joins each process for `grace_s` seconds, then kills the survivors."""
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join(10)


def run_two(source, source_args, destination, destination_args, limit_s):
    """Runs `source(conn, *source_args)` and `destination(conn, queue, *destination_args)` in two
    spawned processes joined by a pipe. The destination puts {"stage", "results", "fixed"} on
    the queue as each stage starts, and finally the same with "done" (and "error" on failure).
    Returns the last results, with "error" set when the destination failed, exited, or was
    still running at `limit_s` (both processes are then stopped)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    queue = ctx.Queue()
    src = ctx.Process(target=source, args=(b, *source_args), daemon=True)
    dst = ctx.Process(target=destination, args=(a, queue, *destination_args), daemon=True)
    src.start()
    dst.start()
    out, stage = {"results": {}, "fixed": {}}, "start-up"
    end = time.monotonic() + limit_s
    try:
        while True:
            remaining = end - time.monotonic()
            try:
                msg = queue.get(timeout=max(min(remaining, 5.0), 0.01))
            except Empty:  # check the deadline and the processes
                if time.monotonic() >= end:
                    out["error"] = (f"stopped at the time limit ({limit_s:g} s) during stage "
                                    f"{stage!r}; the stages before it are reported")
                    break
                if not dst.is_alive():
                    out["error"] = (f"the destination process exited (code {dst.exitcode}) "
                                    f"during stage {stage!r}")
                    break
                continue
            out.update(results=msg["results"], fixed=msg["fixed"])
            if msg.get("done"):
                out["error"] = msg.get("error")
                break
            stage = msg["stage"]
    finally:
        stop((dst, src), 10 if out.get("error") is None else 0.1)
    return out
