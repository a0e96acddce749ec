"""rayrpc between two Ray actors with host caches, and its ceiling: Ray's object store."""

import os
import random
import statistics
import time
from pathlib import Path

import torch

from ..common.geometry import BLOCK_NBYTES, GIB, TINY_BLOCKS, make_cache, make_tiny_cache, row_checksums
from ..common.runner import log
from .llumnix import llumnix_mean, percentile99
from .report import RAY_CEILING


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

    here = Path(__file__).resolve().parents[2]  # the repository root: workers import benchmarks.*
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
