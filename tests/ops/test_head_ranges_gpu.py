"""Head ranges on the GPU: the CUDA kernels against the compiled CPU twin (itself checked
against the torch reference in test_head_ranges.py), byte for byte, with poisoned outputs and
every byte of the destination compared, so the bytes outside the range are checked too.

Marked `gpu` (one GPU) or `multi_gpu`; skipped with the reason elsewhere."""

import random

import pytest
import torch

from tests.helpers.reference import (
    DTYPES,
    HEAD_LAYOUTS,
    HEAD_RANGE_PAIRS,
    assert_cache_bytes_equal,
    cache_bytes,
    distinct_ids,
    random_head_cache,
    random_head_geometry,
    ref_gather_heads,
    ref_head_digests,
)
from vllm_ext import KVCache, ops

SEEDS = range(3)
PAIRS = HEAD_RANGE_PAIRS
# (dtype, head_size, access width): a head range whose offset, runs and strides allow that width
# at most (the first head is odd, so the offset is one head's bytes).
WIDTHS = [
    (getattr(torch, "float8_e4m3fn", torch.uint8), 3, 1),
    (torch.float16, 3, 2),
    (torch.float32, 1, 4),
    (torch.float16, 4, 8),
    (torch.bfloat16, 8, 16),
]


def poison(shape, device, seed):
    g = torch.Generator().manual_seed(60_000 + seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)


def on_gpu(cpu: KVCache, kind: str, device="cuda:0") -> KVCache:
    """The same cache (layout, physical order, bytes) on a GPU."""
    if kind == "blocks_nhd":
        layers = [t.transpose(1, 2).contiguous().to(device).transpose(1, 2) for t in cpu.layers]
    else:
        layers = [t.to(device) for t in cpu.layers]
    cache = KVCache.from_layers(layers, layout=cpu.layout)
    assert cache.head_stride == cpu.head_stride and cache.block_stride == cpu.block_stride
    return cache


def pair(kind, dtype, seed, geometry=None):
    rng = random.Random(seed)
    cpu = random_head_cache(geometry or random_head_geometry(rng), dtype, kind, seed=seed)
    return rng, cpu, on_gpu(cpu, kind)


def random_range(rng, num_heads):
    count = rng.randint(1, num_heads)
    return rng.randint(0, num_heads - count), count


