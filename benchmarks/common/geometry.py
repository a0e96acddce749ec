"""The geometry every benchmark measures, and caches of it filled with random bytes.

Llumnix's CI geometry (Qwen-7B under vLLM): 32 layers, 32 KV heads, head size 128, block size
16, bf16, flash layout; one block over all layers and K/V is 8 MiB. The tiny geometry (4 KiB
blocks) measures a pull's control cost: moving its bytes is free.
"""

import torch

GEOMETRY = {"num_layers": 32, "block_size": 16, "num_kv_heads": 32, "head_size": 128}
DTYPE = torch.bfloat16
BLOCK_NBYTES = 8 << 20
TINY_GEOMETRY = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_size": 64}  # 4 KiB
TINY_BLOCKS = 16
MIB = 1 << 20
GIB = 1 << 30


def make_cache(device, num_blocks, seed, geometry=GEOMETRY):
    """A flash-layout cache of `geometry` on `device`, random bytes, written before it returns
    (a peer may read it directly: ipc)."""
    from vllm_ext import KVCache

    from .runner import sync

    cache = KVCache.allocate(num_blocks=num_blocks, dtype=DTYPE, device=device, layout="flash",
                             **geometry)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        layer.view(torch.int16).random_(generator=g)
    sync(torch.device(device))
    return cache


def make_tiny_cache(device, seed):
    """The control-cost cache: TINY_BLOCKS blocks of 4 KiB, random bytes."""
    return make_cache(device, TINY_BLOCKS, seed, TINY_GEOMETRY)


def row_checksums(rows):
    """Per-row int64 checksums of a uint8 [n, block_nbytes] tensor (any device)."""
    v = rows.view(torch.int64)
    return torch.stack([v.sum(1), (v ^ (v >> 7)).sum(1)], 1).cpu()
