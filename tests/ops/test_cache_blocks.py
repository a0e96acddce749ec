"""The `blocks` layout: vLLM's per-layer views `[num_blocks, H, block_size, C]` wrapped without a
copy, in every physical order vLLM 0.32 allocates (LB** and BL**, one backing allocation) and
0.26's FlashAttention tensor. Checked byte for byte against a plain torch reference."""

import math
import random

import pytest
import torch

from vllm_ext import KVCache, ops

# vLLM's logical axes are [L, B, H, N, C]; a layout names their order in memory.
PHYSICAL_ORDERS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
NON_DENSE_ORDERS = ("LHBNC", "BHLNC")
DTYPES = (torch.bfloat16, torch.float32, torch.uint8)
GEOMETRIES = (  # (layers, blocks, heads, block_size, C)
    (4, 9, 2, 16, 128),
    (1, 3, 1, 1, 3),
    (3, 17, 4, 5, 8),
)


def vllm_views(order, num_layers, num_blocks, heads, block_size, c, dtype, seed, pad_blocks=0):
    """Per-layer `[B, H, N, C]` views of one allocation in physical `order`, as vLLM 0.32 makes
    them (as_strided over one byte buffer), filled with random bytes."""
    sizes = {"L": num_layers, "B": num_blocks + pad_blocks, "H": heads, "N": block_size, "C": c}
    strides, acc = {}, 1
    for axis in reversed(order):
        strides[axis] = acc
        acc *= sizes[axis]
    g = torch.Generator().manual_seed(seed)
    backing = torch.randint(0, 256, (acc * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    return [backing.as_strided((num_blocks, heads, block_size, c),
                               (strides["B"], strides["H"], strides["N"], strides["C"]),
                               layer * strides["L"])
            for layer in range(num_layers)], order


def reference_block_bytes(layer, block):
    """The bytes of one block of one layer in memory order (what the wire format carries)."""
    t = layer[block]
    perm = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(*perm).contiguous().view(torch.uint8).flatten()


def reference_gather(layers, ids):
    return torch.stack([torch.cat([reference_block_bytes(t, b) for t in layers]) for b in ids])


@pytest.mark.parametrize("order", PHYSICAL_ORDERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_gather_scatter_copy_match_reference(order, dtype, geometry):
    num_layers, num_blocks, heads, block_size, c = geometry
    rng = random.Random(f"{order}-{dtype}-{geometry}")  # str seeds are hashed with sha512: reproducible
    layers, _ = vllm_views(order, *geometry, dtype, seed=rng.randint(0, 1 << 30))
    pointers = [t.data_ptr() for t in layers]
    cache = KVCache.from_layers(layers, layout="blocks")
    assert [t.data_ptr() for t in cache.layers] == pointers  # wrapped, not copied
    assert cache.num_components == 1
    assert cache.slice_nbytes == heads * block_size * c * dtype.itemsize
    assert cache.block_nbytes == num_layers * cache.slice_nbytes

    ids = [rng.randrange(num_blocks) for _ in range(rng.randint(1, 2 * num_blocks))]
    buf = ops.gather_blocks(cache, ids)
    assert torch.equal(buf, reference_gather(layers, ids))

    # scatter into a second cache of the same order, then compare every byte of every block
    dst_layers, _ = vllm_views(order, *geometry, dtype, seed=rng.randint(0, 1 << 30))
    before = [t.clone() for t in dst_layers]
    dst = KVCache.from_layers(dst_layers, layout="blocks")
    dst_ids = rng.sample(range(num_blocks), min(len(ids), num_blocks))
    ops.scatter_blocks(buf[:len(dst_ids)], dst, dst_ids)
    for layer in range(num_layers):
        for b in range(num_blocks):
            got = reference_block_bytes(dst_layers[layer], b)
            if b in dst_ids:
                want = reference_block_bytes(layers[layer], ids[dst_ids.index(b)])
            else:
                want = reference_block_bytes(before[layer], b)
            assert torch.equal(got, want), (layer, b)

    # paged -> paged between two different physical orders of the same geometry moves bytes as
    # stored: only meaningful between equal orders, which the connector's fingerprint enforces
    other_layers, _ = vllm_views(order, *geometry, dtype, seed=1)
    other = KVCache.from_layers(other_layers, layout="blocks")
    ops.copy_blocks(cache, ids[:len(dst_ids)], other, dst_ids)
    for layer in range(num_layers):
        for i, b in enumerate(dst_ids):
            assert torch.equal(reference_block_bytes(other_layers[layer], b),
                               reference_block_bytes(layers[layer], ids[i]))


def test_vllm_026_flash_attention_tensor():
    """0.26's FlashAttention cache: one tensor per layer [B, H, N, 2 * head_size] with stride
    order (0, 2, 1, 3), i.e. each block dense as [N][H][2 * head_size]."""
    nb, heads, bs, hs = 7, 2, 16, 64
    g = torch.Generator().manual_seed(3)
    layers = [torch.randint(-100, 100, (nb, bs, heads, 2 * hs), generator=g).to(torch.bfloat16)
              .transpose(1, 2) for _ in range(3)]
    cache = KVCache.from_layers(layers, layout="blocks")
    ids = [6, 0, 3, 3]
    assert torch.equal(ops.gather_blocks(cache, ids), reference_gather(layers, ids))


def test_allocate_blocks_layout():
    cache = KVCache.allocate(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8,
                             dtype=torch.float16, device="cpu", layout="blocks")
    assert tuple(cache.layers[0].shape) == (5, 2, 4, 8)
    assert cache.block_nbytes == 2 * 2 * 4 * 8 * 2


def test_padding_between_blocks_is_fine():
    big = torch.randn(2, 10, 2, 4, 8, generator=torch.Generator().manual_seed(5))
    padded = [big[i, ::2] for i in range(2)]  # every other block: block stride 2 x block
    cache = KVCache.from_layers(padded, layout="blocks")
    assert cache.block_stride == 2 * 2 * 4 * 8 * 4
    assert torch.equal(ops.gather_blocks(cache, [4, 1]), reference_gather(padded, [4, 1]))


@pytest.mark.parametrize("order", NON_DENSE_ORDERS)
def test_rejects_views_whose_blocks_are_not_dense(order):
    layers, _ = vllm_views(order, 2, 6, 4, 4, 8, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"layers\[0\]: strides .* do not make each block one dense run"):
        KVCache.from_layers(layers, layout="blocks")


def test_rejects_a_sliced_inner_dim_and_a_wrong_rank():
    t = torch.zeros(4, 2, 8, 16)[:, :, :, :8]  # C sliced: gaps inside each block
    with pytest.raises(ValueError, match="dense run"):
        KVCache.from_layers([t], layout="blocks")
    with pytest.raises(ValueError, match=r"does not match layout 'blocks' \[num_blocks, num_kv_heads"):
        KVCache.from_layers([torch.zeros(4, 8, 16)], layout="blocks")


def test_rejects_overlapping_blocks():
    base = torch.zeros(64)
    t = base.as_strided((4, 1, 2, 4), (4, 8, 4, 1))  # block stride 4 < block of 8 elements
    with pytest.raises(ValueError, match="overlap|dense run"):
        KVCache.from_layers([t], layout="blocks")


def test_block_nbytes_formula():
    layers, _ = vllm_views("BLNHC", 4, 3, 2, 16, 128, torch.bfloat16, seed=0)
    cache = KVCache.from_layers(layers, layout="blocks")
    assert cache.block_nbytes == 4 * math.prod((2, 16, 128)) * 2
    # BL**: layer l of block b sits right after layer l-1 of block b
    assert cache.block_stride == 4 * cache.slice_nbytes
