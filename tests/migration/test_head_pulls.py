"""Pulls of KV head ranges (tensor parallelism of unequal sizes) over gloo, both endpoints in
this process: a destination assembles its heads from several sources of fewer heads, or takes a
slice of one source's heads; every byte of the destination checked against ops.copy_blocks
between the same caches; each refusal before contact, and the source's own refusals."""

import dataclasses
import random

import pytest
import torch

from tests.helpers.reference import assert_cache_bytes_equal, cache_bytes, random_cache, random_head_cache
from vllm_ext import ops
from vllm_ext.migration import MigrationEndpoint, MigrationError

# Small chunks and two stripes: even small pulls run through the multi-chunk pipeline.
OPTIONS = {"stripes": 2, "chunk_bytes": 4 << 10}  # two 2 KiB blocks a chunk
GEOMETRY = {"num_layers": 2, "num_blocks": 12, "block_size": 4, "head_size": 16}


def endpoint(cache):
    return MigrationEndpoint(cache, backend="gloo", **OPTIONS)


def twin(cache, kind, seed):
    """A cache of the same geometry and bytes (expected results are built on it)."""
    geometry = dict(GEOMETRY, num_blocks=cache.num_blocks, num_kv_heads=cache.num_kv_heads)
    other = random_head_cache(geometry, cache.dtype, kind, seed=seed)
    for t, s in zip(other.layers, cache.layers):
        t.copy_(s)
    return other


@pytest.fixture
def closing():
    endpoints = []
    yield endpoints.append
    for ep in endpoints:
        ep.close()


@pytest.mark.parametrize("kind", ["flash", "flashinfer", "blocks_nhd", "blocks_hnd"])
def test_a_destination_assembles_its_heads_from_two_sources_and_gives_a_slice_back(kind, closing):
    """P = 2 ranks of 2 heads, D = 1 rank of 4: D pulls heads [0, 2) of its blocks from P0 and
    [2, 4) from P1; then P1 pulls its two heads back from D's heads [2, 4)."""
    rng = random.Random(kind)
    dtype = torch.bfloat16
    p_caches = [random_head_cache(dict(GEOMETRY, num_kv_heads=2), dtype, kind, seed=10 + r) for r in range(2)]
    d_cache = random_head_cache(dict(GEOMETRY, num_kv_heads=4), dtype, kind, seed=20)
    expected = twin(d_cache, kind, 21)
    p_eps = [endpoint(c) for c in p_caches]
    d_ep = endpoint(d_cache)
    for ep in (*p_eps, d_ep):
        closing(ep)
    n = 9
    src = [rng.randrange(12) for _ in range(n)]  # repeats allowed
    dst = rng.sample(range(12), n)
    p_before = [cache_bytes(c) for c in p_caches]
    for r, p_ep in enumerate(p_eps):
        stats = d_ep.pull(p_ep.descriptor(), src, dst, timeout=60, dst_heads=(2 * r, 2))
        assert stats.num_blocks == n and stats.nbytes == n * d_cache.buffer_row_nbytes((0, 2))
        assert stats.chunks > 1, "the pull ran through one chunk only"
        ops.copy_blocks(p_caches[r], src, expected, dst, dst_heads=(2 * r, 2))
    assert_cache_bytes_equal(d_cache, cache_bytes(expected))  # every byte: the ranges, other blocks
    for c, before in zip(p_caches, p_before):
        assert_cache_bytes_equal(c, before)
    # P1 takes its slice of D's blocks back: heads [2, 4) of 4 into its 2
    back_expected = twin(p_caches[1], kind, 22)
    back_src = rng.sample(dst, 5)
    back_dst = rng.sample(range(12), 5)
    p_eps[1].pull(d_ep.descriptor(), back_src, back_dst, timeout=60, src_heads=(2, 2))
    ops.copy_blocks(d_cache, back_src, back_expected, back_dst, src_heads=(2, 2))
    assert_cache_bytes_equal(p_caches[1], cache_bytes(back_expected))


def test_a_middle_slice_between_caches_of_odd_head_counts(closing):
    """Heads [1, 4) of a 5-head source into heads [0, 3) of a 3-head destination."""
    src_cache = random_head_cache(dict(GEOMETRY, num_kv_heads=5), torch.float16, "flash", seed=30)
    dst_cache = random_head_cache(dict(GEOMETRY, num_kv_heads=3), torch.float16, "flash", seed=31)
    expected = twin(dst_cache, "flash", 32)
    a, b = endpoint(src_cache), endpoint(dst_cache)
    closing(a)
    closing(b)
    b.pull(a.descriptor(), [3, 3, 0, 11], [1, 2, 5, 0], timeout=60, src_heads=(1, 3))
    ops.copy_blocks(src_cache, [3, 3, 0, 11], expected, [1, 2, 5, 0], src_heads=(1, 3))
    assert_cache_bytes_equal(dst_cache, cache_bytes(expected))


