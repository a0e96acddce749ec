"""Kernel benchmark: gather, scatter and peer copy of KV blocks on Llumnix's geometry, each
next to the hardware ceiling measured in the same run and two baselines.

Geometry (Qwen-7B under vLLM, as in Llumnix's CI): 32 layers, 32 KV heads, head size 128,
block size 16, bf16, flash layout: one block over all layers and K/V = 8 MiB.

Measured per size (1, 2, 4, 8, 16, 32, 68 blocks and 1 GiB = 128 blocks):
  gather    paged cache -> contiguous buffer (ops.gather_blocks)
  scatter   buffer -> paged cache            (ops.scatter_blocks)
  peer      paged cache on GPU0 -> paged cache on GPU1, kernel on GPU1 (ops.copy_blocks)
  digest    one 64-bit digest per block, read in place (ops.block_digests, enqueue only)
Ceilings, same bytes, same run: device-to-device copy of one contiguous buffer (torch copy_),
for peer the peer copy of one contiguous buffer GPU0 -> GPU1, and for digest (which only
reads) torch's float32 sum of one contiguous buffer.
Baselines: `memcpy` = one cudaMemcpyAsync per (block, layer, K/V) issued from C (how vLLM's
swap_blocks and Llumnix copy); `torch` = index_select / index_copy_ per layer; for digest,
torch's per-layer digest (index_select, the words widened to int64, times weights, summed).

Formulas: GB/s = payload bytes (blocks x 8 MiB) / median time, GB = 1e9 bytes; % of ceiling =
our GB/s / ceiling GB/s at the same size; speed-up = baseline time / our time. Times come from
CUDA events around each call after a warm-up; inputs rotate over enough id sets and buffers
that the working set exceeds L2. Every measured op's output is checked against the memcpy
baseline's (`wrong` column).

    python -m benchmarks.kernels [--out DIR] [--quick] [--iters N] [--sizes 1,8,68]
Without a GPU it measures the CPU implementation (gather and scatter of host caches, timed on
the host clock) next to torch's copy_ of the same bytes. Its figures are not comparable with a
GPU run's (the README's and benchmarks/results' are an H200's).

Every report says whether the host was noisy (common/noise.py: the load average around the run,
the spread of each row's repeats), and a ratio above its ceiling (more than timing noise above
one contiguous copy of the same bytes) is printed as unreliable, not as a result; with a noisy
host the targets are not judged.
Outputs: kernels[-cpu].md, .json, .png (when matplotlib is installed).
"""

import argparse
import array
import ctypes
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

from vllm_ext import KVCache, _lib, build_info, ops

from .common import noise, report
from .common.geometry import DTYPE, GEOMETRY, MIB

SIZES_BLOCKS = [1, 2, 4, 8, 16, 32, 68, 128]
ROTATE_BYTES = 512 << 20  # working set per size: well past the H200's 50 MB L2
WARMUP_CALLS = 3  # per op and size, before the timed calls

