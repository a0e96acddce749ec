"""Plain torch reference implementations of the block ops, and data helpers for the tests.

Everything compares bytes (uint8 views), so fp8 and NaN payloads compare exactly."""

import random

import torch

from vllm_ext import KVCache

LAYOUTS = ("flash", "flashinfer", "mla")
DTYPES = tuple(
    d for d in (torch.bfloat16, torch.float16, torch.float32, getattr(torch, "float8_e4m3fn", None),
                torch.uint8)
    if d is not None
)
BLOCK_SIZES = (1, 2, 16)
HEAD_SIZES = (1, 3, 8, 64, 80)


def random_geometry(rng: random.Random, layout: str, max_blocks: int = 40) -> dict:
    return {
        "num_layers": rng.randint(1, 5),
        "num_blocks": rng.randint(1, max_blocks),
        "block_size": rng.choice(BLOCK_SIZES),
        "num_kv_heads": 1 if layout == "mla" else rng.randint(1, 4),
        "head_size": rng.choice(HEAD_SIZES),
    }


def fill_random_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random bytes everywhere (never zeros), whatever the dtype."""
    raw = t.view(torch.uint8) if t.is_contiguous() else None
    if raw is None:
        raise ValueError("fill_random_ needs a contiguous tensor")
    src = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
    raw.copy_(src.to(raw.device))
    return t


def random_cache(geometry: dict, dtype, layout, device="cpu", seed=0, pin_memory=False) -> KVCache:
    cache = KVCache.allocate(**geometry, dtype=dtype, device=device, layout=layout,
                             pin_memory=pin_memory)
    g = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        fill_random_(t, g)
    return cache


def chunk_view(layer: torch.Tensor, layout: str, block: int, component: int) -> torch.Tensor:
    """The tensor view of one component of one block of one layer."""
    if layout == "flash":
        return layer[component, block]
    if layout == "flashinfer":
        return layer[block, component]
    assert component == 0
    return layer[block]


def chunk_bytes(layer, layout, block, component) -> torch.Tensor:
    return chunk_view(layer, layout, block, component).contiguous().view(torch.uint8).flatten()


def ref_gather(cache: KVCache, ids) -> torch.Tensor:
    rows = []
    for b in ids:
        parts = [chunk_bytes(t, cache.layout, int(b), c).cpu()
                 for t in cache.layers for c in range(cache.num_components)]
        rows.append(torch.cat(parts))
    if not rows:
        return torch.empty((0, cache.block_nbytes), dtype=torch.uint8)
    return torch.stack(rows)


def ref_scatter(buf: torch.Tensor, cache: KVCache, ids) -> None:
    chunk = cache.slice_nbytes
    for i, b in enumerate(ids):
        row = buf[i].cpu()
        k = 0
        for t in cache.layers:
            for c in range(cache.num_components):
                view = chunk_view(t, cache.layout, int(b), c)
                view.copy_(row[k * chunk:(k + 1) * chunk].view(t.dtype).view(view.shape).to(view.device))
                k += 1


def cache_bytes(cache: KVCache) -> list:
    """A snapshot of every byte of a cache (CPU copies)."""
    return [t.detach().contiguous().view(torch.uint8).cpu().clone() for t in cache.layers]


def assert_cache_bytes_equal(cache: KVCache, snapshot: list) -> None:
    for i, (t, before) in enumerate(zip(cache.layers, snapshot)):
        now = t.detach().contiguous().view(torch.uint8).cpu()
        assert torch.equal(now, before), f"layer {i} changed"


def to_device(cache: KVCache, device, pin_memory=False) -> KVCache:
    """A copy of `cache` (same layout, bytes) on another device."""
    layers = []
    for t in cache.layers:
        c = t.detach().to(device)
        if pin_memory:
            c = c.pin_memory()
        layers.append(c)
    return KVCache.from_layers(layers, layout=cache.layout)


def distinct_ids(rng: random.Random, num_blocks: int, n: int) -> list:
    return rng.sample(range(num_blocks), n)


DIGEST_STEP, DIGEST_SEED = 0x9E3779B97F4A7C15, 0x243F6A8885A308D3  # csrc/vllm_ext.h


def ref_block_digests(cache: KVCache, ids) -> list:
    """The digest as csrc/vllm_ext.h defines it, over ref_gather's rows, in numpy uint64 (whose
    arithmetic wraps mod 2^64): sum of word p times (p * STEP + SEED) | 1, as signed int64."""
    import numpy as np

    rows = ref_gather(cache, ids).numpy()
    out = []
    for row in rows:
        words = row.view("<u4").astype(np.uint64)
        p = np.arange(words.size, dtype=np.uint64)
        weights = (p * np.uint64(DIGEST_STEP) + np.uint64(DIGEST_SEED)) | np.uint64(1)
        out.append(int((words * weights).sum(dtype=np.uint64).astype(np.int64)))
    return out


# ---- head ranges (ops with heads=(first, count)) --------------------------------------------------
# Layouts whose KV heads can be split, as test ids: vLLM's `blocks` view in both physical
# orders (heads-major HND, token-major NHD) beside flash and flashinfer.
HEAD_LAYOUTS = ("flash", "flashinfer", "blocks_hnd", "blocks_nhd")


def head_cache_layout(kind: str) -> str:
    return "blocks" if kind.startswith("blocks") else kind


def random_head_geometry(rng: random.Random, max_blocks: int = 12) -> dict:
    return {
        "num_layers": rng.randint(1, 3),
        "num_blocks": rng.randint(1, max_blocks),
        "block_size": rng.choice(BLOCK_SIZES),
        "num_kv_heads": rng.randint(1, 6),
        "head_size": rng.choice(HEAD_SIZES),
    }


def random_head_cache(geometry: dict, dtype, kind: str, device="cpu", seed=0) -> KVCache:
    """A cache of one of HEAD_LAYOUTS, random bytes everywhere. blocks_nhd is a [B, H, N, C] view
    of [B, N, H, C] memory, as vLLM's NHD backends hand it over."""
    if kind in ("flash", "flashinfer", "blocks_hnd"):
        return random_cache(geometry, dtype, head_cache_layout(kind), device=device, seed=seed)
    assert kind == "blocks_nhd", kind
    g = torch.Generator().manual_seed(seed)
    shape = (geometry["num_blocks"], geometry["block_size"], geometry["num_kv_heads"], geometry["head_size"])
    layers = [fill_random_(torch.empty(shape, dtype=dtype), g).to(device).transpose(1, 2)
              for _ in range(geometry["num_layers"])]
    return KVCache.from_layers(layers, layout="blocks")


