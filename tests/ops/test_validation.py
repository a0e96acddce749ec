"""Every invalid input is refused before any work, with an error naming the argument, and
leaves every tensor as it was."""

import array
import ctypes
import random
import re

import pytest
import torch

from tests.helpers.reference import assert_cache_bytes_equal, cache_bytes, fill_random_, random_cache
from vllm_ext import KVCache, _lib, ops

GEOMETRY = {"num_layers": 3, "num_blocks": 10, "block_size": 4, "num_kv_heads": 2, "head_size": 8}


@pytest.fixture
def cache():
    return random_cache(GEOMETRY, torch.float16, "flash", seed=random.randrange(1 << 30))


@pytest.fixture
def other():
    return random_cache(GEOMETRY, torch.float16, "flashinfer", seed=random.randrange(1 << 30))


def layer(shape=(2, 10, 4, 2, 8), dtype=torch.float16):
    return fill_random_(torch.empty(shape, dtype=dtype), torch.Generator().manual_seed(1))


# ---- KVCache construction ---------------------------------------------------------------------
@pytest.mark.parametrize("layers,layout,exc,match", [
    (lambda: layer(), "flash", TypeError, "layers: expected a list"),
    (lambda: [layer(), "x"], "flash", TypeError, r"layers\[1\]: expected torch.Tensor"),
    (lambda: [], "flash", ValueError, "layers: empty"),
    (lambda: [layer()], "paged", ValueError, "layout: 'paged'"),
    (lambda: [layer(), layer(dtype=torch.bfloat16)], "flash", ValueError, r"layers\[1\]: dtype"),
    (lambda: [layer(), layer((2, 9, 4, 2, 8))], "flash", ValueError, r"layers\[1\]: shape"),
    (lambda: [layer((3, 10, 4, 2, 8))], "flash", ValueError, "does not match layout 'flash'"),
    (lambda: [layer((10, 3, 4, 2, 8))], "flashinfer", ValueError, "does not match layout 'flashinfer'"),
    (lambda: [layer((10, 4, 8, 1))], "mla", ValueError, "does not match layout 'mla'"),
    (lambda: [layer((2, 10, 4, 8, 2)).transpose(-1, -2)], "flash", ValueError, r"layers\[0\]: not contiguous"),
    (lambda: [layer(), layer((2, 10, 4, 8, 2)).transpose(-1, -2)], "flash", ValueError, r"layers\[1\]: strides"),
    (lambda: [layer((1, 4, 2, 8)).expand(2, 10, 4, 2, 8)], "flash", ValueError, "overlap"),
    (lambda: [layer((2, 0, 4, 2, 8))], "flash", ValueError, "empty dimension"),
])
def test_from_layers_rejects(layers, layout, exc, match):
    with pytest.raises(exc, match=match):
        KVCache.from_layers(layers(), layout=layout)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"num_layers": 0}, ValueError, "num_layers: must be a positive int"),
    ({"num_blocks": -1}, ValueError, "num_blocks: must be a positive int"),
    ({"head_size": 2.0}, ValueError, "head_size: must be a positive int"),
    ({"dtype": "bf16"}, TypeError, "dtype: expected torch.dtype"),
    ({"layout": "mla", "num_kv_heads": 2}, ValueError, "num_kv_heads: an mla cache has one"),
    ({"layout": "nope"}, ValueError, "layout: 'nope'"),
])
def test_allocate_rejects(kwargs, exc, match):
    args = dict(GEOMETRY, dtype=torch.float16, device="cpu", layout="flash")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        KVCache.allocate(**args)