TARGETS = [
    # (op, min blocks, min fraction of ceiling, label)
    ("gather", 8, 0.90, "gather >= 64 MiB: 90% of device copy"),
    ("scatter", 8, 0.90, "scatter >= 64 MiB: 90% of device copy"),
    ("peer", 8, 0.85, "peer >= 64 MiB: 85% of peer copy"),
    ("gather", 1, 0.50, "gather 8 MiB: 50% of device copy"),
    ("scatter", 1, 0.50, "scatter 8 MiB: 50% of device copy"),
]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- timing -------------------------------------------------------------------------------------
class Timer:
    """Times callables with CUDA events on the current stream of `device` (or the host clock)."""

    def __init__(self, device, peer_device=None):
        self.device, self.peer_device = device, peer_device

    def _once(self, fn):
        if self.device.type == "cpu":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        if self.peer_device is not None:
            # Work torch puts on the source GPU's stream starts after `start` and ends before `end`.
            peer_stream = torch.cuda.current_stream(self.peer_device)
            peer_stream.wait_event(start)
        fn()
        if self.peer_device is not None:
            done = torch.cuda.Event()
            done.record(peer_stream)
            stream.wait_event(done)
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    def graph_ms(self, fns, calls=32, replays=7):
        """Device time per call: `calls` calls (rotating over `fns`) captured back to back in
        one CUDA graph, so launch gaps and host overhead drop out; median over replays."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for fn in fns[:3]:
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(max(calls, len(fns))):
                fns[i % len(fns)]()
        count = max(calls, len(fns))
        graph.replay()
        torch.cuda.synchronize(self.device)
        samples = [self._once(graph.replay) / count for _ in range(replays)]
        return statistics.median(samples), min(samples), max(samples)

    def median_ms(self, fns, iters, warmup=WARMUP_CALLS):
        for i in range(warmup):
            fns[i % len(fns)]()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        samples = [self._once(fns[i % len(fns)]) for i in range(iters)]
        return statistics.median(samples), min(samples), max(samples)


# ---- the memcpy baseline (C loop of cudaMemcpyAsync) ------------------------------------------
class HostSide:
    """A vllm_ext_side with host-side tables, as the memcpy baseline wants."""

    def __init__(self, cache=None, ids=None, buf=None, block_nbytes=0, chunk=0, components=2):
        self._keep = []
        if cache is not None:
            table = (ctypes.c_uint64 * cache.num_layers)(*cache.layer_addresses)
            id_array = (ctypes.c_int64 * len(ids))(*ids)
            self._keep += [table, id_array]
            self.side = _lib.Side(ctypes.addressof(table), 0, 0, cache.block_stride, cache.component_stride,
                                  cache.num_blocks, ctypes.addressof(id_array))
        else:
            self.side = _lib.Side(None, buf.data_ptr(), components * chunk, block_nbytes, chunk, buf.shape[0],
                                  None)


def memcpy_baseline(src: HostSide, dst: HostSide, n, cache, device):
    stream = torch.cuda.current_stream(device).cuda_stream
    _lib.copy_blocks_memcpy(src.side, dst.side, n, cache.num_layers, cache.num_components, cache.slice_nbytes,
                            device.index, stream)


# ---- the torch baseline (index_select / index_copy_ per layer) --------------------------------
def torch_gather(cache, ids_dev, out):
    view = out.view(out.shape[0], cache.num_layers, 2, -1).view(cache.dtype)
    for layer, t in enumerate(cache.layers):
        picked = t.index_select(1, ids_dev)  # [2, n, bs, h, d]
        view[:, layer].copy_(picked.flatten(2).transpose(0, 1))


def torch_scatter(buf, cache, ids_dev):
    view = buf.view(buf.shape[0], cache.num_layers, 2, -1).view(cache.dtype)
    shape = (2, buf.shape[0], cache.block_size, cache.num_kv_heads, cache.head_size)
    for layer, t in enumerate(cache.layers):
        t.index_copy_(1, ids_dev, view[:, layer].transpose(0, 1).reshape(shape))


def torch_digest(cache, ids_dev, weights):
    """The block digest in torch ops, per layer (what the connector did before ops.block_digests):
    the blocks' bytes as int64 words, times per-position weights, summed, layers chained."""
    acc = None
    for t in cache.layers:
        rows = t.index_select(1, ids_dev).transpose(0, 1).reshape(ids_dev.numel(), -1)
        words = rows.view(torch.int32).to(torch.int64)
        s = (words * weights[:words.shape[1]]).sum(dim=1)
        acc = s if acc is None else acc * 1000003 + s
    return acc


def numpy_digests(rows):
    """The digest as csrc/vllm_ext.h defines it, of host rows of the wire format (the check)."""
    import numpy as np

    out = []
    for row in rows.numpy():
        words = row.view("<u4").astype(np.uint64)
        p = np.arange(words.size, dtype=np.uint64)
        w = (p * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x243F6A8885A308D3)) | np.uint64(1)
        out.append(int((words * w).sum(dtype=np.uint64).astype(np.int64)))
    return out


def torch_peer(src, src_ids, dst, dst_ids):
    for s, d in zip(src.layers, dst.layers):
        d.index_copy_(1, dst_ids, s.index_select(1, src_ids).to(d.device, non_blocking=True))


# ---- one size -----------------------------------------------------------------------------------
def random_fill(cache, seed):
    g = torch.Generator(device=cache.device).manual_seed(seed) if cache.device.type == "cuda" else \
        torch.Generator().manual_seed(seed)
    for t in cache.layers:
        raw = t.view(torch.int16)
        raw.copy_(torch.randint(-32768, 32767, raw.shape, dtype=torch.int16, device=t.device, generator=g))