def head_view(layer: torch.Tensor, layout: str, block: int, component: int, first: int, count: int):
    """Heads [first, first + count) of one slice, as a view with its dims in memory order (so
    .contiguous() gives the bytes a head-range row holds, in the cache's own order)."""
    v = chunk_view(layer, layout, block, component)
    if layout in ("flash", "flashinfer"):  # [block_size, heads, head_size]
        return v[:, first:first + count]
    assert layout == "blocks", layout  # [heads, block_size, C], any dense order in memory
    order = sorted(range(3), key=lambda d: -v.stride(d))
    v = v.permute(order)
    return v.narrow(order.index(0), first, count)


def ref_gather_heads(cache: KVCache, ids, first: int, count: int) -> torch.Tensor:
    rows = []
    for b in ids:
        parts = [head_view(t, cache.layout, int(b), c, first, count).contiguous().view(torch.uint8).flatten().cpu()
                 for t in cache.layers for c in range(cache.num_components)]
        rows.append(torch.cat(parts))
    if not rows:
        return torch.empty((0, cache.buffer_row_nbytes((first, count))), dtype=torch.uint8)
    return torch.stack(rows)


def ref_scatter_heads(buf: torch.Tensor, cache: KVCache, ids, first: int, count: int) -> None:
    for i, b in enumerate(ids):
        row, k = buf[i].cpu(), 0
        for t in cache.layers:
            for c in range(cache.num_components):
                view = head_view(t, cache.layout, int(b), c, first, count)
                n = view.numel() * t.element_size()
                view.copy_(row[k:k + n].view(t.dtype).view(view.shape).to(view.device))
                k += n


def ref_head_digests(cache: KVCache, ids, first: int, count: int) -> list:
    """The digest definition (ref_block_digests) over ref_gather_heads's rows."""
    import numpy as np

    out = []
    for row in ref_gather_heads(cache, ids, first, count).numpy():
        words = row.view("<u4").astype(np.uint64)
        p = np.arange(words.size, dtype=np.uint64)
        weights = (p * np.uint64(DIGEST_STEP) + np.uint64(DIGEST_SEED)) | np.uint64(1)
        out.append(int((words * weights).sum(dtype=np.uint64).astype(np.int64)))
    return out


# copy_blocks layout pairs whose heads lie in the same order (flash and flashinfer are both
# token-major), for the head-range tests on CPU and GPU
HEAD_RANGE_PAIRS = [("flash", "flash"), ("flash", "flashinfer"), ("flashinfer", "flash"), ("blocks_hnd", "blocks_hnd"),
                    ("blocks_nhd", "blocks_nhd")]
