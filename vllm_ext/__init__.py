"""vllm-ext: fast, safe movement of paged KV-cache blocks between caches, buffers and GPUs.

    from vllm_ext import KVCache, ops
    cache = KVCache.allocate(num_layers=32, num_blocks=1024, block_size=16, num_kv_heads=32,
                             head_size=128, dtype=torch.bfloat16, device="cuda:0")
    buf = ops.gather_blocks(cache, [3, 7, 9])          # uint8 [3, cache.block_nbytes]
    ops.scatter_blocks(buf, cache, [10, 11, 12])

Importing the package loads neither torch nor the library: `build_info()` and
`python -m vllm_ext.info` work without torch; KVCache and ops load torch when first used.
"""

from ._version import __version__
from .errors import Error, VllmExtError

__all__ = ["KVCache", "ops", "build_info", "Error", "VllmExtError", "__version__"]


def build_info():
    """The record written when the library was built: version, git revision, CUDA version,
    arch list and target device."""
    from ._lib import build_info as _build_info

    return _build_info()


def __getattr__(name):
    if name == "KVCache":
        from .cache import KVCache

        return KVCache
    if name == "ops":
        import importlib

        return importlib.import_module(".ops", __name__)
    raise AttributeError(f"module 'vllm_ext' has no attribute {name!r}")
