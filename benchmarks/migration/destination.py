"""Process 0, the destination, which measures: its pulls, their fixed costs, the ceilings and
the baselines, stage by stage (run_plan)."""

import random
import statistics
import time

import torch

from ..common.geometry import BLOCK_NBYTES, GIB, TINY_BLOCKS, make_cache, make_tiny_cache, row_checksums
from ..common.runner import WAIT_S, log, recv_within, spin_until, sync
from .baseline import baseline_recv, baseline_staging, gloo_group, nccl_join
from .llumnix import llumnix_mean, percentile99
from .report import NCCL_TOGETHER

PULL_TIMEOUT_S = 30.0  # one pull's deadline
START_AHEAD_S = 2e-3  # start-together ceiling: the agreed start is this far after the order
LATE_S = 20e-6  # a sample whose sender started later than this after the agreed time is redone


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
        """Peer copy GPU1 -> GPU0 (a same-GPU copy on a one-GPU host, where ipc's two processes
        share the GPU) and pinned host <-> device, one contiguous buffer."""
        from .report import SAME_GPU_COPY

        top = max(sizes) * BLOCK_NBYTES
        dst = torch.empty(top, dtype=torch.uint8, device=self.device)
        two = torch.cuda.device_count() > 1
        peer = torch.empty(top, dtype=torch.uint8, device=torch.device("cuda", 1 if two else 0))
        pinned = torch.empty(top, dtype=torch.uint8, pin_memory=True)
        for label, fn in (
                ("peer copy GPU1->GPU0 (ceiling)" if two else SAME_GPU_COPY, lambda k: dst[:k].copy_(peer[:k])),
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