# ---- gather -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ids,out,exc,match", [
    ([10], None, ValueError, "block_ids: id 10 out of range for a cache of 10 blocks"),
    ([-1], None, ValueError, "block_ids: id -1 out of range"),
    (torch.tensor([1, 99]), None, ValueError, "block_ids: id 99 out of range"),
    ([1.0], None, TypeError, "block_ids: 1.0 is not an int"),
    ([True], None, TypeError, "block_ids: True is not an int"),
    (torch.tensor([1.0]), None, TypeError, "block_ids: dtype torch.float32"),
    (torch.tensor([True]), None, TypeError, "block_ids: dtype torch.bool"),
    (torch.tensor([[1]]), None, ValueError, "block_ids: expected a 1-D tensor"),
    ("12", None, TypeError, "block_ids: expected a list or 1-D tensor"),
    (5, None, TypeError, "block_ids: expected a list or 1-D tensor"),
    ([1, 2], lambda c: torch.empty(2, c.block_nbytes, dtype=torch.int8), TypeError, "out: dtype torch.int8"),
    ([1, 2], lambda c: torch.empty(1, c.block_nbytes, dtype=torch.uint8), ValueError, r"out: shape \[1, 768\]"),
    ([1, 2], lambda c: torch.empty(2, c.block_nbytes - 1, dtype=torch.uint8), ValueError, "out: shape"),
    ([1, 2], lambda c: torch.empty(2 * c.block_nbytes, dtype=torch.uint8), ValueError, "out: shape"),
    ([1, 2], lambda c: torch.empty(c.block_nbytes, 2, dtype=torch.uint8).t(), ValueError, "out: not contiguous"),
    ([1, 2], lambda c: [0] * 2, TypeError, "out: expected a torch.Tensor"),
])
def test_gather_rejects(cache, ids, out, exc, match):
    before = cache_bytes(cache)
    out_tensor = out(cache) if out else None
    out_before = out_tensor.clone() if isinstance(out_tensor, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        ops.gather_blocks(cache, ids, out=out_tensor)
    assert_cache_bytes_equal(cache, before)
    if out_before is not None:
        assert torch.equal(out_tensor, out_before)


def test_gather_rejects_non_cache():
    with pytest.raises(TypeError, match="cache: expected vllm_ext.KVCache"):
        ops.gather_blocks([torch.zeros(1)], [0])


# ---- scatter ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ids,rows,dtype,exc,match", [
    ([1, 1], 2, torch.uint8, ValueError, "block_ids: duplicate id 1"),
    (torch.tensor([4, 2, 4]), 3, torch.uint8, ValueError, "block_ids: duplicate id 4"),
    ([10], 1, torch.uint8, ValueError, "block_ids: id 10 out of range"),
    ([-3], 1, torch.uint8, ValueError, "block_ids: id -3 out of range"),
    ([1, 2, 3], 2, torch.uint8, ValueError, r"buf: shape \[2, 768\], expected \[>= 3, 768\]"),
    ([1], 1, torch.float16, TypeError, "buf: dtype torch.float16"),
])
def test_scatter_rejects(cache, ids, rows, dtype, exc, match):
    before = cache_bytes(cache)
    width = cache.block_nbytes if dtype == torch.uint8 else cache.block_nbytes // 2
    buf = torch.randint(0, 255, (rows, width), dtype=torch.uint8).view(dtype)
    with pytest.raises(exc, match=match):
        ops.scatter_blocks(buf, cache, ids)
    assert_cache_bytes_equal(cache, before)


# ---- copy_blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("change,match", [
    ({"dtype": torch.bfloat16}, "geometry differs .*dtype float16 vs bfloat16"),
    ({"num_kv_heads": 1}, "geometry differs .*num_kv_heads 2 vs 1"),
    ({"num_layers": 2}, "geometry differs .*num_layers 3 vs 2"),
    ({"block_size": 8}, "geometry differs .*block_size 4 vs 8"),
    ({"head_size": 16, "num_kv_heads": 1}, "geometry differs"),
])
def test_copy_rejects_geometry_mismatch(cache, change, match):
    args = dict(GEOMETRY, dtype=torch.float16)
    args.update(change)
    dtype = args.pop("dtype")
    dst = random_cache(args, dtype, "flash", seed=3)
    src_before, dst_before = cache_bytes(cache), cache_bytes(dst)
    with pytest.raises(ValueError, match=match):
        ops.copy_blocks(cache, [0], dst, [0])
    assert_cache_bytes_equal(cache, src_before)
    assert_cache_bytes_equal(dst, dst_before)


@pytest.mark.parametrize("src_ids,dst_ids,exc,match", [
    ([0, 1], [2], ValueError, r"src_ids and dst_ids: lengths differ \(2 vs 1\)"),
    ([0, 1], [2, 2], ValueError, "dst_ids: duplicate id 2"),
    ([0, 10], [2, 3], ValueError, "src_ids: id 10 out of range"),
    ([0, 1], [2, -1], ValueError, "dst_ids: id -1 out of range"),
    ([0, 1], [2, 3.5], TypeError, "dst_ids: 3.5 is not an int"),
])
def test_copy_rejects_ids(cache, other, src_ids, dst_ids, exc, match):
    src_before, dst_before = cache_bytes(cache), cache_bytes(other)
    with pytest.raises(exc, match=match):
        ops.copy_blocks(cache, src_ids, other, dst_ids)
    assert_cache_bytes_equal(cache, src_before)
    assert_cache_bytes_equal(other, dst_before)


def test_copy_within_one_cache_rejects_overlapping_sets(cache):
    before = cache_bytes(cache)
    with pytest.raises(ValueError, match="id sets overlap"):
        ops.copy_blocks(cache, [1, 2], cache, [2, 3])
    assert_cache_bytes_equal(cache, before)


