"""CUDA kernels against the compiled CPU twin, byte for byte, with poisoned outputs.

Marked `gpu` (one GPU) or `multi_gpu` (two GPUs with peer access); skipped with the reason
elsewhere."""

import multiprocessing as mp
import random

import pytest
import torch

from tests.helpers.buildutil import build_variant, run_python
from tests.helpers.reference import (
    DTYPES,
    LAYOUTS,
    assert_cache_bytes_equal,
    cache_bytes,
    distinct_ids,
    fill_random_,
    random_cache,
    random_geometry,
    ref_block_digests,
    ref_gather,
    ref_scatter,
    to_device,
)
from vllm_ext import KVCache, ops

SEEDS = range(3)
# (dtype, head_size, expected alignment): geometries that force each narrower access width.
UNALIGNED = [
    (getattr(torch, "float8_e4m3fn", torch.uint8), 3, 1),
    (torch.float16, 3, 2),
    (torch.float32, 1, 4),
    (torch.float16, 4, 8),
    (torch.bfloat16, 8, 16),
]


def poison(shape, device, seed):
    g = torch.Generator().manual_seed(50_000 + seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)


def cuda_and_cpu_pair(layout, dtype, seed, device="cuda:0", geometry=None):
    rng = random.Random(seed)
    geometry = geometry or random_geometry(rng, layout)
    cpu = random_cache(geometry, dtype, layout, seed=seed)
    return rng, cpu, to_device(cpu, device)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_cuda_equals_cpu(layout, dtype, seed):
    rng, cpu, gpu = cuda_and_cpu_pair(layout, dtype, seed)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(rng.randint(1, 16))]
    out = poison((len(ids) + 3, gpu.block_nbytes), "cuda:0", seed)
    tail = out[len(ids):].clone()
    ops.gather_blocks(gpu, ids, out=out)
    torch.cuda.synchronize()
    expected = ops.gather_blocks(cpu, ids)
    assert torch.equal(out[:len(ids)].cpu(), expected)
    assert torch.equal(expected, ref_gather(cpu, ids))
    assert torch.equal(out[len(ids):], tail), "rows past the ids were written"
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_cuda_equals_cpu(layout, dtype, seed):
    rng, cpu, gpu = cuda_and_cpu_pair(layout, dtype, seed)
    ids = distinct_ids(rng, cpu.num_blocks, rng.randint(1, cpu.num_blocks))
    buf = poison((len(ids), cpu.block_nbytes), "cpu", seed)
    ops.scatter_blocks(buf.cuda(), gpu, torch.tensor(ids, device="cuda:0"))
    ops.scatter_blocks(buf, cpu, ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("src_layout,dst_layout",
                         [("flash", "flash"), ("flash", "flashinfer"), ("flashinfer", "flash"),
                          ("mla", "mla")])
def test_copy_blocks_cuda_equals_cpu(src_layout, dst_layout, seed):
    rng, src_cpu, src = cuda_and_cpu_pair(src_layout, DTYPES[seed % len(DTYPES)], seed)
    geometry = {k: getattr(src_cpu, k) for k in ("num_layers", "block_size", "num_kv_heads", "head_size")}
    geometry["num_blocks"] = rng.randint(1, 40)
    dst_cpu = random_cache(geometry, src_cpu.dtype, dst_layout, seed=seed + 7)
    dst = to_device(dst_cpu, "cuda:0")
    n = rng.randint(1, min(src.num_blocks, dst.num_blocks))
    src_ids = [rng.randrange(src.num_blocks) for _ in range(n)]
    dst_ids = distinct_ids(rng, dst.num_blocks, n)
    ops.copy_blocks(src, src_ids, dst, dst_ids)
    ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
    assert_cache_bytes_equal(src, cache_bytes(src_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [1, 3, 264])
def test_a_capped_grid_copies_the_same_bytes(max_ctas):
    """The migration pipelines cap the kernel's grid (so NCCL keeps room on every SM): each
    CTA then walks more tiles, and the bytes must not change."""
    rng, cpu, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, 11 + max_ctas)
    src_ids = [rng.randrange(cpu.num_blocks) for _ in range(rng.randint(1, 12))]
    out = poison((len(src_ids) + 2, gpu.block_nbytes), "cuda:0", max_ctas)
    tail = out[len(src_ids):].clone()
    ids = torch.tensor(src_ids, device="cuda:0")
    ops._gather_prechecked(gpu, ids, out[:len(src_ids)], gpu.device, max_ctas)
    torch.cuda.synchronize()
    assert torch.equal(out[:len(src_ids)].cpu(), ops.gather_blocks(cpu, src_ids))
    assert torch.equal(out[len(src_ids):], tail)
    dst_ids = distinct_ids(rng, cpu.num_blocks, len(src_ids))
    buf = poison((len(dst_ids), cpu.block_nbytes), "cpu", max_ctas + 1)
    ops._scatter_prechecked(buf.cuda(), gpu, torch.tensor(dst_ids, device="cuda:0"), gpu.device, max_ctas)
    ops.scatter_blocks(buf, cpu, dst_ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 447, 448, 449, 1000])
