"""Migration benchmark: pull KV blocks between two instance processes with each backend, next to
the hardware ceilings measured in the same run, a Llumnix-style baseline and Llumnix's
published CI figures.

Geometry (Qwen-7B under vLLM, as in Llumnix's CI): 32 layers, 32 KV heads, head size 128,
block size 16, bf16, flash layout: one block over all layers and K/V = 8 MiB. Sizes: 1..68
blocks (Llumnix's 8..544 MB columns) and 204 blocks (1.59 GiB).

Method (Llumnix's): speed = bytes / wall time of the destination's pull (control messages,
staging copies and syncs included); per size, `--samples` pulls of random block-id sets,
min and max dropped, mean of the rest. Units follow Llumnix's tables: "GB/s" there means GiB/s,
and so do ours (GiB = 2^30 bytes).

Rows:
  ours      MigrationEndpoint.pull with ipc / nccl / gloo (/ rayrpc on a host with Ray)
  baseline  Llumnix's data path rebuilt here: per-(layer, block, K/V) staging copies, one
            send/recv per layer (nccl: GPU staging; gloo: pinned host staging), one request
            message per pull
  ceiling   same bytes, one contiguous buffer, same run: peer copy GPU1 -> GPU0 (torch copy_),
            NCCL send/recv, gloo send/recv (one stream), pinned host <-> device copies; the
            sender is already posted when the receiver's clock starts (an NCCL sender then
            streams into NCCL's buffers ahead of the receiver: a head start no pull can have,
            since its source learns of the transfer from the request). Hence a second NCCL
            ceiling: both sides post at one agreed time, where the clock starts. rayrpc's:
            one Ray call returning one contiguous array, copied into the destination actor's
            memory
  Llumnix   the published CI figures (reference table, run 1) at the same sizes
Every pull is checked: after the samples of a size, the destination's blocks are compared
with the source's (row checksums); `wrong` counts mismatching blocks.
Fixed cost per pull: median and p99 of `--fixed-samples` 1-block pulls; and the control cost:
the same for a cache of 4 KiB blocks (one layer, one head of 64, block size 16), where moving
the bytes is free and what remains is the pull's own machinery (requests, launches, waits).
First pull from a new peer: the wall time of the first 1-block pull, which opens the control
connection and builds the pair (nccl: its communicators and staging; ipc: the mapped handles).
For nccl it is also the process's first NCCL communicator, so NCCL's one-time initialisation
is in it. connect() to another peer: the time `MigrationEndpoint.connect` takes to build the
pair with a second peer ahead of any pull (the 4 KiB cache's endpoint), and that peer's first
1-block pull after it.

    python benchmarks/migration.py [--out benchmarks/results] [--quick] [--time-limit S]
Nothing can hang: every wait has a deadline (pulls, NCCL and gloo set-up and transfers, the
pipe between the two processes), and the parent stops both processes at --time-limit (default
170 s with --quick), keeping the results of the stages that finished and naming the one that
did not.
With two GPUs: process 0 (destination) on cuda:0, process 1 (source) on cuda:1. Without two
GPUs: host caches, the CPU backends (gloo, and rayrpc when ray is importable), fewer sizes.
Outputs: migration.md, migration.json, migration.png (when matplotlib is installed).
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from queue import Empty

import torch

GEOMETRY = {"num_layers": 32, "block_size": 16, "num_kv_heads": 32, "head_size": 128}
DTYPE = torch.bfloat16
BLOCK_NBYTES = 8 << 20
GIB = 1 << 30
MIB = 1 << 20
BIG_BLOCKS = 204  # 1.59 GiB
PULL_TIMEOUT_S = 30.0  # one pull's deadline
START_AHEAD_S = 2e-3  # start-together ceiling: the agreed start is this far after the order
LATE_S = 20e-6  # a sample whose sender started later than this after the agreed time is redone
WAIT_S = 60.0  # any other single wait (set-up, a peer's answer, a raw transfer)

# Llumnix CI report 1 as posted: MiB -> GiB/s ("MB" and "GB/s" there are MiB and GiB/s).
_LLUMNIX_SIZES = [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
LLUMNIX = {
    "nccl": dict(zip(_LLUMNIX_SIZES + [136, 144, 152, 160, 168, 176, 184, 200, 208, 216, 232], [
        0.21, 0.47, 0.62, 0.79, 1.10, 1.28, 1.37, 1.54, 1.78, 1.85, 1.92, 1.87, 2.30, 1.83, 2.01,
        2.19, 2.19, 2.83, 2.50, 2.83, 4.06, 3.48, 3.54, 3.83, 3.77, 4.02, 3.38])),
    "gloo": dict(zip(_LLUMNIX_SIZES + [144, 152, 160, 168, 184, 192, 200, 224, 232, 240, 280, 304,
                                       312, 360, 384, 536], [
        0.88, 1.46, 1.85, 2.06, 2.10, 2.36, 2.56, 2.55, 2.43, 2.62, 2.38, 2.54, 2.66, 2.59, 2.48,
        2.49, 2.79, 2.86, 2.10, 1.47, 2.58, 1.31, 0.97, 2.15, 2.82, 1.80, 1.96, 0.42, 1.56, 1.64,
        0.50, 1.10])),
    "rayrpc": dict(zip(_LLUMNIX_SIZES + [136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224,
                                         232, 248, 352, 360, 448, 472, 544, 1628], [
        0.89, 1.39, 1.66, 1.80, 1.93, 2.02, 2.14, 2.18, 2.14, 2.30, 2.28, 2.27, 2.32, 2.32, 2.38,
        2.43, 2.43, 2.45, 2.56, 2.52, 2.51, 2.62, 2.50, 2.73, 2.66, 2.65, 2.44, 2.79, 2.72, 2.63,
        3.18, 3.00, 3.18, 3.35, 3.36, 3.69])),
}


def log(msg):
    print(msg, flush=True)


def llumnix_mean(values):
    """Llumnix's statistic: drop min and max, mean of the rest (plain mean below 3 samples)."""
    v = sorted(values)
    if len(v) >= 3:
        v = v[1:-1]
    return sum(v) / len(v)