def rotations(nbytes, device):
    if device.type == "cpu":
        return 2  # host caches dwarf the CPU caches anyway; keep the CPU run short
    return max(1, min(32, math.ceil(ROTATE_BYTES / nbytes)))


def bench_size(n, cache, rng, timer, iters, peer=None):
    """Measures one size; returns {op: {...}}."""
    dev = cache.device
    nbytes = n * cache.block_nbytes
    sets = rotations(nbytes, dev)
    id_sets = [rng.sample(range(cache.num_blocks), n) for _ in range(sets)]
    ids_dev = [torch.tensor(s, device=dev) for s in id_sets]
    # Buffers are written once up front, so no run pays first-touch page faults.
    bufs = [torch.full((n, cache.block_nbytes), 7, dtype=torch.uint8, device=dev) for _ in range(sets)]
    results = {}

    def record(op, ours, ceiling, baselines, wrong, graph=None):
        entry = {"blocks": n, "bytes": nbytes, "time_ms": ours[0], "min_ms": ours[1], "max_ms": ours[2],
                 "gbps": nbytes / ours[0] / 1e6, "ceiling_gbps": nbytes / ceiling[0] / 1e6,
                 "wrong": wrong}
        entry["pct_of_ceiling"] = 100.0 * entry["gbps"] / entry["ceiling_gbps"]
        entry["spread"] = (ours[2] - ours[1]) / ours[0]  # (max - min) / median of the timed calls
        entry["ceiling_spread"] = (ceiling[2] - ceiling[1]) / ceiling[0]
        if graph is not None:  # device time per call, ours and the ceiling both from graph replays
            entry.update(graph_ms=graph[0][0], graph_gbps=nbytes / graph[0][0] / 1e6,
                         graph_ceiling_gbps=nbytes / graph[1][0] / 1e6)
            # NOTE: a large copy_ captured in a graph becomes a copy-engine memcpy node, slower than
            # the eager SM copy; the device ceiling is the faster of the two, the harder bar.
            entry["graph_ceiling_gbps"] = max(entry["graph_ceiling_gbps"], entry["ceiling_gbps"])
            entry["graph_pct_of_ceiling"] = 100.0 * entry["graph_gbps"] / entry["graph_ceiling_gbps"]
        entry["unreliable"] = any(noise.above_ceiling(entry.get(k, 0) / 100)
                                  for k in ("pct_of_ceiling", "graph_pct_of_ceiling"))
        for name, t in baselines.items():
            entry[f"{name}_ms"] = t[0]
            entry[f"speedup_vs_{name}"] = t[0] / ours[0]
        results[op] = entry
        graph_note = (f"graph {entry['graph_gbps']:.0f} GB/s {entry['graph_pct_of_ceiling']:.1f}%  "
                      if graph is not None else "")
        versus = (f"{entry['pct_of_ceiling']:5.1f}% of {entry['ceiling_gbps']:.0f}" if dev.type == "cuda" else
                  f"{entry['pct_of_ceiling'] / 100:.2f}x torch copy_ ({entry['ceiling_gbps']:.0f})")
        if entry["unreliable"]:
            versus += " (above its ceiling: unreliable)"
        speedups = "  ".join(f"x{entry[f'speedup_vs_{b}']:.1f} vs {b}" for b in baselines)
        log(f"  {op:8s} {nbytes / MIB:7.0f} MiB  {entry['gbps']:8.1f} GB/s  {versus}  {graph_note}{speedups}"
            f"  wrong={wrong}")

    # ceiling: one contiguous copy of the same bytes
    srcs = [torch.full((nbytes,), 3, dtype=torch.uint8, device=dev) for _ in range(sets)]
    dsts = [torch.full((nbytes,), 5, dtype=torch.uint8, device=dev) for _ in range(sets)]
    copies = [lambda i=i: dsts[i].copy_(srcs[i]) for i in range(sets)]
    ceiling = timer.median_ms(copies, iters)
    graph_ceiling = timer.graph_ms(copies) if dev.type == "cuda" else None
    del srcs, dsts, copies

    # gather
    calls = [lambda i=i: ops.gather_blocks(cache, ids_dev[i], out=bufs[i], check_ids=False) for i in range(sets)]
    ours = timer.median_ms(calls, iters)
    graph = (timer.graph_ms(calls), graph_ceiling) if dev.type == "cuda" else None
    baselines = {}
    if dev.type == "cuda":
        sides = [(HostSide(cache, id_sets[i]), HostSide(buf=bufs[i], block_nbytes=cache.block_nbytes,
                                                         chunk=cache.slice_nbytes)) for i in range(sets)]
        baselines["memcpy"] = timer.median_ms([lambda i=i: memcpy_baseline(*sides[i], n, cache, dev)
                                               for i in range(sets)], max(5, iters // 4))
    baselines["torch"] = timer.median_ms([lambda i=i: torch_gather(cache, ids_dev[i], bufs[i])
                                          for i in range(sets)], max(5, iters // 4))
    check = bufs[0].clone()
    ops.gather_blocks(cache, ids_dev[0], out=check)
    reference = torch.empty_like(check)
    torch_gather(cache, ids_dev[0], reference)
    record("gather", ours, ceiling, baselines, int(not torch.equal(check, reference)), graph)

    # scatter (writes random buffers into random blocks; distinct ids per set)
    calls = [lambda i=i: ops.scatter_blocks(bufs[i], cache, ids_dev[i], check_ids=False) for i in range(sets)]
    ours = timer.median_ms(calls, iters)
    graph = (timer.graph_ms(calls), graph_ceiling) if dev.type == "cuda" else None
    baselines = {}
    if dev.type == "cuda":
        sides = [(HostSide(buf=bufs[i], block_nbytes=cache.block_nbytes, chunk=cache.slice_nbytes),
                  HostSide(cache, id_sets[i])) for i in range(sets)]
        baselines["memcpy"] = timer.median_ms([lambda i=i: memcpy_baseline(*sides[i], n, cache, dev)
                                               for i in range(sets)], max(5, iters // 4))
    baselines["torch"] = timer.median_ms([lambda i=i: torch_scatter(bufs[i], cache, ids_dev[i])
                                          for i in range(sets)], max(5, iters // 4))
    probe = torch.randint(0, 256, bufs[0].shape, dtype=torch.uint8, device=dev)
    ops.scatter_blocks(probe, cache, ids_dev[0])
    record("scatter", ours, ceiling, baselines, int(not torch.equal(ops.gather_blocks(cache, ids_dev[0]), probe)),
           graph)

    # digest: reads the blocks in place; its ceiling is one read of the same bytes
    srcs = [torch.full((nbytes // 4,), 1.0, dtype=torch.float32, device=dev) for _ in range(sets)]
    reads = [lambda i=i: srcs[i].sum() for i in range(sets)]
    read_ceiling = timer.median_ms(reads, iters)
    graph_read_ceiling = timer.graph_ms(reads) if dev.type == "cuda" else None
    del srcs, reads
    id_arrays = [array.array("q", s) for s in id_sets]
    outs = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(sets)]
    calls = [lambda i=i: ops._digests_prechecked(cache, id_arrays[i], outs[i], dev) for i in range(sets)]
    ours = timer.median_ms(calls, iters)
    graph = (timer.graph_ms(calls), graph_read_ceiling) if dev.type == "cuda" else None
    weights = torch.randint(-(1 << 62), 1 << 62, (cache.block_nbytes // 4 // cache.num_layers,), device=dev) | 1
    baselines = {"torch": timer.median_ms([lambda i=i: torch_digest(cache, ids_dev[i], weights)
                                           for i in range(sets)], max(5, iters // 4))}
    checked = id_sets[0][:8]
    wrong = int(ops.block_digests(cache, checked) != numpy_digests(ops.gather_blocks(cache, checked).cpu()))
    record("digest", ours, read_ceiling, baselines, wrong, graph)

    if peer is not None:
        dst_cache, peer_timer = peer
        dst_dev = dst_cache.device
        dst_sets = [rng.sample(range(dst_cache.num_blocks), n) for _ in range(sets)]
        src_ids_dst = [torch.tensor(s, device=dst_dev) for s in id_sets]
        dst_ids_dst = [torch.tensor(s, device=dst_dev) for s in dst_sets]
        srcs = [torch.full((nbytes,), 3, dtype=torch.uint8, device=dev) for _ in range(sets)]
        dsts = [torch.full((nbytes,), 5, dtype=torch.uint8, device=dst_dev) for _ in range(sets)]
        peer_ceiling = peer_timer.median_ms([lambda i=i: dsts[i].copy_(srcs[i]) for i in range(sets)], iters)
        del srcs, dsts
        ours = peer_timer.median_ms([lambda i=i: ops.copy_blocks(cache, src_ids_dst[i], dst_cache, dst_ids_dst[i],
                                                                 check_ids=False) for i in range(sets)], iters)
        sides = [(HostSide(cache, id_sets[i]), HostSide(dst_cache, dst_sets[i])) for i in range(sets)]
        baselines = {
            "memcpy": peer_timer.median_ms([lambda i=i: memcpy_baseline(*sides[i], n, cache, dst_dev)
                                            for i in range(sets)], max(5, iters // 4)),
            "torch": peer_timer.median_ms([lambda i=i: torch_peer(cache, ids_dev[i], dst_cache, dst_ids_dst[i])
                                           for i in range(sets)], max(5, iters // 4)),
        }
        ops.copy_blocks(cache, src_ids_dst[0], dst_cache, dst_ids_dst[0])
        torch.cuda.synchronize(dst_dev)
        same = torch.equal(ops.gather_blocks(dst_cache, dst_ids_dst[0]).to(dev), ops.gather_blocks(cache, ids_dev[0]))
        record("peer", ours, peer_ceiling, baselines, int(not same))
    return results


def host_overhead_us(cache, device, repeats=2000):
    """Host time of one call, enqueue only (the GPU drains in the background)."""
    ids = torch.tensor([0], device=device)
    out = torch.empty((1, cache.block_nbytes), dtype=torch.uint8, device=device)
    src, dst = torch.empty_like(out), torch.empty_like(out)
    result = {}
    variants = [("gather_blocks", lambda: ops.gather_blocks(cache, ids, out=out, check_ids=False)),
                ("torch copy_", lambda: dst.copy_(src))]
    if device.type == "cuda":  # the C call alone, sides prepared: what Python adds on top of it
        sides = (ops._cache_side(cache, ids, device), ops._buffer_side(out, cache))
        stream = torch.cuda.current_stream(device).cuda_stream
        variants.append(("C launch only", lambda: _lib.copy_blocks_cuda(
            *sides, 1, cache.num_layers, cache.num_components, cache.slice_nbytes, 16, device.index, stream, 0)))
    for name, fn in variants:
        for _ in range(50):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        result[name] = round((time.perf_counter() - t0) / repeats * 1e6, 2)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return result


# ---- output -------------------------------------------------------------------------------------
def markdown(rows, meta):
    if meta["gpus"]:
        return markdown_cuda(rows, meta)
    return markdown_cpu(rows, meta)


def _pct(r, key):
    """A % of ceiling cell: the figure, or unreliable above the ceiling."""
    value = r[key]
    return f"unreliable ({value:.1f})" if noise.above_ceiling(value / 100) else f"{value:.1f}"


def host_verdict(host, rows):
    """noise.Host's verdict on a run: its rows' spreads (ours and the ceiling's) and ratios above
    their ceiling."""
    spreads = {}
    for r in rows:
        name = f"{r['op']} {r['bytes'] / MIB:.0f} MiB"
        spreads[name] = r.get("spread")
        spreads[f"{name} ceiling"] = r.get("ceiling_spread")
    return host.verdict(spreads, [f"{r['op']} {r['bytes'] / MIB:.0f} MiB" for r in rows if r.get("unreliable")])


def markdown_cuda(rows, meta):
    lines = [f"# vllm-ext kernel benchmark ({meta['device_name']})", "",
             f"Geometry: {meta['geometry']}, {meta['block_mib']:.0f} MiB per block. GB/s = 1e9 bytes/s of "
             "payload; ceiling = one contiguous copy of the same bytes in the same run (for digest, which "
             "only reads: torch's float32 sum of them); speed-up = baseline time / our time.", "",
             "Two timings: *call* = CUDA events around one eager Python call (host overhead included, "
             "as a caller sees it), *device* = per-call time of 32 calls captured back to back in a CUDA "
             "graph; its ceiling is the faster of the same copy captured the same way and the eager copy. "
             "Peer is timed per call only.", "", *noise.markdown(meta["host"]),
             "| op | size (MiB) | blocks | call (us) | call GB/s | call ceiling GB/s | call % | device GB/s | "
             "device ceiling GB/s | device % | x vs memcpy | x vs torch | wrong |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = f"{r['speedup_vs_memcpy']:.1f}" if "speedup_vs_memcpy" in r else "-"
        dev = (f"{r['graph_gbps']:.1f} | {r['graph_ceiling_gbps']:.1f} | {_pct(r, 'graph_pct_of_ceiling')}"
               if "graph_gbps" in r else "- | - | -")
        lines.append(f"| {r['op']} | {r['bytes'] / MIB:.0f} | {r['blocks']} | {r['time_ms'] * 1e3:.1f} | "
                     f"{r['gbps']:.1f} | {r['ceiling_gbps']:.1f} | {_pct(r, 'pct_of_ceiling')} | {dev} | {mem} | "
                     f"{r['speedup_vs_torch']:.1f} | {r['wrong']} |")
    lines += ["", "Host time per call (enqueue only, 1 block): " +
              ", ".join(f"{k} {v} us" for k, v in meta.get("host_us_per_call", {}).items()) + "."]
    if meta["targets"]:
        lines += ["", "## Targets", "", "| target | worst measured | met |", "|---|---|---|"]
        judged = not meta["host"]["noisy"]
        for label, worst, met in meta["targets"]:
            lines.append(f"| {label} | {worst} | {('yes' if met else 'NO') if judged else 'not judged: noisy host'} |")
    return "\n".join(lines) + "\n"


def markdown_cpu(rows, meta):
    """The CPU run: host caches, the host clock, torch's copy_ of one contiguous buffer of the same
    bytes as the ceiling (beaten by more than timing noise only when its own timing was slowed)."""
    lines = [f"# vllm-ext kernel benchmark, CPU implementation ({meta['device_name']}, "
             f"{os.cpu_count()} cores)", "",
             f"No GPU: gather, scatter and the block digests of host caches by the CPU implementation "
             f"({meta['threads']} threads). Geometry: {meta['geometry']}, {meta['block_mib']:.0f} MiB per "
             f"block. Time = median of {meta['iters']} calls on the host clock after {WARMUP_CALLS} warm-up "
             "calls; GB/s = 1e9 bytes/s of payload. *vs copy_* = our GB/s / the GB/s of torch's copy_ of one "
             "contiguous buffer of the same bytes (for digest: torch's float32 sum of them), in the same run; "
             f"above {noise.ABOVE_CEILING:.2f}x it is the reference's timing that was slowed (printed as unreliable). "
             "Speed-up = torch index_select / index_copy_ per layer, time / our time.", "",
             "**Not comparable with GPU figures**: this is the CPU implementation on host memory; the README's "
             "and benchmarks/results' kernel figures are an NVIDIA H200's (kernels.md).", "",
             *noise.markdown(meta["host"]),
             "| op | size (MiB) | blocks | time (us) | GB/s | copy_ GB/s | vs copy_ | x vs torch | wrong |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['bytes'] / MIB:.0f} | {r['blocks']} | {r['time_ms'] * 1e3:.1f} | "
                     f"{r['gbps']:.1f} | {r['ceiling_gbps']:.1f} | "
                     f"{noise.ratio_cell(r['pct_of_ceiling'] / 100, '{:.2f}x')} | "
                     f"{r['speedup_vs_torch']:.1f} | {r['wrong']} |")
    lines += ["", "Host time per call (1 block): " +
              ", ".join(f"{k} {v} us" for k, v in meta.get("host_us_per_call", {}).items()) + "."]
    return "\n".join(lines) + "\n"


def evaluate_targets(rows):
    out = []
    for op, min_blocks, fraction, label in TARGETS:
        sel = [r for r in rows if r["op"] == op and (r["blocks"] >= min_blocks if min_blocks > 1
                                                     else r["blocks"] == 1)]
        if not sel:
            continue
        worst = min(r["pct_of_ceiling"] for r in sel)
        out.append((label + " (call)", f"{worst:.1f}%", worst >= 100 * fraction))
        if all("graph_pct_of_ceiling" in r for r in sel):
            worst = min(r["graph_pct_of_ceiling"] for r in sel)
            out.append((label + " (device)", f"{worst:.1f}%", worst >= 100 * fraction))
    beats = all(r.get("speedup_vs_memcpy", 2) > 1 and r["speedup_vs_torch"] > 1 for r in rows)
    worst_speedup = min(min(r.get("speedup_vs_memcpy", math.inf), r["speedup_vs_torch"]) for r in rows)
    out.append(("beats both baselines at every size", f"x{worst_speedup:.2f}", beats))
    return out


def plot(rows, path, title, cuda):
    plt = report.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r["op"] for r in rows):
        sel = [r for r in rows if r["op"] == op]
        x = [r["bytes"] / MIB for r in sel]
        line, = ax.plot(x, [r["gbps"] for r in sel], marker="o", label=f"{op} (vllm-ext)")
        ax.plot(x, [r["ceiling_gbps"] for r in sel], ls="--", color=line.get_color(),
                label=f"{op} {'ceiling' if cuda else 'torch copy_ (reference)'}")
        for baseline, style in (("memcpy", ":"), ("torch", "-.")):
            base = [r for r in sel if f"{baseline}_ms" in r]
            if base:
                ax.plot([r["bytes"] / MIB for r in base], [r["bytes"] / r[f"{baseline}_ms"] / 1e6 for r in base],
                        ls=style, color=line.get_color(), alpha=0.5, label=f"{op} {baseline} baseline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("transfer size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    report.save_figure(plt, fig, path)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(report.DEFAULT_OUT))
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--sizes", default=None, help="comma-separated block counts, e.g. 1,8,68")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and _lib.built_with_cuda() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    sizes = SIZES_BLOCKS if gpus else [1, 2, 4, 8]
    if args.quick:
        sizes = [s for s in sizes if s in (1, 8, 68)]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    iters = args.iters or (40 if gpus else 10)
    num_blocks = 256 if gpus else 16
    log(f"vllm-ext {build_info()['version']}: kernel benchmark on {device}"
        f"{' + cuda:1 (peer)' if gpus >= 2 else ''}, sizes {sizes} blocks, {iters} iterations")
    host = noise.Host()  # before any work of ours: the load others put on the host
    rng = random.Random(0)
    cache = KVCache.allocate(num_blocks=num_blocks, dtype=DTYPE, device=device, **GEOMETRY)
    log(f"filling a cache of {num_blocks} blocks ({num_blocks * cache.block_nbytes / MIB:.0f} MiB) "
        f"on {device} with random bytes")
    random_fill(cache, 1)
    peer = None
    if gpus >= 2:
        dst = KVCache.allocate(num_blocks=num_blocks, dtype=DTYPE, device="cuda:1", **GEOMETRY)
        log("filling the same on cuda:1 (the peer copy's destination)")
        random_fill(dst, 2)
        peer = (dst, Timer(torch.device("cuda", 1), peer_device=device))
    elif gpus == 1:
        log("one GPU: peer copy not measured (needs two)")
    timer = Timer(device)
    log("host time per call: 50 warm-up calls, then 2000 timed calls of each variant (1 block)")
    host_us = host_overhead_us(cache, device)
    log(f"host time per call (no sync, 1 block): {host_us}")
    log(f"per size and op: {WARMUP_CALLS} warm-up calls, then {iters} timed calls"
        + ("; device time from a CUDA graph of 32 calls" if gpus else " on the host clock"))
    rows = []
    for n in sizes:
        log(f"[{sizes.index(n) + 1}/{len(sizes)}] {n} blocks ({n * cache.block_nbytes / MIB:.0f} MiB)")
        for op, entry in bench_size(n, cache, rng, timer, iters, peer).items():
            rows.append(dict(entry, op=op))
    rows.sort(key=lambda r: (["gather", "scatter", "digest", "peer"].index(r["op"]), r["blocks"]))
    name = torch.cuda.get_device_name(0) if gpus else platform.processor() or "CPU"
    meta = {"device_name": name, "gpus": gpus, "geometry": GEOMETRY | {"dtype": str(DTYPE), "layout": "flash"},
            "block_mib": cache.block_nbytes / MIB, "iters": iters, "threads": torch.get_num_threads(),
            "timing": "cuda events and graphs" if gpus else "host clock"}
    meta["targets"] = evaluate_targets(rows) if gpus else []
    meta["host_us_per_call"] = host_us
    meta["host"] = host_verdict(host, rows)
    if meta["host"]["noisy"]:
        log("NOISY HOST: " + "; ".join(meta["host"]["reasons"]))
    table = markdown(rows, meta)
    print(table)
    report.write(args.out, report.stem("kernels", not gpus), {"meta": meta, "rows": rows}, table,
                 lambda path: plot(rows, path, f"vllm-ext kernels on {name}", bool(gpus)), indent=2)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