@pytest.mark.parametrize("layout", ["flash", "flashinfer"])
def test_inline_id_launches_equal_cpu_across_launch_splits(n, layout):
    """Ids carried in the kernel parameters (the migration hot path): up to 448 per launch, so
    n = 449 and 1000 take several launches; gather, scatter and cache-to-cache copy equal the
    CPU twin byte for byte, ids outside a cache are skipped, and nothing else is written."""
    import array

    from vllm_ext import _lib

    geometry = {"num_layers": 2, "num_blocks": 1100, "block_size": 2, "num_kv_heads": 2, "head_size": 8}
    rng, cpu, gpu = cuda_and_cpu_pair(layout, torch.bfloat16, 900 + n, geometry=geometry)
    device = gpu.device

    def addr(values):
        a = array.array("q", values)
        return a, a.buffer_info()[0]

    def launch(src_side, dst_side, src_ids, dst_ids, count, alignment):
        keep_src, src_addr = addr(src_ids) if src_ids is not None else (None, None)
        keep_dst, dst_addr = addr(dst_ids) if dst_ids is not None else (None, None)
        ops._copy_inline(src_side, dst_side, src_addr, dst_addr, count, gpu, alignment, device)
        torch.cuda.synchronize()

    # gather: cache -> buffer rows 0..n-1; two ids out of range leave their rows as they were
    src_ids = [rng.randrange(geometry["num_blocks"]) for _ in range(n)]
    if n > 2:
        src_ids[1], src_ids[-1] = -1, geometry["num_blocks"]
    out = poison((n + 1, gpu.block_nbytes), "cuda:0", n)
    expect = out.cpu().clone()
    valid = [i for i, b in enumerate(src_ids) if 0 <= b < geometry["num_blocks"]]
    expect[valid] = ops.gather_blocks(cpu, [src_ids[i] for i in valid])
    launch(ops._cache_side(gpu, None, device), ops._buffer_side(out, gpu), src_ids, None, n,
           min(gpu.alignment, ops._buffer_alignment(out, gpu)))
    assert torch.equal(out.cpu(), expect)

    # scatter: buffer rows -> distinct blocks
    dst_ids = distinct_ids(rng, geometry["num_blocks"], n)
    buf = poison((n, gpu.block_nbytes), "cpu", n + 1)
    buf_gpu = buf.cuda()
    launch(ops._buffer_side(buf_gpu, gpu), ops._cache_side(gpu, None, device), None, dst_ids, n,
           min(gpu.alignment, ops._buffer_alignment(buf_gpu, gpu)))
    ops.scatter_blocks(buf, cpu, dst_ids)
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))

    # cache -> cache on one GPU (disjoint caches), both lists inline
    other_cpu = random_cache(geometry, torch.bfloat16, layout, seed=n + 7)
    other = to_device(other_cpu, "cuda:0")
    src_ids = [rng.randrange(geometry["num_blocks"]) for _ in range(n)]
    dst_ids = distinct_ids(rng, geometry["num_blocks"], n)
    launch(ops._cache_side(gpu, None, device), ops._cache_side(other, None, device), src_ids, dst_ids, n,
           min(gpu.alignment, other.alignment))
    ops.copy_blocks(cpu, src_ids, other_cpu, dst_ids)
    assert_cache_bytes_equal(other, cache_bytes(other_cpu))
    # the public ops: a list of up to 448 ids takes the inline launch, a longer one device ids
    src_ids = [rng.randrange(geometry["num_blocks"]) for _ in range(n)]
    assert torch.equal(ops.gather_blocks(gpu, src_ids).cpu(), ops.gather_blocks(cpu, src_ids))
    dst_ids = distinct_ids(rng, geometry["num_blocks"], n)
    rows = poison((n, gpu.block_nbytes), "cpu", n + 2)
    ops.scatter_blocks(rows.cuda(), gpu, dst_ids)
    ops.scatter_blocks(rows, cpu, dst_ids)
    ops.copy_blocks(gpu, src_ids, other, dst_ids)
    ops.copy_blocks(cpu, src_ids, other_cpu, dst_ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))
    assert_cache_bytes_equal(other, cache_bytes(other_cpu))
    # the C ABI refuses a side that also carries a device id list
    bad = ops._cache_side(gpu, torch.tensor([0], device=device), device)
    _, ids_addr = addr([0])
    with pytest.raises(_lib.VllmExtError, match="block_ids must be NULL"):
        ops._copy_inline(bad, ops._cache_side(other, None, device), ids_addr, ids_addr, 1, gpu, 2, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_size,alignment", UNALIGNED, ids=str)
def test_unaligned_geometries_take_the_fallback_and_stay_exact(dtype, head_size, alignment):
    geometry = {"num_layers": 3, "num_blocks": 9, "block_size": 1, "num_kv_heads": 1,
                "head_size": head_size}
    rng, cpu, gpu = cuda_and_cpu_pair("flash", dtype, 1, geometry=geometry)
    assert gpu.alignment == alignment
    ids = [5, 0, 8, 3]
    out = poison((len(ids), gpu.block_nbytes), "cuda:0", 1)
    ops.gather_blocks(gpu, ids, out=out)
    expected = ops.gather_blocks(cpu, ids)
    buf = poison((len(ids), gpu.block_nbytes), "cpu", 2)
    ops.scatter_blocks(buf.cuda(), gpu, [1, 2, 4, 6])
    ops.scatter_blocks(buf, cpu, [1, 2, 4, 6])
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
def test_buffer_at_an_odd_address_takes_the_byte_path():
    rng, cpu, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, 4)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(5)]
    raw = poison((len(ids) * gpu.block_nbytes + 1,), "cuda:0", 4)
    out = raw[1:].view(len(ids), gpu.block_nbytes)
    assert out.data_ptr() % 2 == 1
    first = raw[:1].clone()
    ops.gather_blocks(gpu, ids, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref_gather(cpu, ids))
    assert torch.equal(raw[:1], first)