def row_checksums(rows):
    """Per-row int64 checksums of a uint8 [n, block_nbytes] tensor (any device)."""
    v = rows.view(torch.int64)
    return torch.stack([v.sum(1), (v ^ (v >> 7)).sum(1)], 1).cpu()


def make_cache(device, num_blocks, seed):
    from vllm_ext import KVCache

    cache = KVCache.allocate(num_blocks=num_blocks, dtype=DTYPE, device=device, layout="flash",
                             **GEOMETRY)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        layer.view(torch.int16).random_(generator=g)
    sync(device)  # written before a peer may read it (ipc reads it directly)
    return cache


TINY_GEOMETRY = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_size": 64}  # 4 KiB
TINY_BLOCKS = 16


def make_tiny_cache(device, seed):
    """The control-cost cache: 4 KiB blocks, random bytes."""
    from vllm_ext import KVCache

    cache = KVCache.allocate(num_blocks=TINY_BLOCKS, dtype=DTYPE, device=device, layout="flash",
                             **TINY_GEOMETRY)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        layer.view(torch.int16).random_(generator=g)
    sync(device)
    return cache


def sync(device, what="device work"):
    """Waits for the current stream of `device`, at most WAIT_S (a host-blocking synchronize
    behind an NCCL receive whose sender is gone would never return)."""
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


def nccl_join(cache, uid, rank):
    """A two-rank NCCL communicator, set up under a deadline (the backend's own helper)."""
    from vllm_ext.migration.base import Deadline
    from vllm_ext.migration.nccl import _join

    return _join(cache, [uid], rank, Deadline(WAIT_S))[0]


# ---- the Llumnix-style data path, both sides --------------------------------------------------
def baseline_send(kind, cache, ids, staging, send):
    """Per layer: one copy per (block, K/V) into staging, then one send of the layer."""
    for layer in cache.layers:
        for i, b in enumerate(ids):
            for k in range(2):
                staging[i, k].copy_(layer[k, b].view(-1), non_blocking=True)
        if kind == "gloo" and cache.device.type == "cuda":
            torch.cuda.current_stream(cache.device).synchronize()
        send(staging[:len(ids)])


def baseline_recv(kind, cache, ids, staging, recv):
    for layer in cache.layers:
        if kind == "gloo":
            sync(cache.device)  # the previous layer's copies out of the staging are done
        recv(staging[:len(ids)])
        for i, b in enumerate(ids):
            for k in range(2):
                layer[k, b].view(-1).copy_(staging[i, k], non_blocking=True)
    sync(cache.device)


def baseline_staging(kind, cache, max_blocks):
    chunk = cache.chunk_nbytes // cache.dtype.itemsize
    pin = kind == "gloo" and cache.device.type == "cuda"
    device = cache.device if kind == "nccl" else "cpu"
    return torch.empty((max_blocks, 2, chunk), dtype=cache.dtype, device=device, pin_memory=pin)