def test_copy_rejects_non_cache(cache):
    with pytest.raises(TypeError, match="dst_cache: expected vllm_ext.KVCache"):
        ops.copy_blocks(cache, [0], "cache", [0])


# ---- CUDA requests where CUDA cannot serve them -------------------------------------------------
def test_cuda_with_cpu_only_build_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_lib, "built_with_cuda", lambda: False)
    monkeypatch.setattr(_lib, "_checked_devices", {})
    with pytest.raises(ValueError, match="built without CUDA .* cannot work on cuda:0"):
        _lib.ensure_device(0)


def test_pageable_host_memory_with_a_gpu_is_refused():
    """A GPU side with a pageable CPU side is refused before any device work."""
    with pytest.raises(ValueError, match="out: CPU memory used with a CUDA tensor must be pinned"):
        ops._placement(torch.device("cuda", 0), False, "cache", torch.device("cpu"), False,
                              "out")


# ---- two views of one memory --------------------------------------------------------------------
def test_two_cache_objects_over_one_memory_count_as_one_cache(cache):
    view = KVCache.from_layers(cache.layers, layout="flash")  # the same memory, another object
    before = cache_bytes(cache)
    with pytest.raises(ValueError, match="same memory and the id sets overlap"):
        ops.copy_blocks(cache, [0, 1], view, [1, 2])
    assert_cache_bytes_equal(cache, before)
    shifted = KVCache.from_layers([t[:, 1:] for t in cache.layers], layout="flash")
    with pytest.raises(ValueError, match="two views of the same memory with different layouts"):
        ops.copy_blocks(cache, [0], shifted, [5])
    assert_cache_bytes_equal(cache, before)
    ops.copy_blocks(cache, [0, 1], view, [2, 3])  # disjoint sets in one memory are fine
    assert torch.equal(ops.gather_blocks(cache, [2, 3]), ops.gather_blocks(cache, [0, 1]))


@pytest.mark.parametrize("ids,exc,match", [
    ([torch.tensor(1.7)], TypeError, r"block_ids: tensor\(1.7000\) is not an int"),
    ([torch.tensor([1, 2])], TypeError, "block_ids: tensor.* is not an int"),
    ([2**64], ValueError, "block_ids: id 18446744073709551616 out of range"),
    (["3"], TypeError, "block_ids: '3' is not an int"),
    ([None], TypeError, "block_ids: None is not an int"),
])
def test_list_elements_must_be_ints(cache, ids, exc, match):
    with pytest.raises(exc, match=match):
        ops.gather_blocks(cache, ids)


def test_integer_scalars_are_accepted_as_ids(cache):
    ids = [torch.tensor(3), 5]
    assert torch.equal(ops.gather_blocks(cache, ids), ops.gather_blocks(cache, [3, 5]))


def test_close_of_a_cache_that_owns_its_tensors_changes_nothing(cache):
    rows = ops.gather_blocks(cache, [1, 4])
    cache.close()
    assert torch.equal(ops.gather_blocks(cache, [1, 4]), rows)


# ---- one rejection table for ops.copy_blocks and MigrationEndpoint.pull ----------------------
# The same block-id inputs are accepted or refused, with the same exception type, by both (they
# share vllm_ext._ids); each entry: (ids, exception, words of the message).
BAD_IDS = [
    ([2 ** 64], ValueError, "out of range"),
    ([-1], ValueError, "out of range"),
    ([-2 ** 63 - 1], ValueError, "out of range"),
    ([1.0], TypeError, "is not an int"),
    ([True], TypeError, "is not an int"),
    (["1"], TypeError, "is not an int"),
    ("12", TypeError, "expected a list"),
    (7, TypeError, "expected a list"),
    ((i for i in [1]), TypeError, "expected a list"),
    (torch.tensor([1.0]), TypeError, "expected an integer dtype"),
    (torch.tensor([True]), TypeError, "expected an integer dtype"),
    (torch.tensor([[1]]), ValueError, "1-D tensor"),
    ([torch.tensor([1])], TypeError, "is not an int"),
]