@pytest.fixture
def unequal(closing):
    a = endpoint(random_head_cache(dict(GEOMETRY, num_kv_heads=2), torch.float16, "flash", seed=40))
    b = endpoint(random_head_cache(dict(GEOMETRY, num_kv_heads=4), torch.float16, "flash", seed=41))
    closing(a)
    closing(b)
    return a, b


@pytest.mark.parametrize("kwargs,exc,match", [
    ({}, ValueError, r"peer: cache geometry differs \(num_kv_heads 4 here vs 2 at the peer.*pull a head range"),
    ({"src_heads": (0, 2), "dst_heads": (0, 3)}, ValueError,
     r"src_heads and dst_heads: 2 heads \(all of 2\) vs 3 \(\(0, 3\) of 4\)"),
    ({"src_heads": (1, 2)}, ValueError, r"src_heads: heads \[1, 3\) of \(1, 2\) are outside the peer's 2 KV heads"),
    ({"dst_heads": (3, 2)}, ValueError, r"dst_heads: heads \[3, 5\) of \(3, 2\) are outside the cache's 4 KV heads"),
    ({"dst_heads": (0, 0)}, ValueError, r"dst_heads: count 0"),
    ({"src_heads": "01"}, TypeError, r"src_heads: expected \(first, count\)"),
])
def test_bad_head_ranges_are_refused_before_contact(unequal, kwargs, exc, match):
    a, b = unequal
    before = cache_bytes(b.cache)
    with pytest.raises(exc, match=match):
        b.pull(a.descriptor(), [0, 1], [2, 3], timeout=30, **kwargs)
    assert not b._destination._links, "a refused pull must not contact the peer"
    assert_cache_bytes_equal(b.cache, before)


def test_the_source_refuses_heads_outside_its_own(unequal):
    """A descriptor that claims more heads than the source has: the source checks the range
    against its own cache and refuses; nothing is sent."""
    a, b = unequal
    desc = a.descriptor()
    forged = dataclasses.replace(desc, geometry=dict(desc.geometry, num_kv_heads=4,
                                                     slice_nbytes=2 * desc.geometry["slice_nbytes"]))
    with pytest.raises(MigrationError, match=r"refused: ValueError: gloo pull: heads: heads \[2, 4\) of \(2, 2\) "
                                             r"are outside the cache's 2 KV heads") as info:
        b.pull(forged, [0], [0], timeout=30, src_heads=(2, 2), dst_heads=(0, 2))
    assert info.value.remote_type == "ValueError"
    # the same pair still serves a good range afterwards
    b.pull(desc, [0], [0], timeout=30, dst_heads=(2, 2))


def test_mla_and_whole_block_backends_refuse_head_ranges(closing):
    mla_geometry = {"num_layers": 2, "num_blocks": 4, "block_size": 4, "num_kv_heads": 1, "head_size": 16}
    a = endpoint(random_cache(mla_geometry, torch.bfloat16, "mla", seed=50))
    b = endpoint(random_cache(mla_geometry, torch.bfloat16, "mla", seed=51))
    closing(a)
    closing(b)
    with pytest.raises(ValueError, match=r"src_heads: a head range \(\(0, 1\)\) of an 'mla' cache"):
        b.pull(a.descriptor(), [0], [0], src_heads=(0, 1))
    with pytest.raises(ValueError, match=r"dst_heads: a head range \(every head\) of an 'mla' cache"):
        b.pull(dataclasses.replace(a.descriptor(), layout="flash", head_stride=32), [0], [0], src_heads=(0, 1))
    b.pull(a.descriptor(), [0, 1], [2, 3], timeout=30)  # whole blocks, as before


def test_backends_that_move_whole_blocks_refuse_a_range(closing, monkeypatch):
    """A backend that moves whole blocks only (rayrpc) refuses a range by name, before contact
    (and its caches of other head counts do not pair at all)."""
    from vllm_ext.migration import get_backend_class

    assert all(get_backend_class(name).moves_head_ranges for name in ("gloo", "ipc", "nccl"))
    assert not get_backend_class("rayrpc").moves_head_ranges
    a = endpoint(random_head_cache(dict(GEOMETRY, num_kv_heads=2), torch.float16, "flash", seed=60))
    b = endpoint(random_head_cache(dict(GEOMETRY, num_kv_heads=2), torch.float16, "flash", seed=61))
    c = endpoint(random_head_cache(dict(GEOMETRY, num_kv_heads=4), torch.float16, "flash", seed=62))
    for ep in (a, b, c):
        closing(ep)
    monkeypatch.setattr(b.backend, "moves_head_ranges", False)
    with pytest.raises(ValueError, match=r"src_heads and dst_heads: the gloo backend moves whole blocks only "
                                         r"\(got None, \(0, 1\)\)"):
        b.pull(a.descriptor(), [0], [0], dst_heads=(0, 1))
    with pytest.raises(ValueError, match=r"peer: cache geometry differs \(num_kv_heads 2 here vs 4"):
        b.pull(c.descriptor(), [0], [0], src_heads=(0, 2))
    assert not b._destination._links