@pytest.mark.gpu
def test_pinned_host_buffers_both_ways():
    rng, cpu, gpu = cuda_and_cpu_pair("flashinfer", torch.float16, 5)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(6)]
    out = poison((len(ids), gpu.block_nbytes), "cpu", 5).pin_memory()
    ops.gather_blocks(gpu, ids, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_gather(cpu, ids))
    dst_ids = distinct_ids(rng, cpu.num_blocks, 4)
    buf = poison((4, gpu.block_nbytes), "cpu", 6).pin_memory()
    ops.scatter_blocks(buf, gpu, dst_ids)
    ref_scatter(buf, cpu, dst_ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_copy_blocks_between_pinned_host_cache_and_gpu(direction):
    rng = random.Random(6)
    geometry = random_geometry(rng, "flash")
    host_cpu = random_cache(geometry, torch.bfloat16, "flash", seed=6)
    host = to_device(host_cpu, "cpu", pin_memory=True)
    assert host.pinned
    dev_cpu = random_cache(geometry, torch.bfloat16, "flashinfer", seed=7)
    dev = to_device(dev_cpu, "cuda:0")
    n = rng.randint(1, geometry["num_blocks"])
    src_ids, dst_ids = distinct_ids(rng, geometry["num_blocks"], n), distinct_ids(rng, geometry["num_blocks"], n)
    if direction == "host_to_device":
        ops.copy_blocks(host, src_ids, dev, dst_ids)
        ops.copy_blocks(host_cpu, src_ids, dev_cpu, dst_ids)
    else:
        ops.copy_blocks(dev, src_ids, host, dst_ids)
        ops.copy_blocks(dev_cpu, src_ids, host_cpu, dst_ids)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(dev, cache_bytes(dev_cpu))
    assert_cache_bytes_equal(host, cache_bytes(host_cpu))


@pytest.mark.gpu
def test_ids_on_the_device_and_a_side_stream():
    rng, cpu, gpu = cuda_and_cpu_pair("flash", torch.float16, 8)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(7)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = ops.gather_blocks(gpu, torch.tensor(ids, dtype=torch.int32, device="cuda:0"))
    stream.synchronize()
    assert torch.equal(out.cpu(), ref_gather(cpu, ids))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_of_gather():
    rng, cpu, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, 9,
                                      geometry={"num_layers": 4, "num_blocks": 32, "block_size": 16,
                                                "num_kv_heads": 2, "head_size": 64})
    n = 6
    ids = torch.tensor(distinct_ids(rng, 32, n), device="cuda:0")
    out = torch.empty((n, gpu.block_nbytes), dtype=torch.uint8, device="cuda:0")
    ops.gather_blocks(gpu, ids, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gather_blocks(gpu, ids, out=out)
    for round_ in range(3):
        new_ids = distinct_ids(rng, 32, n)
        ids.copy_(torch.tensor(new_ids))
        g = torch.Generator().manual_seed(round_)
        for t in gpu.layers:  # new cache contents too: the replay must read them
            fill_random_(t, g)
        out.copy_(poison(out.shape, "cuda:0", round_))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref_gather(to_device(gpu, "cpu"), new_ids))


