"""The compiled CPU implementation of every op against the plain torch reference."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
)
from vllm_ext import KVCache, ops

SEEDS = range(4)


def poisoned(shape, seed):
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_reference(layout, dtype, seed):
    rng = random.Random(seed)
    geometry = random_geometry(rng, layout)
    cache = random_cache(geometry, dtype, layout, seed=seed)
    ids = [rng.randrange(geometry["num_blocks"]) for _ in range(rng.randint(1, 12))]  # repeats ok
    out = poisoned((len(ids) + 2, cache.block_nbytes), seed)
    tail = out[len(ids):].clone()
    before = cache_bytes(cache)
    result = ops.gather_blocks(cache, ids, out=out)
    assert result is out
    assert torch.equal(out[:len(ids)], ref_gather(cache, ids))
    assert torch.equal(out[len(ids):], tail), "rows past len(ids) were written"
    assert_cache_bytes_equal(cache, before)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_matches_reference(layout, dtype, seed):
    rng = random.Random(100 + seed)
    geometry = random_geometry(rng, layout)
    cache = random_cache(geometry, dtype, layout, seed=seed)
    expected = random_cache(geometry, dtype, layout, seed=seed)  # same bytes
    ids = distinct_ids(rng, geometry["num_blocks"], rng.randint(1, geometry["num_blocks"]))
    buf = poisoned((len(ids), cache.block_nbytes), seed)
    ops.scatter_blocks(buf, cache, ids)
    ref_scatter(buf, expected, ids)
    assert_cache_bytes_equal(cache, cache_bytes(expected))  # written blocks and untouched ones


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("src_layout,dst_layout",
                         [("flash", "flash"), ("flash", "flashinfer"), ("flashinfer", "flash"),
                          ("mla", "mla")])
def test_copy_blocks_matches_reference(src_layout, dst_layout, seed):
    rng = random.Random(200 + seed)
    dtype = DTYPES[seed % len(DTYPES)]
    geometry = random_geometry(rng, src_layout)
    src = random_cache(geometry, dtype, src_layout, seed=seed)
    dst_geometry = dict(geometry, num_blocks=rng.randint(1, 40))
    dst = random_cache(dst_geometry, dtype, dst_layout, seed=seed + 1)
    expected = random_cache(dst_geometry, dtype, dst_layout, seed=seed + 1)
    n = rng.randint(1, min(geometry["num_blocks"], dst_geometry["num_blocks"]))
    src_ids = [rng.randrange(geometry["num_blocks"]) for _ in range(n)]
    dst_ids = distinct_ids(rng, dst_geometry["num_blocks"], n)
    src_before = cache_bytes(src)
    ops.copy_blocks(src, src_ids, dst, dst_ids)
    ref_scatter(ref_gather(src, src_ids), expected, dst_ids)
    assert_cache_bytes_equal(dst, cache_bytes(expected))
    assert_cache_bytes_equal(src, src_before)


def test_copy_within_one_cache_disjoint_sets():
    cache = random_cache(random_geometry(random.Random(7), "flash"), torch.float16, "flash", seed=7)
    n = cache.num_blocks // 2
    if n == 0:
        pytest.skip("geometry too small")
    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
    expected_rows = ref_gather(cache, src_ids)
    ops.copy_blocks(cache, src_ids, cache, dst_ids)
    assert torch.equal(ref_gather(cache, dst_ids), expected_rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_all_then_scatter_reproduces_the_cache(layout):
    rng = random.Random(3)
    geometry = random_geometry(rng, layout)
    src = random_cache(geometry, torch.bfloat16, layout, seed=3)
    ids = distinct_ids(rng, geometry["num_blocks"], geometry["num_blocks"])
    buf = ops.gather_blocks(src, ids)
    dst = random_cache(geometry, torch.bfloat16, layout, seed=4)
    ops.scatter_blocks(buf, dst, ids)
    assert_cache_bytes_equal(dst, cache_bytes(src))


def test_wire_format_prefix():
    """The first k rows of a gather are the gather of the first k ids (a sendable prefix)."""
    rng = random.Random(11)
    cache = random_cache(random_geometry(rng, "flash"), torch.bfloat16, "flash", seed=11)
    ids = [rng.randrange(cache.num_blocks) for _ in range(8)]
    full = ops.gather_blocks(cache, ids)
    for k in (1, 3, 8):
        assert torch.equal(ops.gather_blocks(cache, ids[:k]), full[:k])


def test_wire_format_layout_is_layer_then_component():
    """Row layout spelled out: layer l, component c starts at (l * C + c) * slice_nbytes."""
    cache = random_cache({"num_layers": 3, "num_blocks": 4, "block_size": 2, "num_kv_heads": 2,
                          "head_size": 4}, torch.float32, "flashinfer", seed=5)
    row = ops.gather_blocks(cache, [2])[0]
    chunk = cache.slice_nbytes
    for index, layer in enumerate(cache.layers):
        for c in range(2):
            start = (index * 2 + c) * chunk
            expected = layer[2, c].contiguous().view(torch.uint8).flatten()
            assert torch.equal(row[start:start + chunk], expected)


@pytest.mark.parametrize("form", ["list", "tuple", "int64", "int32", "int16"])
def test_block_id_forms(form):
    rng = random.Random(9)
    cache = random_cache(random_geometry(rng, "flash"), torch.float16, "flash", seed=9)
    ids = [rng.randrange(cache.num_blocks) for _ in range(5)]
    as_form = {"list": ids, "tuple": tuple(ids), "int64": torch.tensor(ids),
               "int32": torch.tensor(ids, dtype=torch.int32),
               "int16": torch.tensor(ids, dtype=torch.int16)}[form]
    assert torch.equal(ops.gather_blocks(cache, as_form), ref_gather(cache, ids))


def test_empty_ids_write_nothing():
    cache = random_cache(random_geometry(random.Random(1), "flash"), torch.float16, "flash")
    out = ops.gather_blocks(cache, [])
    assert out.shape == (0, cache.block_nbytes)
    before = cache_bytes(cache)
    ops.scatter_blocks(torch.empty((0, cache.block_nbytes), dtype=torch.uint8), cache, [])
    ops.copy_blocks(cache, [], cache, [])
    assert_cache_bytes_equal(cache, before)


def test_padded_block_stride_from_layers():
    """A layer whose blocks are not adjacent (a strided view) is wrapped without a copy."""
    g = torch.Generator().manual_seed(2)
    full = [fill_random_(torch.empty(2, 12, 4, 2, 8, dtype=torch.float16), g) for _ in range(3)]
    layers = [t[:, ::3] for t in full]  # every third block: block stride 3x the block size
    cache = KVCache.from_layers(layers, layout="flash")
    assert cache.num_blocks == 4 and cache.block_stride == 3 * cache.slice_nbytes
    ids = [3, 0, 2]
    assert torch.equal(ops.gather_blocks(cache, ids), ref_gather(cache, ids))
    buf = poisoned((2, cache.block_nbytes), 1)
    def between(t):
        return t[:, 1::3].contiguous().view(torch.uint8)

    untouched = [between(t).clone() for t in full]
    ops.scatter_blocks(buf, cache, [1, 2])
    assert torch.equal(ref_gather(cache, [1, 2]), buf)
    for t, before in zip(full, untouched):
        assert torch.equal(between(t), before), "bytes between the blocks were written"


def test_large_copy_uses_threads_and_stays_exact(monkeypatch):
    """Big enough (32 MiB) for the CPU copy to split over threads (2 or more allowed)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    geometry = {"num_layers": 8, "num_blocks": 64, "block_size": 16, "num_kv_heads": 16,
                "head_size": 64}
    cache = random_cache(geometry, torch.bfloat16, "flash", seed=12)
    ids = random.Random(12).sample(range(64), 64)
    assert cache.block_nbytes * len(ids) >= 32 << 20
    assert torch.equal(ops.gather_blocks(cache, ids), ref_gather(cache, ids))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_scatter_then_gather_is_identity(data):
    layout = data.draw(st.sampled_from(LAYOUTS))
    dtype = data.draw(st.sampled_from(DTYPES))
    geometry = {
        "num_layers": data.draw(st.integers(1, 4)),
        "num_blocks": data.draw(st.integers(1, 24)),
        "block_size": data.draw(st.integers(1, 5)),
        "num_kv_heads": 1 if layout == "mla" else data.draw(st.integers(1, 3)),
        "head_size": data.draw(st.integers(1, 9)),
    }
    seed = data.draw(st.integers(0, 2**31 - 1))
    cache = random_cache(geometry, dtype, layout, seed=seed)
    ids = data.draw(st.lists(st.integers(0, geometry["num_blocks"] - 1), unique=True,
                             max_size=geometry["num_blocks"]))
    buf = poisoned((len(ids), cache.block_nbytes), seed)
    ops.scatter_blocks(buf, cache, ids)
    assert torch.equal(ops.gather_blocks(cache, ids), buf)
    gather_ids = data.draw(st.lists(st.integers(0, geometry["num_blocks"] - 1), max_size=30))
    assert torch.equal(ops.gather_blocks(cache, gather_ids), ref_gather(cache, gather_ids))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_digests_match_the_definition(layout, dtype, seed):
    """Every layout and dtype, ids with repeats: the digests equal the header's definition over
    the block rows; geometries whose slices are not whole 32-bit words are refused."""
    rng = random.Random(300 + seed)
    geometry = random_geometry(rng, layout)
    cache = random_cache(geometry, dtype, layout, seed=seed)
    ids = [rng.randrange(geometry["num_blocks"]) for _ in range(rng.randint(1, 12))]
    before = cache_bytes(cache)
    if cache.alignment < 4:
        with pytest.raises(ValueError, match="32-bit words"):
            ops.block_digests(cache, ids)
    else:
        assert ops.block_digests(cache, ids) == ref_block_digests(cache, ids)
    assert_cache_bytes_equal(cache, before)