@pytest.mark.parametrize("ids, exc, words", BAD_IDS, ids=[f"bad{i}" for i in range(len(BAD_IDS))])
def test_ops_and_pull_refuse_the_same_ids(ids, exc, words):
    import itertools

    from vllm_ext.migration import MigrationEndpoint

    def cache():
        return KVCache.allocate(num_layers=1, num_blocks=8, block_size=2, num_kv_heads=1, head_size=8,
                                dtype=torch.float16, device="cpu")

    a, b = cache(), cache()
    before = ops.gather_blocks(b, list(range(8))).clone()
    first, second = itertools.tee(ids) if not isinstance(ids, (list, str, int, torch.Tensor)) else (ids, ids)
    with pytest.raises(exc, match=words):
        ops.copy_blocks(a, first, b, [0])
    with MigrationEndpoint(a, "gloo", secret=b"s" * 32, stripes=1) as src, \
            MigrationEndpoint(b, "gloo", secret=b"s" * 32, stripes=1) as dst:
        with pytest.raises(exc, match=words):
            dst.pull(src.descriptor(), second, [0])
        assert dst._destination.link_count() == 0  # refused before any contact
    assert torch.equal(ops.gather_blocks(b, list(range(8))), before)


@pytest.mark.parametrize("good", [[3], (3,), range(3, 4), torch.tensor([3]), [torch.tensor(3)]],
                         ids=["list", "tuple", "range", "tensor", "scalar-tensor"])
def test_ops_and_pull_accept_the_same_ids(good):
    from vllm_ext.migration import MigrationEndpoint

    a = KVCache.allocate(num_layers=1, num_blocks=8, block_size=2, num_kv_heads=1, head_size=8,
                         dtype=torch.float16, device="cpu")
    b = KVCache.allocate(num_layers=1, num_blocks=8, block_size=2, num_kv_heads=1, head_size=8,
                         dtype=torch.float16, device="cpu")
    a.layers[0].copy_(torch.randn_like(a.layers[0]))
    ops.copy_blocks(a, good, b, [0])
    with MigrationEndpoint(a, "gloo", secret=b"s" * 32, stripes=1) as src, \
            MigrationEndpoint(b, "gloo", secret=b"s" * 32, stripes=1) as dst:
        dst.pull(src.descriptor(), good, [1], timeout=20)
    assert torch.equal(ops.gather_blocks(b, [0, 1]), ops.gather_blocks(a, [3, 3]))


@pytest.mark.parametrize("ids,exc,match", [
    ([0, 99], ValueError, "block_ids: id 99 out of range"),
    ([-1], ValueError, "block_ids: id -1 out of range"),
    ([1.0], TypeError, "block_ids: 1.0 is not an int"),
    ("01", TypeError, "block_ids: expected a list"),
])
def test_block_digests_reject(cache, ids, exc, match):
    with pytest.raises(exc, match=match):
        ops.block_digests(cache, ids)


def test_block_digests_reject_non_cache_and_unaligned_slices():
    with pytest.raises(TypeError, match="cache: expected vllm_ext.KVCache"):
        ops.block_digests(torch.zeros(4), [0])
    odd = KVCache.allocate(num_layers=1, num_blocks=2, block_size=1, num_kv_heads=1, head_size=3,
                           dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="block digests read 32-bit words.*6 bytes.*2-byte aligned"):
        ops.block_digests(odd, [0])


def test_the_c_digests_refuse_what_python_refuses():
    """The ABI checks its own arguments too: an id outside the cache, slices that are not whole
    words, a side with its own ids. Nothing is written to `out`."""
    import array
    import ctypes

    cache = KVCache.allocate(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_size=8,
                             dtype=torch.float16, device="cpu")
    side = ops._cache_side(cache, None, torch.device("cpu"))
    out = (ctypes.c_uint64 * 2)(7, 7)

    def refused(ids, slice_nbytes=cache.slice_nbytes, s=side):
        ids = array.array("q", ids)
        with pytest.raises(_lib.VllmExtError) as info:
            _lib.block_digests_cpu(s, ids.buffer_info()[0], len(ids), 2, 2, slice_nbytes, ctypes.addressof(out), 1)
        assert info.value.status == _lib.ERR_INVALID_ARGUMENT and list(out) == [7, 7]
        return str(info.value)

    assert "id 4 out of range for a cache of 4 blocks" in refused([0, 4])
    assert "not a multiple of 4" in refused([0], slice_nbytes=30)
    with_ids = _lib.Side(side.layer_ptrs, 0, 0, side.block_stride, side.component_stride, 4,
                         ctypes.addressof(out))
    assert "block_ids must be NULL" in refused([0], s=with_ids)
    # the CUDA entry point checks before any GPU work (a CPU-only build says it has no CUDA)
    bad = array.array("q", [5])
    with pytest.raises(_lib.VllmExtError) as info:
        _lib.block_digests_cuda(side, bad.buffer_info()[0], 1, 2, 2, cache.slice_nbytes, 16, ctypes.addressof(out), 0,
                                None)
    assert info.value.status == (_lib.ERR_INVALID_ARGUMENT if _lib.built_with_cuda() else _lib.ERR_NO_CUDA)
    assert list(out) == [7, 7]