@pytest.mark.gpu
@pytest.mark.parametrize("ids_form", ["list", "tensor"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_gather_of_a_head_range_cuda_equals_cpu(kind, dtype, seed, ids_form):
    rng, cpu, gpu = pair(kind, dtype, seed)
    heads = random_range(rng, cpu.num_kv_heads)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(rng.randint(1, 16))]
    out = poison((len(ids) + 3, gpu.buffer_row_nbytes(heads)), "cuda:0", seed)
    tail = out[len(ids):].clone()
    ops.gather_blocks(gpu, ids if ids_form == "list" else torch.tensor(ids, device="cuda:0"), out=out, heads=heads)
    torch.cuda.synchronize()
    expected = ops.gather_blocks(cpu, ids, heads=heads)
    assert torch.equal(out[:len(ids)].cpu(), expected)
    assert torch.equal(expected, ref_gather_heads(cpu, ids, *heads))
    assert torch.equal(out[len(ids):], tail), "rows past the ids were written"
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("ids_form", ["list", "tensor"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_scatter_of_a_head_range_cuda_equals_cpu(kind, dtype, seed, ids_form):
    rng, cpu, gpu = pair(kind, dtype, seed)
    heads = random_range(rng, cpu.num_kv_heads)
    ids = distinct_ids(rng, cpu.num_blocks, rng.randint(1, cpu.num_blocks))
    buf = poison((len(ids), cpu.buffer_row_nbytes(heads)), "cpu", seed)
    ops.scatter_blocks(buf.cuda(), gpu, ids if ids_form == "list" else torch.tensor(ids, device="cuda:0"),
                       heads=heads)
    ops.scatter_blocks(buf, cpu, ids, heads=heads)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))  # every byte: the range and all the rest


@pytest.mark.gpu
@pytest.mark.parametrize("ids_form", ["list", "tensor"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("src_kind,dst_kind", PAIRS)
def test_copy_between_caches_of_other_head_counts_cuda_equals_cpu(src_kind, dst_kind, seed, ids_form):
    rng = random.Random(700 + seed)
    dtype = DTYPES[seed % len(DTYPES)]
    src_geometry = random_head_geometry(rng)
    dst_geometry = dict(src_geometry, num_blocks=rng.randint(1, 12), num_kv_heads=rng.randint(1, 6))
    src_cpu = random_head_cache(src_geometry, dtype, src_kind, seed=seed)
    dst_cpu = random_head_cache(dst_geometry, dtype, dst_kind, seed=seed + 1)
    src, dst = on_gpu(src_cpu, src_kind), on_gpu(dst_cpu, dst_kind)
    count = rng.randint(1, min(src.num_kv_heads, dst.num_kv_heads))
    src_heads = (rng.randint(0, src.num_kv_heads - count), count)
    dst_heads = (rng.randint(0, dst.num_kv_heads - count), count)
    n = rng.randint(1, min(src.num_blocks, dst.num_blocks))
    src_ids = [rng.randrange(src.num_blocks) for _ in range(n)]
    dst_ids = distinct_ids(rng, dst.num_blocks, n)
    if ids_form == "list":
        ops.copy_blocks(src, src_ids, dst, dst_ids, src_heads=src_heads, dst_heads=dst_heads)
    else:
        ops.copy_blocks(src, torch.tensor(src_ids, device="cuda:0"), dst, torch.tensor(dst_ids, device="cuda:0"),
                        src_heads=src_heads, dst_heads=dst_heads)
    ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids, src_heads=src_heads, dst_heads=dst_heads)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
    assert_cache_bytes_equal(src, cache_bytes(src_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_head_range_digests_cuda_equal_cpu(kind, dtype, seed):
    rng, cpu, gpu = pair(kind, dtype, 800 + seed)
    heads = random_range(rng, cpu.num_kv_heads)
    ids = [rng.randrange(cpu.num_blocks) for _ in range(rng.randint(1, 12))]
    if ops._part_alignment(cpu.alignment, cpu.head_part(heads)) < 4:
        with pytest.raises(ValueError, match="32-bit words"):
            ops.block_digests(gpu, ids, heads=heads)
        return
    digests = ops.block_digests(gpu, ids, heads=heads)
    assert digests == ops.block_digests(cpu, ids, heads=heads) == ref_head_digests(cpu, ids, *heads)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flash", "blocks_nhd", "blocks_hnd"])
@pytest.mark.parametrize("dtype,head_size,width", WIDTHS, ids=str)
def test_head_ranges_at_each_access_width(kind, dtype, head_size, width):
    """Heads [1, 3) of 5: the offset is one head, so the access width is what a head allows;
    gather, scatter and copy equal the CPU twin at each width (1 to 16 bytes)."""
    geometry = {"num_layers": 2, "num_blocks": 6, "block_size": 3, "num_kv_heads": 5, "head_size": head_size}
    rng, cpu, gpu = pair(kind, dtype, width, geometry=geometry)
    part = cpu.head_part((1, 2))
    assert ops._part_alignment(gpu.alignment, part) == width
    ids = [4, 0, 5, 4]
    assert torch.equal(ops.gather_blocks(gpu, ids, heads=(1, 2)).cpu(), ops.gather_blocks(cpu, ids, heads=(1, 2)))
    buf = poison((3, cpu.buffer_row_nbytes((1, 2))), "cpu", width)
    ops.scatter_blocks(buf.cuda(), gpu, [5, 1, 2], heads=(1, 2))
    ops.scatter_blocks(buf, cpu, [5, 1, 2], heads=(1, 2))
    narrow_cpu = random_head_cache(dict(geometry, num_kv_heads=2), dtype, kind, seed=width + 1)
    narrow = on_gpu(narrow_cpu, kind)
    ops.copy_blocks(gpu, [0, 3], narrow, [2, 0], src_heads=(3, 2))
    ops.copy_blocks(cpu, [0, 3], narrow_cpu, [2, 0], src_heads=(3, 2))
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))
    assert_cache_bytes_equal(narrow, cache_bytes(narrow_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(2, 1), (1, 3), (0, 4)], ids=str)
@pytest.mark.parametrize("kind", ["flash", "blocks_nhd"])
def test_long_slices_take_the_deep_kernel_with_rows(kind, heads):
    """2305 tokens a block: a slice of runs past one deep tile (2048 vectors), with a partial
    last tile; runs of one vector (a single 16-byte head) and of three."""
    geometry = {"num_layers": 2, "num_blocks": 3, "block_size": 2305, "num_kv_heads": 5, "head_size": 8}
    rng, cpu, gpu = pair(kind, torch.float16, 31, geometry=geometry)
    assert cpu.head_part(heads).slice_nbytes >= 2305 * 16
    out = ops.gather_blocks(gpu, [2, 0, 2], heads=heads)
    assert torch.equal(out.cpu(), ops.gather_blocks(cpu, [2, 0, 2], heads=heads))
    buf = poison((2, cpu.buffer_row_nbytes(heads)), "cpu", 32)
    ops.scatter_blocks(buf.cuda(), gpu, [1, 2], heads=heads)
    ops.scatter_blocks(buf, cpu, [1, 2], heads=heads)
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))
    assert ops.block_digests(gpu, [0, 1, 2], heads=heads) == ops.block_digests(cpu, [0, 1, 2], heads=heads)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 448, 449, 1000])