# ---- process 1: the source ----------------------------------------------------------------------
def source_main(conn, device, num_blocks, backends, options):
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from vllm_ext import ops
    from vllm_ext.migration import MigrationEndpoint

    cache = make_cache(device, num_blocks, seed=1)
    endpoints = {b: MigrationEndpoint(cache, backend=b, **options.get(b, {})) for b in backends}
    tiny = make_tiny_cache(device, seed=3)
    endpoints.update({f"{b}:tiny": MigrationEndpoint(tiny, backend=b, **options.get(b, {}))
                      for b in backends})
    conn.send({b: ep.descriptor() for b, ep in endpoints.items()})
    raw = {}
    staging = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "checksum":
            conn.send(row_checksums(ops.gather_blocks(cache, args[0])))
        elif cmd == "nccl_join":
            from vllm_ext.migration import _nccl_lib

            lib = _nccl_lib.library()
            raw["nccl"] = (lib, nccl_join(cache, args[0], 1))
            raw["nccl_buf"] = torch.empty(args[1], dtype=torch.uint8, device=device)
            staging["nccl"] = baseline_staging("nccl", cache, args[2])
            conn.send("done")
        elif cmd == "gloo_join":
            raw["gloo"] = gloo_group(args[0], args[1], rank=1)
            raw["gloo_buf"] = torch.empty(args[2], dtype=torch.uint8)
            staging["gloo"] = baseline_staging("gloo", cache, args[3])
            conn.send("done")
        elif cmd == "raw_nccl":  # post the send, say so, then wait for it
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)
            lib.send(raw["nccl_buf"].data_ptr(), args[0], 0, comm, stream.cuda_stream)
            conn.send("posted")
            sync(device, "NCCL send (ceiling)")
        elif cmd == "raw_nccl_at":  # post the send at the agreed time, then wait for it
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)
            spin_until(args[1])
            late = time.monotonic() - args[1]  # > 0 when the order came after the agreed time
            lib.send(raw["nccl_buf"].data_ptr(), args[0], 0, comm, stream.cuda_stream)
            sync(device, "NCCL send (start-together ceiling)")
            conn.send(late)
        elif cmd == "raw_gloo":
            work = raw["gloo"].send([raw["gloo_buf"][:args[0]]], 0, 0)
            conn.send("posted")
            work.wait()
        elif cmd == "base_nccl":
            lib, comm = raw["nccl"]
            stream = torch.cuda.current_stream(device)

            def send(t, lib=lib, comm=comm, stream=stream):
                lib.send(t.data_ptr(), t.numel() * t.element_size(), 0, comm, stream.cuda_stream)

            baseline_send("nccl", cache, args[0], staging["nccl"], send)
            sync(device, "baseline NCCL sends")
        elif cmd == "base_gloo":
            pg = raw["gloo"]
            baseline_send("gloo", cache, args[0], staging["gloo"],
                          lambda t, pg=pg: pg.send([t], 0, 1).wait())
    for ep in endpoints.values():
        ep.close()
    if "nccl" in raw:
        raw["nccl"][0].abort(raw["nccl"][1])
    conn.send("bye")


def gloo_group(host, port, rank):
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore(host, port, 2, rank == 0, timeout=datetime.timedelta(seconds=WAIT_S),
                     wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=WAIT_S)  # every send/recv's deadline
    pg = ProcessGroupGloo(store, rank, 2, options)
    _KEEP_ALIVE.append(store)  # the group needs its store for its lifetime
    return pg


_KEEP_ALIVE = []


def percentile99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * 0.99))]