@pytest.mark.gpu
def test_kernel_skips_out_of_range_ids_when_checks_are_off():
    """With host checks off (as under graph capture) the kernel still never writes outside the
    blocks it was given: guard blocks around the cache stay intact."""
    g = torch.Generator().manual_seed(10)
    full = [fill_random_(torch.empty(2, 12, 4, 2, 8, dtype=torch.float16), g).cuda() for _ in range(2)]
    cache = KVCache.from_layers([t[:, 1:11] for t in full], layout="flash")  # blocks 0, 11 guard
    before = [t.clone() for t in full]
    buf = poison((4, cache.block_nbytes), "cuda:0", 10)
    ids = torch.tensor([3, 10, -1, 7], device="cuda:0")
    ops.scatter_blocks(buf, cache, ids, check_ids=False)
    torch.cuda.synchronize()
    written = ops.gather_blocks(cache, [3, 7])
    assert torch.equal(written, buf[[0, 3]])
    for t, b in zip(full, before):
        for block in set(range(12)) - {4, 8}:  # guards 0 and 11, and every block not written
            assert torch.equal(t[:, block].contiguous().view(torch.uint8),
                               b[:, block].contiguous().view(torch.uint8))


def _ipc_child(handle, device, geometry, dtype, src_ids, dst_ids, path):
    import torch

    from vllm_ext import KVCache, ops

    torch.cuda.set_device(device)
    with KVCache.import_ipc(handle, device=device) as peer:
        dst = KVCache.allocate(**geometry, dtype=dtype, device=device, layout="flashinfer")
        ops.copy_blocks(peer, src_ids, dst, dst_ids)
        torch.save(ops.gather_blocks(dst, dst_ids).cpu(), path)
    # A handle that claims more blocks than the allocation holds is refused before mapping.
    import dataclasses

    bad = dataclasses.replace(handle, num_blocks=handle.num_blocks * 1000)
    try:
        KVCache.import_ipc(bad, device=device)
    except ValueError as e:
        torch.save(str(e), str(path) + ".err")