def test_head_range_inline_launches_across_splits(n):
    """Ids in the kernel's parameters, 448 a launch: a head-range copy over several launches."""
    geometry = {"num_layers": 2, "num_blocks": 1100, "block_size": 2, "num_kv_heads": 4, "head_size": 8}
    rng = random.Random(900 + n)
    src_cpu = random_head_cache(geometry, torch.bfloat16, "flash", seed=n)
    dst_cpu = random_head_cache(dict(geometry, num_kv_heads=6), torch.bfloat16, "flashinfer", seed=n + 1)
    src, dst = on_gpu(src_cpu, "flash"), on_gpu(dst_cpu, "flashinfer")
    src_ids = [rng.randrange(1100) for _ in range(n)]
    dst_ids = distinct_ids(rng, 1100, n)
    ops.copy_blocks(src, src_ids, dst, dst_ids, src_heads=(1, 3), dst_heads=(2, 3))
    ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids, src_heads=(1, 3), dst_heads=(2, 3))
    out = ops.gather_blocks(dst, dst_ids, heads=(0, 5))
    torch.cuda.synchronize()
    assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
    assert torch.equal(out.cpu(), ops.gather_blocks(dst_cpu, dst_ids, heads=(0, 5)))


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [1, 3])
def test_a_capped_grid_moves_the_same_heads(max_ctas):
    rng, cpu, gpu = pair("flash", torch.bfloat16, 40 + max_ctas,
                         geometry={"num_layers": 3, "num_blocks": 8, "block_size": 16, "num_kv_heads": 4,
                                   "head_size": 64})
    part = gpu.head_part((1, 2))
    ids = [rng.randrange(8) for _ in range(6)]
    out = poison((6, gpu.buffer_row_nbytes((1, 2))), "cuda:0", max_ctas)
    ops._gather_prechecked(gpu, torch.tensor(ids, device="cuda:0"), out, gpu.device, max_ctas, part=part)
    dst_ids = distinct_ids(rng, 8, 5)
    buf = poison((5, cpu.buffer_row_nbytes((1, 2))), "cpu", max_ctas + 1)
    ops._scatter_prechecked(buf.cuda(), gpu, torch.tensor(dst_ids, device="cuda:0"), gpu.device, max_ctas, part=part)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ops.gather_blocks(cpu, ids, heads=(1, 2)))
    ops.scatter_blocks(buf, cpu, dst_ids, heads=(1, 2))
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))