# ---- process 0: the destination, which measures ---------------------------------------------------
class Bench:
    def __init__(self, conn, device, num_blocks, backends, options, args):
        self.conn = conn
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        from vllm_ext.migration import MigrationEndpoint

        self.cache = make_cache(self.device, num_blocks, seed=2)
        self.num_blocks = num_blocks
        self.descs = recv_within(conn, "the source's descriptors", 2 * WAIT_S)
        self.src_blocks = next(iter(self.descs.values())).num_blocks if self.descs else num_blocks
        self.endpoints = {b: MigrationEndpoint(self.cache, backend=b, **options.get(b, {}))
                          for b in backends}
        self.tiny = make_tiny_cache(self.device, seed=4)
        self.endpoints.update({f"{b}:tiny": MigrationEndpoint(self.tiny, backend=b,
                                                              **options.get(b, {}))
                               for b in backends})
        self.args = args
        self.rng = random.Random(0)
        self.results = {}
        self.fixed = {}

    def ids(self, n):
        return (self.rng.sample(range(self.src_blocks), n), self.rng.sample(range(self.num_blocks), n))

    def check(self, src, dst):
        from vllm_ext import ops

        self.conn.send(("checksum", src))
        theirs = recv_within(self.conn, "checksum")
        mine = row_checksums(ops.gather_blocks(self.cache, dst))
        return int((mine != theirs).any(1).sum())

    def record(self, row, n, seconds, wrong=None):
        speeds = [n * BLOCK_NBYTES / s / GIB for s in seconds]
        entry = {"gibps": llumnix_mean(speeds), "samples_gibps": speeds,
                 "median_ms": statistics.median(seconds) * 1e3}
        if wrong is not None:
            entry["wrong"] = wrong
        self.results.setdefault(row, {})[n] = entry
        flag = "" if not wrong else f"  WRONG BLOCKS: {wrong}"
        log(f"  {row:<34} {n:>4} blocks ({n * 8:>5} MiB): {entry['gibps']:8.2f} GiB/s{flag}")

    # ours
    def pulls(self, backend, sizes, samples):
        ep, desc = self.endpoints[backend], self.descs[backend]
        t = time.perf_counter()
        ep.pull(desc, [0], [0], timeout=PULL_TIMEOUT_S)  # builds the pair
        first = self.fixed.setdefault(backend, {})["first_pull_ms"] = (time.perf_counter() - t) * 1e3
        log(f"  {backend} first pull from a new peer (connect + 1 block): {first:.1f} ms")
        for n in sizes:
            times = []
            for _ in range(samples):
                src, dst = self.ids(n)
                t = time.perf_counter()
                ep.pull(desc, src, dst, timeout=PULL_TIMEOUT_S)
                times.append(time.perf_counter() - t)
            self.record(f"{backend} (ours)", n, times, self.check(src, dst))

    def fixed_cost(self, backend, samples):
        """1-block pulls of an 8 MiB block, then of a 4 KiB block (the control cost)."""
        entry = self.fixed.setdefault(backend, {})
        entry["samples"] = samples
        for key, blocks in ((backend, self.num_blocks), (f"{backend}:tiny", TINY_BLOCKS)):
            ep, desc = self.endpoints[key], self.descs[key]
            if key == backend:
                ep.pull(desc, [0], [0], timeout=PULL_TIMEOUT_S)  # the pair exists already
            else:  # a second peer, built ahead by connect(), then its first pull
                t = time.perf_counter()
                assert ep.connect(desc, timeout=PULL_TIMEOUT_S)
                entry["connect_ms"] = (time.perf_counter() - t) * 1e3
                t = time.perf_counter()
                ep.pull(desc, [0], [0], timeout=PULL_TIMEOUT_S)
                entry["after_connect_ms"] = (time.perf_counter() - t) * 1e3
                log(f"  {backend} connect() to another peer: {entry['connect_ms']:.1f} ms, then its "
                    f"first pull: {entry['after_connect_ms']:.3f} ms")
            times = []
            for _ in range(samples):
                src, dst = self.rng.randrange(blocks), self.rng.randrange(blocks)
                t = time.perf_counter()
                ep.pull(desc, [src], [dst], timeout=PULL_TIMEOUT_S)
                times.append(time.perf_counter() - t)
            prefix = "" if key == backend else "tiny_"
            entry.update({f"{prefix}median_ms": statistics.median(times) * 1e3,
                          f"{prefix}p99_ms": percentile99(times) * 1e3})
        log(f"  {backend} 1-block pull, 8 MiB: median {entry['median_ms']:.3f} ms, p99 "
            f"{entry['p99_ms']:.3f} ms; 4 KiB (control cost): median {entry['tiny_median_ms']:.3f}"
            f" ms, p99 {entry['tiny_p99_ms']:.3f} ms")

    # ceilings and baselines
    def join_raw(self, kinds, max_blocks):
        if "nccl" in kinds:
            from vllm_ext.migration import _nccl_lib

            lib = _nccl_lib.library()
            uid = lib.unique_id()
            self.conn.send(("nccl_join", uid, max_blocks * BLOCK_NBYTES, max_blocks))
            self.nccl = (lib, nccl_join(self.cache, uid, 0))
            assert recv_within(self.conn, "nccl_join") == "done"
            self.nccl_buf = torch.empty(max_blocks * BLOCK_NBYTES, dtype=torch.uint8,
                                        device=self.device)
            self.nccl_staging = baseline_staging("nccl", self.cache, max_blocks)
        if "gloo" in kinds:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.conn.send(("gloo_join", "127.0.0.1", port, max_blocks * BLOCK_NBYTES,
                            max_blocks))
            self.gloo = gloo_group("127.0.0.1", port, rank=0)
            assert recv_within(self.conn, "gloo_join") == "done"
            self.gloo_buf = torch.empty(max_blocks * BLOCK_NBYTES, dtype=torch.uint8)
            self.gloo_staging = baseline_staging("gloo", self.cache, max_blocks)

    def raw(self, kind, sizes, samples):
        for n in sizes:
            nbytes = n * BLOCK_NBYTES
            times = []
            for _ in range(samples + 1):  # the first is a warm-up
                self.conn.send((f"raw_{kind}", nbytes))
                assert recv_within(self.conn, f"raw_{kind}") == "posted"
                t = time.perf_counter()
                if kind == "nccl":
                    lib, comm = self.nccl
                    stream = torch.cuda.current_stream(self.device)
                    lib.recv(self.nccl_buf.data_ptr(), nbytes, 1, comm, stream.cuda_stream)
                    sync(self.device, "NCCL recv (ceiling)")
                else:
                    self.gloo.recv([self.gloo_buf[:nbytes]], 1, 0).wait()
                times.append(time.perf_counter() - t)
            label = ("NCCL send/recv (ceiling)" if kind == "nccl"
                     else "gloo send/recv, one stream (ceiling)")
            self.record(label, n, times[1:])
            if kind == "nccl":
                self.raw_nccl_together(n, samples)

    def raw_nccl_together(self, n, samples):
        """The same NCCL send/recv, both sides posted at one agreed time (START_AHEAD_S after
        the order): no head start for the sender, as in a pull, where the source learns of
        the transfer from the request. The clock starts at that time. A sample where a side
        started late (the sender's order arrived after the agreed time, or the receiver was
        descheduled past it) does not count."""
        lib, comm = self.nccl
        nbytes = n * BLOCK_NBYTES
        times, late_samples = [], 0
        while len(times) < samples + 1:  # the first is a warm-up
            at = time.monotonic() + START_AHEAD_S
            self.conn.send(("raw_nccl_at", nbytes, at))
            spin_until(at)
            late = time.monotonic() - at
            stream = torch.cuda.current_stream(self.device)
            lib.recv(self.nccl_buf.data_ptr(), nbytes, 1, comm, stream.cuda_stream)
            sync(self.device, "NCCL recv (start-together ceiling)")
            elapsed = time.monotonic() - at
            if max(late, recv_within(self.conn, "raw_nccl_at")) <= LATE_S:
                times.append(elapsed)
            else:
                late_samples += 1
                if late_samples > samples:
                    raise RuntimeError(f"start-together ceiling: a side started late in "
                                       f"{late_samples} samples (order-to-start {START_AHEAD_S:g} s)")
        self.record(NCCL_TOGETHER, n, times[1:])

    def baseline(self, kind, sizes, samples):
        for n in sizes:
            times = []
            for _ in range(samples):
                src, dst = self.ids(n)
                t = time.perf_counter()
                self.conn.send((f"base_{kind}", src))
                if kind == "nccl":
                    lib, comm = self.nccl
                    stream = torch.cuda.current_stream(self.device)

                    def recv(tensor, lib=lib, comm=comm, stream=stream):
                        lib.recv(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 1,
                                 comm, stream.cuda_stream)

                    baseline_recv(kind, self.cache, dst, self.nccl_staging, recv)
                else:
                    pg = self.gloo
                    baseline_recv(kind, self.cache, dst, self.gloo_staging,
                                  lambda tensor, pg=pg: pg.recv([tensor], 1, 1).wait())
                times.append(time.perf_counter() - t)
            self.record(f"{kind} (Llumnix-style baseline)", n, times, self.check(src, dst))

    def local_copies(self, sizes, samples):
        """Peer copy GPU1 -> GPU0 and pinned host <-> device, one contiguous buffer."""
        top = max(sizes) * BLOCK_NBYTES
        dst = torch.empty(top, dtype=torch.uint8, device=self.device)
        peer = torch.empty(top, dtype=torch.uint8, device=torch.device("cuda", 1))
        pinned = torch.empty(top, dtype=torch.uint8, pin_memory=True)
        for label, fn in (
                ("peer copy GPU1->GPU0 (ceiling)", lambda k: dst[:k].copy_(peer[:k])),
                ("pinned H2D copy (ceiling)", lambda k: dst[:k].copy_(pinned[:k], non_blocking=True)),
                ("pinned D2H copy (ceiling)", lambda k: pinned[:k].copy_(dst[:k], non_blocking=True))):
            for n in sizes:
                times = []
                for _ in range(samples + 1):
                    torch.cuda.synchronize(self.device)
                    torch.cuda.synchronize(peer.device)
                    t = time.perf_counter()
                    fn(n * BLOCK_NBYTES)
                    torch.cuda.synchronize(self.device)
                    torch.cuda.synchronize(peer.device)
                    times.append(time.perf_counter() - t)
                self.record(label, n, times[1:])

    def host_copy(self, sizes, samples):
        top = max(sizes) * BLOCK_NBYTES
        a, b = torch.empty(top, dtype=torch.uint8), torch.empty(top, dtype=torch.uint8)
        b.fill_(1)
        for n in sizes:
            times = []
            for _ in range(samples + 1):
                t = time.perf_counter()
                a[:n * BLOCK_NBYTES].copy_(b[:n * BLOCK_NBYTES])
                times.append(time.perf_counter() - t)
            self.record("host memcpy (ceiling)", n, times[1:])