def _run_ipc(tmp_path, src_device, dst_device):
    rng = random.Random(11)
    geometry = {"num_layers": 4, "num_blocks": 24, "block_size": 16, "num_kv_heads": 2,
                "head_size": 64}
    src = to_device(random_cache(geometry, torch.bfloat16, "flash", seed=11), src_device)
    handle = src.export_ipc()
    src_ids, dst_ids = distinct_ids(rng, 24, 9), distinct_ids(rng, 24, 9)
    path = tmp_path / "gathered.pt"
    proc = mp.get_context("spawn").Process(
        target=_ipc_child,
        args=(handle, dst_device, geometry, torch.bfloat16, src_ids, dst_ids, str(path)))
    proc.start()
    proc.join(timeout=180)
    if proc.is_alive():
        proc.kill()
        pytest.fail("IPC child did not finish in 180 s")
    assert proc.exitcode == 0
    assert torch.equal(torch.load(path), ref_gather(to_device(src, "cpu"), src_ids))
    assert "spans bytes" in torch.load(str(path) + ".err")


@pytest.mark.gpu
def test_ipc_export_import_in_another_process(tmp_path):
    _run_ipc(tmp_path, "cuda:0", "cuda:0")


@pytest.mark.gpu
def test_a_gpu_without_code_gets_one_readable_error(tmp_path):
    major, minor = torch.cuda.get_device_capability(0)
    other = "9.0" if major == 8 else "8.0"  # machine code runs only within its major version
    num = other.replace(".", "")
    lib = build_variant(tmp_path, "cuda", gencode=f"-gencode=arch=compute_{num},code=sm_{num}",
                        archs=f"sm_{num}")
    code = ("import torch; from vllm_ext import KVCache, ops\n"
            "c = KVCache.allocate(1, 2, 1, 1, 8, dtype=torch.float16, device='cuda:0')\n"
            "ops.gather_blocks(c, [0])\n")
    result = run_python(code, {"VLLM_EXT_LIBRARY": str(lib)})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert f"vllm-ext has no code for cuda:0, a GPU of compute capability {major}.{minor}" in last
    assert f"this build holds sm_{num}" in last


# Geometries of real models: the deep (8 vectors per thread) path with whole tiles (Qwen-7B:
# 128 KiB chunks) and with a partial last tile (head size 80: 80 KiB = 2.5 tiles).
MODEL_GEOMETRIES = [
    {"num_layers": 4, "num_blocks": 12, "block_size": 16, "num_kv_heads": 32, "head_size": 128},
    {"num_layers": 3, "num_blocks": 10, "block_size": 16, "num_kv_heads": 32, "head_size": 80},
]


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", MODEL_GEOMETRIES, ids=["qwen7b", "head80"])
@pytest.mark.parametrize("layout", ["flash", "flashinfer"])
def test_model_sized_chunks_equal_cpu(geometry, layout):
    rng, cpu, gpu = cuda_and_cpu_pair(layout, torch.bfloat16, 21, geometry=geometry)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(7)]
    out = poison((len(ids), gpu.block_nbytes), "cuda:0", 21)
    ops.gather_blocks(gpu, ids, out=out)
    dst_ids = distinct_ids(rng, cpu.num_blocks, 5)
    buf = poison((5, gpu.block_nbytes), "cpu", 22)
    ops.scatter_blocks(buf.cuda(), gpu, dst_ids)
    expected = ops.gather_blocks(cpu, ids)
    ops.scatter_blocks(buf, cpu, dst_ids)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