@pytest.mark.gpu
def test_pinned_host_buffers_and_caches_with_head_ranges():
    """The kernel reads and writes pinned host memory directly: head-range buffers both ways,
    and a pinned host cache of 8 heads to a GPU cache of 4."""
    geometry = {"num_layers": 2, "num_blocks": 10, "block_size": 16, "num_kv_heads": 8, "head_size": 64}
    rng, cpu, gpu = pair("flash", torch.bfloat16, 50, geometry=geometry)
    ids = [3, 7, 1]
    host = torch.empty((3, gpu.buffer_row_nbytes((2, 4))), dtype=torch.uint8).pin_memory()
    ops.gather_blocks(gpu, ids, out=host, heads=(2, 4))
    torch.cuda.synchronize()
    assert torch.equal(host, ops.gather_blocks(cpu, ids, heads=(2, 4)))
    back = poison(host.shape, "cpu", 51).pin_memory()
    ops.scatter_blocks(back, gpu, [0, 9, 4], heads=(4, 4))
    ops.scatter_blocks(back, cpu, [0, 9, 4], heads=(4, 4))
    pinned_layers = [t.clone().pin_memory() for t in cpu.layers]
    pinned = KVCache.from_layers(pinned_layers, layout="flash")
    narrow_cpu = random_head_cache(dict(geometry, num_kv_heads=4), torch.bfloat16, "flash", seed=52)
    narrow = on_gpu(narrow_cpu, "flash")
    ops.copy_blocks(pinned, [1, 2], narrow, [5, 6], src_heads=(4, 4))
    ops.copy_blocks(cpu, [1, 2], narrow_cpu, [5, 6], src_heads=(4, 4))
    torch.cuda.synchronize()
    assert_cache_bytes_equal(gpu, cache_bytes(cpu))
    assert_cache_bytes_equal(narrow, cache_bytes(narrow_cpu))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_of_a_head_range_gather():
    geometry = {"num_layers": 2, "num_blocks": 8, "block_size": 16, "num_kv_heads": 4, "head_size": 64}
    rng, cpu, gpu = pair("flash", torch.float16, 60, geometry=geometry)
    ids = torch.tensor([5, 1, 6], device="cuda:0")
    out = torch.empty((3, gpu.buffer_row_nbytes((1, 2))), dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.gather_blocks(gpu, ids, out=out, heads=(1, 2))  # warm up on the capture stream
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ops.gather_blocks(gpu, ids, out=out, heads=(1, 2))
    out.zero_()
    ids.copy_(torch.tensor([2, 2, 7]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ops.gather_blocks(cpu, [2, 2, 7], heads=(1, 2)))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("src_device,dst_device", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
def test_peer_copy_of_a_head_range_between_gpus(src_device, dst_device):
    """The kernel on the destination reads the source's heads over the peer link."""
    geometry = {"num_layers": 2, "num_blocks": 10, "block_size": 16, "num_kv_heads": 4, "head_size": 64}
    rng = random.Random(70)
    src_cpu = random_head_cache(geometry, torch.bfloat16, "flash", seed=70)
    dst_cpu = random_head_cache(dict(geometry, num_kv_heads=8), torch.bfloat16, "flash", seed=71)
    src, dst = on_gpu(src_cpu, "flash", src_device), on_gpu(dst_cpu, "flash", dst_device)
    src_ids = [rng.randrange(10) for _ in range(6)]
    dst_ids = distinct_ids(rng, 10, 6)
    ops.copy_blocks(src, src_ids, dst, dst_ids, dst_heads=(4, 4))
    ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids, dst_heads=(4, 4))
    torch.cuda.synchronize(dst_device)
    assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