def dest_main(conn, out_queue, device, num_blocks, backends, options, plan):
    bench = None
    try:
        bench = Bench(conn, device, num_blocks, backends, options, plan)
        run_plan(bench, plan, lambda stage: out_queue.put(
            {"stage": stage, "results": bench.results, "fixed": bench.fixed}))
        out_queue.put({"done": True, "results": bench.results, "fixed": bench.fixed})
    except BaseException as e:
        import traceback

        out_queue.put({"done": True, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                       "results": bench.results if bench else {},
                       "fixed": bench.fixed if bench else {}})
    finally:
        for ep in (bench.endpoints.values() if bench else ()):
            ep.close()
        conn.send(("exit",))
        try:
            recv_within(conn, "exit", 10)
        except (EOFError, TimeoutError):
            pass


def run_plan(bench, plan, starting):
    """Runs the stages in order; `starting(name)` reports each stage (with the results so far)
    to the parent, which names the stage that overran its time limit."""
    samples = plan["samples"]
    for backend in plan["backends"]:
        sizes = plan["sizes"] if backend in ("ipc", "nccl") else plan["slow_sizes"]
        starting(f"{backend} (ours)")
        log(f"[{backend}] ours, {len(sizes)} sizes x {samples} pulls")
        bench.pulls(backend, sizes, samples)
        starting(f"{backend} fixed cost")
        bench.fixed_cost(backend, plan["fixed_samples"])
    raw_kinds = [k for k in ("nccl", "gloo") if k in plan["backends"]]
    starting("raw " + "/".join(raw_kinds) + " set-up")
    bench.join_raw(raw_kinds, max(plan["sizes"] + plan["slow_sizes"]))
    for kind in raw_kinds:
        sizes = plan["sizes"] if kind == "nccl" else plan["slow_sizes"]
        starting(f"{kind} ceiling")
        log(f"[{kind}] ceiling: send/recv of one contiguous buffer")
        bench.raw(kind, sizes, samples)
        starting(f"{kind} Llumnix-style baseline")
        log(f"[{kind}] Llumnix-style baseline")
        bench.baseline(kind, plan["slow_sizes"], samples)
    if bench.cuda:
        starting("local copies")
        log("[copies] peer copy and pinned host copies of one contiguous buffer")
        bench.local_copies(plan["sizes"], samples)
    else:
        starting("host memcpy")
        log("[copies] host memcpy of one contiguous buffer")
        bench.host_copy(plan["slow_sizes"], samples)


