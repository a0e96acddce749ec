"""Head ranges (heads=(first, count)): the compiled CPU twin against the plain torch reference,
every byte checked, the bytes outside the range included; unequal-TP uses; every refusal.

A CUDA twin of each case is in test_head_ranges_gpu.py."""

import array
import ctypes
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
    random_cache,
    random_head_cache,
    random_head_geometry,
    ref_gather,
    ref_gather_heads,
    ref_head_digests,
    ref_scatter_heads,
)
from vllm_ext import KVCache, _lib, ops

SEEDS = range(3)
PAIRS = HEAD_RANGE_PAIRS


def poisoned(shape, seed):
    g = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def random_range(rng, num_heads):
    count = rng.randint(1, num_heads)
    return rng.randint(0, num_heads - count), count


def copy_of(cache, kind, seed):
    """A second cache with the same bytes (the expected result is built on it)."""
    geometry = {k: getattr(cache, k) for k in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size")}
    twin = random_head_cache(geometry, cache.dtype, kind, seed=seed)
    for t, s in zip(twin.layers, cache.layers):
        t.copy_(s)
    return twin


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_gather_of_a_head_range_matches_reference(kind, dtype, seed):
    rng = random.Random(seed)
    geometry = random_head_geometry(rng)
    cache = random_head_cache(geometry, dtype, kind, seed=seed)
    heads = random_range(rng, geometry["num_kv_heads"])
    ids = [rng.randrange(geometry["num_blocks"]) for _ in range(rng.randint(1, 8))]  # repeats ok
    row_nbytes = cache.buffer_row_nbytes(heads)
    assert row_nbytes * geometry["num_kv_heads"] == cache.block_nbytes * heads[1]
    out = poisoned((len(ids) + 2, row_nbytes), seed)
    tail = out[len(ids):].clone()
    before = cache_bytes(cache)
    assert ops.gather_blocks(cache, ids, out=out, heads=heads) is out
    assert torch.equal(out[:len(ids)], ref_gather_heads(cache, ids, *heads))
    assert torch.equal(out[len(ids):], tail), "rows past len(ids) were written"
    assert_cache_bytes_equal(cache, before)
    assert torch.equal(ops.gather_blocks(cache, ids, heads=heads), out[:len(ids)])  # a buffer of its own


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_scatter_of_a_head_range_matches_reference(kind, dtype, seed):
    """Every byte of the cache: the range of the named blocks written, every other head and
    block as it was."""
    rng = random.Random(100 + seed)
    geometry = random_head_geometry(rng)
    cache = random_head_cache(geometry, dtype, kind, seed=seed)
    expected = copy_of(cache, kind, seed)
    heads = random_range(rng, geometry["num_kv_heads"])
    ids = distinct_ids(rng, geometry["num_blocks"], rng.randint(1, geometry["num_blocks"]))
    buf = poisoned((len(ids), cache.buffer_row_nbytes(heads)), seed)
    buf_before = buf.clone()
    ops.scatter_blocks(buf, cache, ids, heads=heads)
    ref_scatter_heads(buf, expected, ids, *heads)
    assert_cache_bytes_equal(cache, cache_bytes(expected))
    assert torch.equal(buf, buf_before)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("src_kind,dst_kind", PAIRS)
def test_copy_between_caches_of_other_head_counts_matches_reference(src_kind, dst_kind, seed):
    """Heads [a, a + n) of a source of H_src heads into [b, b + n) of a destination of H_dst:
    every byte of the destination checked, the source untouched."""
    rng = random.Random(200 + seed)
    dtype = DTYPES[seed % len(DTYPES)]
    src_geometry = random_head_geometry(rng)
    dst_geometry = dict(src_geometry, num_blocks=rng.randint(1, 12), num_kv_heads=rng.randint(1, 6))
    src = random_head_cache(src_geometry, dtype, src_kind, seed=seed)
    dst = random_head_cache(dst_geometry, dtype, dst_kind, seed=seed + 1)
    expected = copy_of(dst, dst_kind, seed + 1)
    count = rng.randint(1, min(src.num_kv_heads, dst.num_kv_heads))
    src_heads = (rng.randint(0, src.num_kv_heads - count), count)
    dst_heads = (rng.randint(0, dst.num_kv_heads - count), count)
    n = rng.randint(1, min(src.num_blocks, dst.num_blocks))
    src_ids = [rng.randrange(src.num_blocks) for _ in range(n)]
    dst_ids = distinct_ids(rng, dst.num_blocks, n)
    src_before = cache_bytes(src)
    ops.copy_blocks(src, src_ids, dst, dst_ids, src_heads=src_heads, dst_heads=dst_heads)
    ref_scatter_heads(ref_gather_heads(src, src_ids, *src_heads), expected, dst_ids, *dst_heads)
    assert_cache_bytes_equal(dst, cache_bytes(expected))
    assert_cache_bytes_equal(src, src_before)


@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_decode_rank_gathers_its_heads_from_several_prefill_ranks(kind, seed):
    """Unequal TP, P = 4 ranks of 2 heads, D = 2 ranks of 4 heads (and the reverse): D's rank r
    assembles its heads from P ranks 2r and 2r+1, through copy_blocks and through buffers (a
    pull); then P's rank takes its slice back from D. Every byte equals one full cache's."""
    rng = random.Random(300 + seed)
    geometry = dict(random_head_geometry(rng), num_kv_heads=8)
    full = random_head_cache(geometry, torch.bfloat16, kind, seed=seed)
    shard = dict(geometry, num_kv_heads=2)
    p_ranks = [random_head_cache(shard, torch.bfloat16, kind, seed=seed + 10 + r) for r in range(4)]
    ids = list(range(geometry["num_blocks"]))
    for r, p in enumerate(p_ranks):  # P's shards: heads [2r, 2r + 2) of the full cache
        ops.copy_blocks(full, ids, p, ids, src_heads=(2 * r, 2))
    for r in range(2):
        d_geometry = dict(geometry, num_kv_heads=4)
        by_copy = random_head_cache(d_geometry, torch.bfloat16, kind, seed=seed + 20 + r)
        by_pull = random_head_cache(d_geometry, torch.bfloat16, kind, seed=seed + 30 + r)
        for j in range(2):
            p = p_ranks[2 * r + j]
            ops.copy_blocks(p, ids, by_copy, ids, dst_heads=(2 * j, 2))
            ops.scatter_blocks(ops.gather_blocks(p, ids), by_pull, ids, heads=(2 * j, 2))
        want = ref_gather_heads(full, ids, 4 * r, 4)
        assert torch.equal(ops.gather_blocks(by_copy, ids), want)
        assert torch.equal(ops.gather_blocks(by_pull, ids), want)
        # ... and P's rank 2r + 1 takes its slice of D's rank r: heads [2, 4) of 4
        back = random_head_cache(shard, torch.bfloat16, kind, seed=seed + 40 + r)
        ops.copy_blocks(by_pull, ids, back, ids, src_heads=(2, 2))
        assert_cache_bytes_equal(back, cache_bytes(p_ranks[2 * r + 1]))


@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_every_head_equals_the_whole_block_path(kind):
    """heads=(0, H) is the whole block: the same bytes as no range, on the whole-slice launch."""
    rng = random.Random(5)
    geometry = dict(random_head_geometry(rng), num_kv_heads=3)
    cache = random_head_cache(geometry, torch.float16, kind, seed=5)
    ids = [rng.randrange(geometry["num_blocks"]) for _ in range(5)]
    every = ops.gather_blocks(cache, ids, heads=(0, 3))
    assert torch.equal(every, ops.gather_blocks(cache, ids))
    assert torch.equal(every, ref_gather_heads(cache, ids, 0, 3))  # memory order (ref_gather: logical)
    if kind != "blocks_nhd":
        assert torch.equal(every, ref_gather(cache, ids))
    whole = cache.head_part((0, 3))
    assert ops._Rows.of(cache, whole, None) == ops._Rows(cache.slice_nbytes)
    part = cache.head_part((1, 2))
    rows = ops._Rows.of(cache, part, None)
    assert rows.slice_nbytes == part.slice_nbytes and rows.src[0] == part.offset
    # token-major slices move in block_size runs; a heads-major slice is one run
    token_major = kind != "blocks_hnd" and geometry["block_size"] > 1
    assert rows.num_rows == (geometry["block_size"] if token_major else 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", HEAD_LAYOUTS)
def test_head_range_digests_match_the_definition(kind, dtype, seed):
    """The digest of a head range is the definition over its gather row; the same heads in a
    cache of another head count (after a copy) digest the same."""
    rng = random.Random(400 + seed)
    geometry = random_head_geometry(rng)
    cache = random_head_cache(geometry, dtype, kind, seed=seed)
    heads = random_range(rng, geometry["num_kv_heads"])
    ids = [rng.randrange(geometry["num_blocks"]) for _ in range(rng.randint(1, 6))]
    if ops._part_alignment(cache.alignment, cache.head_part(heads)) < 4:
        with pytest.raises(ValueError, match="32-bit words"):
            ops.block_digests(cache, ids, heads=heads)
        return
    digests = ops.block_digests(cache, ids, heads=heads)
    assert digests == ref_head_digests(cache, ids, *heads)
    wider = random_head_cache(dict(geometry, num_kv_heads=geometry["num_kv_heads"] + 2), dtype, kind, seed=seed + 1)
    unique = sorted(set(ids))
    ops.copy_blocks(cache, unique, wider, unique, src_heads=heads, dst_heads=(1, heads[1]))
    assert ops.block_digests(wider, unique, heads=(1, heads[1])) == ops.block_digests(cache, unique, heads=heads)


def test_large_head_range_copy_uses_threads_and_stays_exact(monkeypatch):
    """32 MiB of heads: the CPU twin splits the slices over threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    geometry = {"num_layers": 8, "num_blocks": 64, "block_size": 16, "num_kv_heads": 32, "head_size": 64}
    cache = random_cache(geometry, torch.bfloat16, "flash", seed=12)
    ids = random.Random(12).sample(range(64), 64)
    assert cache.buffer_row_nbytes((4, 16)) * len(ids) >= 32 << 20
    assert torch.equal(ops.gather_blocks(cache, ids, heads=(4, 16)), ref_gather_heads(cache, ids, 4, 16))


# ---- refusals: each names the argument and its value, and nothing is written -----------------------
GEOMETRY = {"num_layers": 2, "num_blocks": 6, "block_size": 4, "num_kv_heads": 4, "head_size": 8}


@pytest.fixture
def caches():
    seed = random.randrange(1 << 30)
    src = random_head_cache(GEOMETRY, torch.float16, "flash", seed=seed)
    dst = random_head_cache(dict(GEOMETRY, num_kv_heads=8), torch.float16, "flashinfer", seed=seed + 1)
    return src, dst


def unchanged(*caches):
    snapshots = [cache_bytes(c) for c in caches]

    class Check:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            for c, s in zip(caches, snapshots):
                assert_cache_bytes_equal(c, s)

    return Check()


@pytest.mark.parametrize("heads,exc,match", [
    ((0, 0), ValueError, r"heads: count 0 in \(0, 0\)"),
    ((2, -1), ValueError, r"heads: count -1"),
    ((-1, 2), ValueError, r"heads: heads \[-1, 1\) of \(-1, 2\) are outside the cache's 4 KV heads"),
    ((3, 2), ValueError, r"heads: heads \[3, 5\) of \(3, 2\) are outside the cache's 4 KV heads \[0, 4\)"),
    ((4, 1), ValueError, r"heads: heads \[4, 5\)"),
    ((0,), TypeError, r"heads: expected \(first, count\), two ints, got \(0,\)"),
    ((0, 1, 2), TypeError, "heads: expected"),
    ((0.0, 1), TypeError, "heads: expected"),
    ((True, 1), TypeError, "heads: expected"),
    ("01", TypeError, "heads: expected"),
    (range(0, 2), TypeError, "heads: expected"),
])
def test_gather_scatter_and_digests_refuse_bad_ranges(caches, heads, exc, match):
    cache = caches[0]
    out = poisoned((2, 64), 1)
    buf = poisoned((2, cache.buffer_row_nbytes((0, 1))), 2)
    out_before, buf_before = out.clone(), buf.clone()
    with unchanged(cache):
        with pytest.raises(exc, match=match):
            ops.gather_blocks(cache, [0, 1], out=out, heads=heads)
        with pytest.raises(exc, match=match):
            ops.scatter_blocks(buf, cache, [0, 1], heads=heads)
        with pytest.raises(exc, match=match):
            ops.block_digests(cache, [0, 1], heads=heads)
        with pytest.raises(exc, match=match.replace("heads:", "src_heads:", 1)):
            ops.copy_blocks(cache, [0], caches[1], [0], src_heads=heads, dst_heads=(0, 1))
    assert torch.equal(out, out_before) and torch.equal(buf, buf_before)


def test_a_buffer_must_hold_the_range_alone(caches):
    """A whole-block buffer is not a head-range buffer (nor the reverse): the shape names both."""
    cache = caches[0]
    whole = poisoned((2, cache.block_nbytes), 3)
    part = poisoned((2, cache.buffer_row_nbytes((1, 2))), 4)
    assert part.shape[1] * 2 == whole.shape[1]
    before = whole.clone()
    with unchanged(cache):
        with pytest.raises(ValueError, match=rf"out: shape \[2, {cache.block_nbytes}\], expected \[>= 2, "
                                             rf"{part.shape[1]}\]"):
            ops.gather_blocks(cache, [0, 1], out=whole, heads=(1, 2))
        with pytest.raises(ValueError, match=rf"buf: shape \[2, {part.shape[1]}\], expected \[>= 2, "
                                             rf"{cache.block_nbytes}\]"):
            ops.scatter_blocks(part, cache, [0, 1])
        with pytest.raises(ValueError, match="buf: shape"):
            ops.scatter_blocks(whole, cache, [0, 1], heads=(1, 2))
    assert torch.equal(whole, before)


def test_copy_refuses_ranges_that_do_not_pair(caches):
    src, dst = caches
    with unchanged(src, dst):
        with pytest.raises(ValueError, match=r"src_heads and dst_heads: 2 heads \(\(0, 2\) of 4\) vs 3 "
                                             r"\(\(1, 3\) of 8\)"):
            ops.copy_blocks(src, [0], dst, [0], src_heads=(0, 2), dst_heads=(1, 3))
        with pytest.raises(ValueError, match=r"src_heads and dst_heads: 4 heads \(all of 4\) vs 8 \(all of 8\)"):
            ops.copy_blocks(src, [0], dst, [0], src_heads=None, dst_heads=(0, 8))
        with pytest.raises(ValueError, match=r"dst_heads: heads \[6, 10\)"):
            ops.copy_blocks(src, [0], dst, [0], dst_heads=(6, 4))
        # without a range the head counts must match, as before
        with pytest.raises(ValueError, match="geometry differs.*num_kv_heads 4 vs 8"):
            ops.copy_blocks(src, [0], dst, [0])


@pytest.mark.parametrize("change,match", [
    ({"head_size": 16}, "geometry differs.*head_size 8 vs 16"),
    ({"block_size": 2}, "geometry differs.*block_size 4 vs 2"),
    ({"num_layers": 3}, "geometry differs.*num_layers 2 vs 3"),
    ({"dtype": torch.bfloat16}, "geometry differs.*dtype float16 vs bfloat16"),
])
def test_copy_with_ranges_still_needs_equal_head_size_dtype_and_blocks(caches, change, match):
    src = caches[0]
    dtype = change.pop("dtype", torch.float16)
    dst = random_head_cache(dict(GEOMETRY, num_kv_heads=8, **change), dtype, "flash", seed=9)
    with unchanged(src, dst):
        with pytest.raises(ValueError, match=match):
            ops.copy_blocks(src, [0], dst, [0], src_heads=(0, 2), dst_heads=(2, 2))


def test_copy_refuses_heads_in_another_order():
    """A heads-major view and a token-major one hold a head range in other byte orders."""
    geometry = dict(GEOMETRY, num_kv_heads=4)
    hnd = random_head_cache(geometry, torch.float16, "blocks_hnd", seed=1)
    nhd = random_head_cache(dict(geometry, num_kv_heads=2), torch.float16, "blocks_nhd", seed=2)
    with unchanged(hnd, nhd):
        with pytest.raises(ValueError, match=r"src_cache and dst_cache: their KV heads lie differently in a block "
                                             r"\(src: 1 run\(s\) of heads of 64 bytes per slice, dst: 4 of 16\)"):
            ops.copy_blocks(hnd, [0], nhd, [0], src_heads=(0, 2))


def test_mla_refuses_a_head_range():
    geometry = {"num_layers": 2, "num_blocks": 4, "block_size": 4, "num_kv_heads": 1, "head_size": 16}
    mla = random_cache(geometry, torch.bfloat16, "mla", seed=3)
    other = random_cache(geometry, torch.bfloat16, "mla", seed=4)
    with unchanged(mla, other):
        for call in (lambda: ops.gather_blocks(mla, [0], heads=(0, 1)),
                     lambda: ops.scatter_blocks(torch.zeros((1, mla.block_nbytes), dtype=torch.uint8), mla, [0],
                                                heads=(0, 1)),
                     lambda: ops.block_digests(mla, [0], heads=(0, 1)),
                     lambda: mla.buffer_row_nbytes((0, 1))):
            with pytest.raises(ValueError, match=r"heads: a head range \(\(0, 1\)\) of an 'mla' cache; it holds "
                                                 "one latent per token"):
                call()
        # a 'blocks' cache of the latent's geometry: the mla side refuses even "every head"
        latent_sized = random_head_cache(dict(geometry, num_kv_heads=2), torch.bfloat16, "blocks_hnd", seed=5)
        with pytest.raises(ValueError, match=r"dst_heads: a head range \(every head\) of an 'mla' cache"):
            ops.copy_blocks(latent_sized, [0], other, [1], src_heads=(0, 1))
    ops.copy_blocks(mla, [0], other, [1])  # whole blocks, as before


def test_the_c_copy_refuses_bad_rows_before_writing():
    """The ABI checks its own row arguments: num_rows not a positive divisor, rows that overlap,
    a negative offset. Nothing is written."""
    cache = KVCache.allocate(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, device="cpu")
    buf = poisoned((1, cache.block_nbytes // 2), 7)
    before = buf.clone()
    dst = ops._buffer_side(buf, cache, cache.slice_nbytes // 2)
    half = cache.slice_nbytes // 2

    def refused(num_rows, offset=0, row_stride=0, slice_nbytes=half):
        src = ops._cache_side(cache, None, torch.device("cpu"), (offset, row_stride))
        with pytest.raises(_lib.VllmExtError) as info:
            _lib.copy_blocks_cpu(src, dst, 1, 2, 2, slice_nbytes, 1, num_rows)
        assert info.value.status == _lib.ERR_INVALID_ARGUMENT
        assert torch.equal(buf, before)
        return str(info.value)

    assert f"num_rows 0 is not a positive divisor of slice_nbytes {half}" in refused(0)
    assert f"num_rows 3 is not a positive divisor of slice_nbytes {half}" in refused(3)
    assert "src row_stride 8 is below a row's 16 bytes (num_rows 4)" in refused(4, row_stride=8)
    assert "src slice_offset -2 is negative" in refused(4, offset=-2, row_stride=32)
    # the CUDA entry points check the same before any GPU work (a CPU-only build says it has no CUDA)
    ids = array.array("q", [0])
    src = ops._cache_side(cache, None, torch.device("cpu"), (0, 8))
    with pytest.raises(_lib.VllmExtError) as info:
        _lib.copy_blocks_cuda_inline(src, dst, ids.buffer_info()[0], None, 1, 2, 2, half, 16, 0, None, 0, 4)
    assert info.value.status == (_lib.ERR_INVALID_ARGUMENT if _lib.built_with_cuda() else _lib.ERR_NO_CUDA)
    out = (ctypes.c_uint64 * 1)(7)
    with pytest.raises(_lib.VllmExtError, match="rows of 6 bytes are not whole 32-bit words"):
        _lib.block_digests_cpu(ops._cache_side(cache, None, torch.device("cpu")), ids.buffer_info()[0], 1, 2, 2,
                               24, ctypes.addressof(out), 1, 4)
    assert list(out) == [7]
    assert torch.equal(buf, before)