def test_device_ids_with_cpu_caches():
    """The CPU copy reads the ids at once: device ids must have arrived first."""
    rng = random.Random(23)
    cpu = random_cache(random_geometry(rng, "flash", max_blocks=64), torch.float16, "flash", seed=23)
    for _ in range(20):
        ids = [rng.randrange(cpu.num_blocks) for _ in range(16)]
        assert torch.equal(ops.gather_blocks(cpu, torch.tensor(ids, device="cuda:0")), ref_gather(cpu, ids))


@pytest.mark.gpu
def test_mixed_pinned_and_pageable_layers_are_refused():
    g = torch.Generator().manual_seed(24)
    pinned = fill_random_(torch.empty(2, 4, 2, 1, 8, dtype=torch.float16), g).pin_memory()
    pageable = fill_random_(torch.empty(2, 4, 2, 1, 8, dtype=torch.float16), g)
    with pytest.raises(ValueError, match=r"layers\[1\]: pageable host memory, but layers\[0\] is pinned"):
        KVCache.from_layers([pinned, pageable])


@pytest.mark.gpu
def test_capturing_a_pinned_host_cache_needs_prepare():
    rng = random.Random(25)
    geometry = dict(random_geometry(rng, "flash"), num_blocks=12)  # room for 3 distinct ids
    host_cpu = random_cache(geometry, torch.bfloat16, "flash", seed=25)
    host = to_device(host_cpu, "cpu", pin_memory=True)
    ids = torch.tensor(distinct_ids(rng, geometry["num_blocks"], 3), device="cuda:0")
    out = torch.empty((3, host.block_nbytes), dtype=torch.uint8, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"call cache.prepare\('cuda:0'\)"):
        with torch.cuda.graph(graph):
            ops.gather_blocks(host, ids, out=out)
    host.prepare("cuda:0")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gather_blocks(host, ids, out=out)
    out.copy_(poison(out.shape, "cuda:0", 25))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref_gather(host_cpu, ids.tolist()))


# ---- two GPUs ---------------------------------------------------------------------------------
@pytest.mark.multi_gpu
@pytest.mark.parametrize("src_device,dst_device", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
@pytest.mark.parametrize("seed", SEEDS)
def test_peer_copy_between_gpus(src_device, dst_device, seed):
    rng = random.Random(300 + seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    geometry = random_geometry(rng, layout)
    src_cpu = random_cache(geometry, torch.bfloat16, layout, seed=seed)
    dst_cpu = random_cache(geometry, torch.bfloat16, layout, seed=seed + 1)
    src, dst = to_device(src_cpu, src_device), to_device(dst_cpu, dst_device)
    n = rng.randint(1, geometry["num_blocks"])
    src_ids, dst_ids = distinct_ids(rng, geometry["num_blocks"], n), distinct_ids(rng, geometry["num_blocks"], n)
    ops.copy_blocks(src, src_ids, dst, dst_ids)
    ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids)
    torch.cuda.synchronize(src_device)
    torch.cuda.synchronize(dst_device)
    assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
    assert_cache_bytes_equal(src, cache_bytes(src_cpu))


@pytest.mark.multi_gpu
def test_ipc_across_two_gpus(tmp_path):
    _run_ipc(tmp_path, "cuda:0", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_digests_cuda_equal_cpu(layout, dtype, seed):
    rng, cpu, gpu = cuda_and_cpu_pair(layout, dtype, 600 + seed)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(rng.randint(1, 12))]
    if gpu.alignment < 4:
        with pytest.raises(ValueError, match="32-bit words"):
            ops.block_digests(gpu, ids)
        return
    digests = ops.block_digests(gpu, ids)
    assert digests == ops.block_digests(cpu, ids) == ref_block_digests(cpu, ids)
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_size,alignment", [u for u in UNALIGNED if u[2] >= 4], ids=str)
def test_block_digests_at_each_access_width(dtype, head_size, alignment):
    geometry = {"num_layers": 3, "num_blocks": 9, "block_size": 1, "num_kv_heads": 1, "head_size": head_size}
    _, cpu, gpu = cuda_and_cpu_pair("flash", dtype, 7, geometry=geometry)
    assert gpu.alignment == alignment
    assert ops.block_digests(gpu, [5, 0, 8, 5]) == ops.block_digests(cpu, [5, 0, 8, 5])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 448, 449, 1000])