# ---- rayrpc (host caches, Ray actors) -------------------------------------------------------------
def measure_rayrpc(sizes, samples, fixed_samples, num_blocks):
    import ray

    class Instance:
        def __init__(self, seed):
            from vllm_ext.migration import MigrationEndpoint

            self.cache = make_cache(torch.device("cpu"), num_blocks, seed)
            self.ep = MigrationEndpoint(self.cache, backend="rayrpc")
            self.tiny = make_tiny_cache(torch.device("cpu"), seed)
            self.ep_tiny = MigrationEndpoint(self.tiny, backend="rayrpc")

        def descriptor(self):
            return self.ep.descriptor(), self.ep_tiny.descriptor()

        def checksum(self, ids):
            from vllm_ext import ops

            return row_checksums(ops.gather_blocks(self.cache, ids))

        def blob(self, nbytes):
            """The ceiling's source side: nbytes of random bytes as one array (Ray copies it
            into its object store as it stores the result); made at the first (warm-up) call."""
            import numpy as np

            if getattr(self, "_blob", None) is None or self._blob.size < nbytes:
                self._blob = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            return self._blob[:nbytes]

        def raw(self, src, nbytes, count):
            """The ceiling: one Ray call to `src` for nbytes as one contiguous array, and the
            copy of what ray.get maps into this actor's memory; the first is a warm-up."""
            import numpy as np

            sink = np.empty(nbytes, np.uint8)
            times = []
            for _ in range(count + 1):
                t = time.perf_counter()
                np.copyto(sink, ray.get(src.blob.remote(nbytes), timeout=120))
                times.append(time.perf_counter() - t)
            return times[1:]

        def pulls(self, desc, n, count, seed, tiny=False):
            rng = random.Random(seed)
            times, last = [], None
            ep, blocks = (self.ep_tiny, TINY_BLOCKS) if tiny else (self.ep, num_blocks)
            ep.pull(desc, [0], [0], timeout=120)
            for _ in range(count):
                src, dst = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
                t = time.perf_counter()
                ep.pull(desc, src, dst, timeout=120)
                times.append(time.perf_counter() - t)
                last = (src, dst, None if tiny else self.checksum(dst))
            return times, last

    here = Path(__file__).resolve().parent.parent
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     p for p in (str(here), os.environ.get("PYTHONPATH")) if p)}})
    actor = ray.remote(max_concurrency=2)(Instance)
    src, dst = actor.remote(1), actor.remote(2)
    desc, tiny_desc = ray.get(src.descriptor.remote())
    results, fixed = {}, {}
    for n in sizes:
        times, (src_ids, _, mine) = ray.get(dst.pulls.remote(desc, n, samples, n))
        theirs = ray.get(src.checksum.remote(src_ids))
        speeds = [n * BLOCK_NBYTES / s / GIB for s in times]
        wrong = int((mine != theirs).any(1).sum())
        results[n] = {"gibps": llumnix_mean(speeds), "samples_gibps": speeds,
                      "median_ms": statistics.median(times) * 1e3, "wrong": wrong}
        log(f"  {'rayrpc (ours)':<34} {n:>4} blocks ({n * 8:>5} MiB): "
            f"{results[n]['gibps']:8.2f} GiB/s" + (f"  WRONG BLOCKS: {wrong}" if wrong else ""))
    ceiling = {}
    for n in sizes:
        times = ray.get(dst.raw.remote(src, n * BLOCK_NBYTES, samples))
        speeds = [n * BLOCK_NBYTES / s / GIB for s in times]
        ceiling[n] = {"gibps": llumnix_mean(speeds), "samples_gibps": speeds,
                      "median_ms": statistics.median(times) * 1e3}
        log(f"  {RAY_CEILING:<34} {n:>4} blocks ({n * 8:>5} MiB): {ceiling[n]['gibps']:8.2f} GiB/s")
    times, _ = ray.get(dst.pulls.remote(desc, 1, fixed_samples, 7))
    tiny_times, _ = ray.get(dst.pulls.remote(tiny_desc, 1, fixed_samples, 8, True))
    fixed = {"median_ms": statistics.median(times) * 1e3, "p99_ms": percentile99(times) * 1e3,
             "tiny_median_ms": statistics.median(tiny_times) * 1e3,
             "tiny_p99_ms": percentile99(tiny_times) * 1e3, "samples": len(times)}
    log(f"  rayrpc 1-block pull, 8 MiB: median {fixed['median_ms']:.3f} ms, p99 "
        f"{fixed['p99_ms']:.3f} ms; 4 KiB (control cost): median {fixed['tiny_median_ms']:.3f} ms,"
        f" p99 {fixed['tiny_p99_ms']:.3f} ms")
    ray.kill(src)
    ray.kill(dst)
    if started:
        ray.shutdown()
    return results, ceiling, fixed