# ---- the ABI's own bound on a slice's extent --------------------------------------------------
BLOCK = 64  # block_stride of both sides below: one layer, one component, 2 blocks each


def _guarded_sides(src_part=(0, 0), dst_part=(0, 0)):
    """Two sides of 2 blocks of BLOCK bytes in one host buffer of fresh random bytes, each with
    room around it (a copy past a block lands there, inside the buffer); part: (slice_offset,
    row_stride)."""
    mem = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(
        random.randrange(1 << 30)))
    base = mem.data_ptr()

    def side(at, part):
        return _lib.Side(layer_ptrs=None, base=base + at, layer_stride=2 * BLOCK, block_stride=BLOCK,
                         component_stride=0, num_blocks=2, block_ids=None, slice_offset=part[0], row_stride=part[1])
    return mem, side(256, src_part), side(640, dst_part)


@pytest.mark.parametrize("which,part,slice_nbytes,num_rows,match", [
    ("dst", (48, 0), 32, 1, r"dst slice_offset 48 \+ \(num_rows 1 - 1\) \* row_stride 32 \+ row 32 bytes passes "
                            r"the block's 64 bytes"),
    ("src", (40, 0), 32, 1, r"src slice_offset 40 .* row 32 bytes passes the block's 64 bytes"),
    ("dst", (0, 24), 32, 4, r"dst slice_offset 0 \+ \(num_rows 4 - 1\) \* row_stride 24 \+ row 8 bytes passes"),
    ("src", (8, 20), 32, 4, r"src slice_offset 8 \+ \(num_rows 4 - 1\) \* row_stride 20 \+ row 8 bytes passes"),
    ("dst", (65, 0), 8, 1, r"dst slice_offset 65 .* passes the block's 64 bytes"),
    ("src", (0, 1 << 62), 32, 4, r"row_stride 4611686018427387904 \+ row 8 bytes passes"),  # would overflow
    ("dst", ((1 << 63) - 1, 0), 32, 1, r"dst slice_offset 9223372036854775807 .* passes"),
])
def test_the_c_copy_refuses_a_slice_that_passes_its_block(which, part, slice_nbytes, num_rows, match):
    """The finding: the ABI checked slice_offset >= 0 and that rows do not overlap, but not that
    slice_offset + (num_rows - 1) * row_stride + a row's bytes stays inside the block
    (block_stride), so a direct caller read or wrote outside the cache, against vllm_ext.h. Now
    such a call is refused with the values named, and no byte is written anywhere."""
    mem, src, dst = _guarded_sides(**{f"{which}_part": part})
    before = mem.clone()
    n = 2 if max(part) < 2 * BLOCK else 0  # an overflowing part is asked with no ids (it would crash)
    with pytest.raises(_lib.VllmExtError) as info:
        _lib.copy_blocks_cpu(src, dst, n, 1, 1, slice_nbytes, 1, num_rows)
    assert info.value.status == _lib.ERR_INVALID_ARGUMENT
    assert re.search(match, str(info.value)), str(info.value)
    assert torch.equal(mem, before)
    out = (ctypes.c_uint64 * 2)(7, 7)  # the digests share the check
    ids = array.array("q", [0, 1])
    with pytest.raises(_lib.VllmExtError, match=match.replace(which, "cache", 1)):
        _lib.block_digests_cpu(src if which == "src" else dst, ids.buffer_info()[0], n, 1, 1, slice_nbytes,
                               ctypes.addressof(out), 1, num_rows)
    assert list(out) == [7, 7]


@pytest.mark.parametrize("part,slice_nbytes,num_rows", [((32, 0), 32, 1), ((8, 16), 32, 4), ((0, 0), 64, 1)])
def test_a_slice_that_ends_at_its_block_end_is_copied(part, slice_nbytes, num_rows):
    """The bound is inclusive: a part whose last row ends at block_stride moves, row by row, and
    nothing around it changes."""
    mem, src, dst = _guarded_sides(part, part)
    before = mem.clone()
    _lib.copy_blocks_cpu(src, dst, 2, 1, 1, slice_nbytes, 1, num_rows)
    want = before.clone()
    row, stride = slice_nbytes // num_rows, part[1] or slice_nbytes // num_rows
    for b in range(2):
        for r in range(num_rows):
            at = b * BLOCK + part[0] + r * stride
            want[640 + at:640 + at + row] = before[256 + at:256 + at + row]
    assert torch.equal(mem, want)