def test_block_digests_across_launch_splits_and_model_sized_slices(n):
    """Ids past one launch's 448 (the digests of each launch land at their own offset), and a
    7B-shaped block (256 KiB slices: the deep-unrolled tiles)."""
    rng = random.Random(n)
    small = {"num_layers": 2, "num_blocks": 64, "block_size": 2, "num_kv_heads": 2, "head_size": 8}
    _, cpu, gpu = cuda_and_cpu_pair("flashinfer", torch.float16, n, geometry=small)
    ids = [rng.randrange(64) for _ in range(n)]
    assert ops.block_digests(gpu, ids) == ops.block_digests(cpu, ids)
    big = {"num_layers": 2, "num_blocks": 6, "block_size": 16, "num_kv_heads": 32, "head_size": 128}
    _, cpu, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, n, geometry=big)
    ids = [rng.randrange(6) for _ in range(3)]
    assert ops.block_digests(gpu, ids) == ops.block_digests(cpu, ids) == ref_block_digests(cpu, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_size,alignment", [(torch.float32, 1, 4), (torch.float16, 4, 8),
                                                       (torch.bfloat16, 8, 16)], ids=str)
def test_block_digests_of_long_odd_slices_equal_cpu(dtype, head_size, alignment):
    """2305 vectors per slice at each access width: the deep-unrolled kernel's full and partial tiles."""
    geometry = {"num_layers": 2, "num_blocks": 4, "block_size": 2305, "num_kv_heads": 1, "head_size": head_size}
    _, cpu, gpu = cuda_and_cpu_pair("flash", dtype, alignment, geometry=geometry)
    assert gpu.alignment == alignment
    assert ops.block_digests(gpu, [3, 0, 3]) == ops.block_digests(cpu, [3, 0, 3])


@pytest.mark.gpu
def test_block_digests_refuse_a_cuda_graph_capture():
    _, _, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, 10, geometry={
        "num_layers": 2, "num_blocks": 4, "block_size": 16, "num_kv_heads": 2, "head_size": 64})
    ops.block_digests(gpu, [0])  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="not during a CUDA graph capture"):
        with torch.cuda.graph(graph):
            ops.block_digests(gpu, [0])


@pytest.mark.gpu
def test_block_digests_follow_the_work_queued_on_the_current_stream():
    """On a side stream, right after a scatter queued there (no synchronisation between): the
    digests see the scattered bytes."""
    rng, cpu, gpu = cuda_and_cpu_pair("flash", torch.bfloat16, 9)
    ids = distinct_ids(rng, cpu.num_blocks, min(4, cpu.num_blocks))
    rows = poison((len(ids), gpu.block_nbytes), "cpu", 9)
    ops.scatter_blocks(rows, cpu, ids)
    rows_gpu = rows.cuda()  # uploaded before: on the side stream only the sleep and the scatter
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the scatter queued behind a long kernel
        ops.scatter_blocks(rows_gpu, gpu, ids)
        assert ops.block_digests(gpu, ids) == ops.block_digests(cpu, ids)