# ---- report ---------------------------------------------------------------------------------------
NCCL_TOGETHER = "NCCL send/recv, both sides start together (ceiling)"
RAY_CEILING = "Ray object store, actor to actor (ceiling)"
# (row, its ceiling, Llumnix's published row); a row may also have a second ceiling (EXTRA_RATIOS)
ROW_ORDER = [
    ("ipc (ours)", "peer copy GPU1->GPU0 (ceiling)", None),
    ("nccl (ours)", "NCCL send/recv (ceiling)", "nccl"),
    ("nccl (Llumnix-style baseline)", "NCCL send/recv (ceiling)", None),
    ("gloo (ours)", "gloo send/recv, one stream (ceiling)", "gloo"),
    ("gloo (Llumnix-style baseline)", "gloo send/recv, one stream (ceiling)", None),
    ("rayrpc (ours)", "Ray object store, actor to actor (ceiling)", "rayrpc"),
]
EXTRA_RATIOS = {"nccl (ours)": (NCCL_TOGETHER, "nccl (ours) / start-together ceiling")}
CEILING_ROWS = ["peer copy GPU1->GPU0 (ceiling)", "NCCL send/recv (ceiling)", NCCL_TOGETHER,
                "gloo send/recv, one stream (ceiling)", "pinned H2D copy (ceiling)",
                "pinned D2H copy (ceiling)", "host memcpy (ceiling)", RAY_CEILING]


def size_label(n):
    return f"{n * 8} MiB" if n < 128 else f"{n * BLOCK_NBYTES / GIB:.2f} GiB"