def test_a_changed_word_changes_its_blocks_digest_and_no_other():
    geometry = {"num_layers": 3, "num_blocks": 12, "block_size": 4, "num_kv_heads": 2, "head_size": 16}
    cache = random_cache(geometry, torch.bfloat16, "flash", seed=31)
    rng = random.Random(31)
    ids = list(range(12))
    for _ in range(8):
        before = ops.block_digests(cache, ids)
        block, layer = rng.randrange(12), rng.randrange(3)
        raw = cache.layers[layer].view(torch.uint8)[rng.randrange(2), block].view(-1)  # flash: [2, blocks, ...]
        raw[rng.randrange(raw.numel())] ^= 1 << rng.randrange(8)
        after = ops.block_digests(cache, ids)
        assert [i for i in ids if before[i] != after[i]] == [block]


def test_large_digests_use_threads_and_stay_exact(monkeypatch):
    """32 MiB, enough for the CPU twin to split the slices over threads (partial sums per thread)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    geometry = {"num_layers": 8, "num_blocks": 64, "block_size": 16, "num_kv_heads": 16, "head_size": 64}
    cache = random_cache(geometry, torch.bfloat16, "flashinfer", seed=32)
    ids = random.Random(32).choices(range(64), k=70)
    assert cache.block_nbytes * len(ids) >= 32 << 20
    assert ops.block_digests(cache, ids) == ref_block_digests(cache, ids)
    assert ops.block_digests(cache, []) == []


# Slices of 2305 vectors at each access width (4, 8, 16 bytes): past one deep-unrolled tile of
# 2048 vectors, so the GPU tests (test_ops_gpu) reach the deep kernel's partial tile at every
# width; here the CPU twin against the definition on the same geometries.
LONG_SLICES = [(torch.float32, 1, 4), (torch.float16, 4, 8), (torch.bfloat16, 8, 16)]


@pytest.mark.parametrize("dtype,head_size,alignment", LONG_SLICES, ids=str)
def test_block_digests_of_long_odd_slices(dtype, head_size, alignment):
    geometry = {"num_layers": 2, "num_blocks": 4, "block_size": 2305, "num_kv_heads": 1, "head_size": head_size}
    cache = random_cache(geometry, dtype, "flash", seed=alignment)
    assert cache.alignment == alignment and cache.slice_nbytes == 2305 * alignment
    assert ops.block_digests(cache, [3, 0, 3]) == ref_block_digests(cache, [3, 0, 3])