def markdown(report):
    results = report["results"]
    columns = [n for n in report["table_sizes"]
               if any(n in results.get(r, {}) for r in results)]
    head = "| migration_size | " + " | ".join(size_label(n) for n in columns) + " |"
    lines = [head, "|" + " --- |" * (len(columns) + 1)]

    def cell(row, n):
        e = results.get(row, {}).get(n)
        if e is None:
            return "-"
        return f"{e['gibps']:.2f}" + (f" ({e['wrong']} wrong)" if e.get("wrong") else "")

    for ours, ceiling, published in ROW_ORDER:
        if ours not in results:
            continue
        lines.append(f"| {ours} | " + " | ".join(cell(ours, n) for n in columns) + " |")
        for ceil, label in ((ceiling, f"{ours} / ceiling"), EXTRA_RATIOS.get(ours, (None, None))):
            if ceil and ceil in results:
                ratios = []
                for n in columns:
                    a, c = results[ours].get(n), results[ceil].get(n)
                    ratios.append(f"{a['gibps'] / c['gibps']:.0%}" if a and c else "-")
                lines.append(f"| {label} | " + " | ".join(ratios) + " |")
        if published:
            pub = LLUMNIX[published]
            row = [f"{pub[n * 8]:.2f}" if n * 8 in pub else
                   (f"{pub[1628]:.2f}" if n == BIG_BLOCKS and 1628 in pub else "-")
                   for n in columns]
            lines.append(f"| Llumnix {published} (published) | " + " | ".join(row) + " |")
            if ours in results:
                ratio = [f"{results[ours][n]['gibps'] / pub[n * 8]:.1f}x"
                         if n in results[ours] and n * 8 in pub else "-" for n in columns]
                lines.append(f"| {published} ours / Llumnix | " + " | ".join(ratio) + " |")
    for ceiling in CEILING_ROWS:
        if ceiling in results:
            lines.append(f"| {ceiling} | " + " | ".join(cell(ceiling, n) for n in columns) + " |")
    lines.append("")
    lines.append("| backend | 1-block pull, 8 MiB: median (ms) | p99 (ms) "
                 "| control cost (1-block pull, 4 KiB): median (ms) | p99 (ms) "
                 "| first pull from a new peer (connect + 1 block, ms) "
                 "| connect() to another peer (ms) | first pull after connect() (ms) |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = ("median_ms", "p99_ms", "tiny_median_ms", "tiny_p99_ms", "first_pull_ms", "connect_ms",
            "after_connect_ms")
    for backend, f in report["fixed"].items():
        cells = [(f"{f[k]:.1f}" if k in ("first_pull_ms", "connect_ms") else f"{f[k]:.3f}")
                 if k in f else "-" for k in keys]
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    text = [f"# KV migration benchmark ({report['meta']['mode']})", "",
            "Speeds in GiB/s (Llumnix's \"GB/s\"): bytes / wall time of the destination's pull, "
            "min and max of the samples dropped, mean of the rest. Ceilings move the same bytes "
            "as one contiguous buffer in the same run.", ""] + lines
    if report["notes"]:
        text += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(text) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path):
    """Writes `fig` as a PNG at `path` and frees it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(report, path):
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(10, 6))
    for row, entries in report["results"].items():
        sizes = sorted(entries)
        style = "--" if "ceiling" in row else ("-." if "baseline" in row else "-")
        ax.plot([n * 8 for n in sizes], [entries[n]["gibps"] for n in sizes], style,
                marker=".", label=row)
    for name, pub in LLUMNIX.items():
        xs = sorted(k for k in pub if k <= 600)
        ax.plot(xs, [pub[k] for k in xs], ":", label=f"Llumnix {name} (published)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("migration size (MiB)")
    ax.set_ylabel("GiB/s")
    ax.set_title(f"KV migration, {report['meta']['mode']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(plt, fig, path)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
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
    # OpenMP workers that spin after each torch CPU op starve gloo's I/O threads on small hosts
    # (measured on 2 cores: the per-layer baseline ran 10-40x slower); children inherit this.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from vllm_ext import _lib

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and _lib.built_with_cuda() else 0
    gpu_mode = gpus >= 2 and not args.cpu
    notes = []
    try:
        import ray  # noqa: F401

        have_ray = True
    except ImportError:
        have_ray = False
    if gpu_mode:
        default = ["ipc", "nccl", "gloo"]
        sizes = list(range(1, 69)) + [BIG_BLOCKS]
        slow = [1, 2, 3, 4, 6, 8, 12, 16, 24, 29, 32, 48, 64, 68, BIG_BLOCKS]
        if args.quick:
            sizes, slow = [1, 2, 4, 8, 16, 29, 64, 68], [1, 4, 16, 64]
        table = [1, 2, 4, 8, 16, 29, 64, 68, BIG_BLOCKS]
        num_blocks = 256
        devices = ("cuda:0", "cuda:1")
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
                     + ("fewer than 2 GPUs" if not args.cpu else "--cpu") + "; GPU rows absent.")
        if not have_ray:
            notes.append("rayrpc skipped: ray is not installed.")
    backends = args.backends.split(",") if args.backends else default
    samples = args.samples or (3 if args.quick else 5)
    fixed_samples = args.fixed_samples or (20 if args.quick else 100)
    options = {"gloo": {}, "nccl": {}, "ipc": {}}
    for item in args.set:
        try:
            key, value = item.split("=", 1)
            backend, option = key.split(".", 1)
            options.setdefault(backend, {})[option] = int(value)
        except ValueError:
            parser.error(f"--set {item!r}: expected BACKEND.OPTION=INT")
    mode = (f"2 GPUs ({torch.cuda.get_device_name(0)})" if gpu_mode
            else f"CPU, {os.cpu_count()} cores")
    log(f"migration benchmark: {mode}; backends {backends}; {samples} samples per size; "
        f"geometry {GEOMETRY} bf16 = 8 MiB per block")
    start = time.time()

    proc_backends = [b for b in backends if b != "rayrpc"]
    results, fixed, error = {}, {}, None
    if proc_backends:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        queue = ctx.Queue()
        plan = {"backends": proc_backends, "sizes": sizes, "slow_sizes": slow,
                "samples": samples, "fixed_samples": fixed_samples}
        src = ctx.Process(target=source_main, args=(b, devices[1], num_blocks, proc_backends,
                                                    options), daemon=True)
        dst = ctx.Process(target=dest_main, args=(a, queue, devices[0], num_blocks,
                                                  proc_backends, options, plan), daemon=True)
        src.start()
        dst.start()
        limit = args.time_limit or (170.0 if args.quick else 1500.0)
        out, stage = {"results": {}, "fixed": {}}, "start-up"
        end = time.monotonic() + limit
        try:
            while True:
                remaining = end - time.monotonic()
                try:
                    msg = queue.get(timeout=max(min(remaining, 5.0), 0.01))
                except Empty:  # check the deadline and the processes
                    if time.monotonic() >= end:
                        out["error"] = (f"stopped at the time limit ({limit:g} s) during stage "
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
            for p in (dst, src):
                p.join(10 if out.get("error") is None else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(10)
        results, fixed = out["results"], out["fixed"]
        error = out.get("error")
        if error:
            log(f"ERROR in the two-process part:\n{error}")
    if "rayrpc" in backends and have_ray:
        log(f"[rayrpc] ours, {len(slow)} sizes x {samples} pulls (Ray actors, host caches)")
        ray_results, ray_ceiling, ray_fixed = measure_rayrpc(slow, samples, fixed_samples,
                                                             max(64, max(slow) + 1))
        results["rayrpc (ours)"] = ray_results
        results[RAY_CEILING] = ray_ceiling
        fixed["rayrpc"] = ray_fixed
        if gpu_mode:
            notes.append("rayrpc ran on host caches here (the GPU machine has Ray).")

    report = {
        "meta": {"mode": mode, "geometry": GEOMETRY, "dtype": "bfloat16", "options": options,
                 "block_nbytes": BLOCK_NBYTES, "samples": samples, "backends": backends,
                 "torch": torch.__version__, "python": platform.python_version(),
                 "host": platform.node(), "date": datetime.datetime.now().isoformat(),
                 "seconds": round(time.time() - start, 1)},
        "table_sizes": table, "results": results, "fixed": fixed, "notes": notes,
        "error": error,
        "llumnix_published": {k: {str(s): v for s, v in d.items()} for k, d in LLUMNIX.items()},
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "migration" if gpu_mode else "migration-cpu"
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out_dir / f"{stem}.md").write_text(md)
    png = plot(report, out_dir / f"{stem}.png")
    log("\n" + md)
    log(f"wrote {out_dir / (stem + '.md')}, .json" + (", .png" if png else
                                                        " (no plot: matplotlib missing)")
        + f" in {report['meta']['seconds']} s")
    wrong = sum(e.get("wrong", 0) for r in results.values() for e in r.values())
    if error or wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
