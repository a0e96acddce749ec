"""Block movement between paged KV caches and buffers: one kernel launch per call.

Wire format of a buffer (fixed): a uint8 tensor [n, cache.block_nbytes]; row i holds block
`block_ids[i]`, laid out layer by layer, and within a layer component by component (K then V;
MLA has one), each component's `slice_nbytes` bytes exactly as the cache stores them. So the
first k rows are a self-contained prefix that can be sent before the rest is gathered.

Where the copy runs:
  * both sides on the CPU: the CPU implementation (memcpy, torch.get_num_threads() threads);
  * otherwise a CUDA kernel on the destination's GPU, or on the source's when the destination
    is host memory. A CPU side used with a GPU must be pinned; the kernel reads or writes it
    over PCIe directly. Two GPUs need peer access; the kernel on the destination reads the
    source over NVLink with no staging.
Ids given as a Python list (up to 448 of them) travel inside the kernel launch itself, so such a
call makes no host-to-device copy; longer lists and tensors of ids go through device memory.
CUDA work is enqueued on the current torch stream of the kernel's GPU, with no
synchronisation and no allocation inside, so a call can be captured in a CUDA graph (pass
device tensors of ids then; their host-side checks are skipped during capture, and the kernel
never touches memory outside the given caches and buffer, whatever the ids).

Every argument is checked before any work starts; a bad one raises ValueError or TypeError
naming it, and nothing is written.
"""

import array
from typing import List, Optional, Sequence, Union

import torch

from . import _lib
from ._ids import check_id_tensor, check_id_values, id_values
from .cache import KVCache, _pow2_alignment

BlockIds = Union[Sequence[int], torch.Tensor]

__all__ = ["gather_blocks", "scatter_blocks", "copy_blocks", "block_digests"]


def gather_blocks(cache: KVCache, block_ids: BlockIds, out: Optional[torch.Tensor] = None,
                  *, check_ids: bool = True) -> torch.Tensor:
    """Copies blocks `block_ids` of `cache` into rows of a buffer.

    Args:
        cache: the source KVCache.
        block_ids: n block ids of `cache` (list, CPU or CUDA tensor of ints); repeats allowed.
        out: optional uint8 [m >= n, cache.block_nbytes], row-contiguous: on the cache's GPU,
            pinned host memory (for a CUDA cache), or CPU (for a CPU cache). Default: a new
            tensor on the cache's device.
        check_ids: check device-tensor ids on the host (one synchronisation); skipped
            automatically during CUDA graph capture.
    Returns:
        `out` (or the new buffer); rows n.. are left as they were.
    """
    _check_cache(cache, "cache")
    n = _count(block_ids, "block_ids")
    if out is None:
        device = cache.device if cache.device.type == "cuda" else torch.device("cpu")
        out = torch.empty((n, cache.block_nbytes), dtype=torch.uint8, device=device)
    _check_buffer(out, "out", n, cache)
    kernel_device = _placement(cache.device, cache.pinned, "cache", out.device, _pinned(out), "out")
    ids = _inline_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=False)
    if ids is None:
        ids = _block_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=False,
                         check=check_ids)
    _gather_prechecked(cache, ids, out, kernel_device)
    return out


def scatter_blocks(buf: torch.Tensor, cache: KVCache, block_ids: BlockIds, *,
                   check_ids: bool = True) -> None:
    """Writes rows 0..n-1 of `buf` (the wire format of gather_blocks) into blocks `block_ids`
    of `cache`. Ids must be distinct; `buf` may be on the cache's GPU, pinned host memory (for
    a CUDA cache) or CPU (for a CPU cache)."""
    _check_cache(cache, "cache")
    n = _count(block_ids, "block_ids")
    _check_buffer(buf, "buf", n, cache)
    kernel_device = _placement(buf.device, _pinned(buf), "buf", cache.device, cache.pinned, "cache")
    ids = _inline_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=True)
    if ids is None:
        ids = _block_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=True,
                         check=check_ids)
    _scatter_prechecked(buf, cache, ids, kernel_device)


def copy_blocks(src_cache: KVCache, src_ids: BlockIds, dst_cache: KVCache, dst_ids: BlockIds, *,
                check_ids: bool = True) -> None:
    """Copies block src_ids[i] of `src_cache` to block dst_ids[i] of `dst_cache` for all i.

    The caches must share geometry() (layers, components, block size, heads, head size,
    dtype); their layouts may differ (flash <-> flashinfer). Supported pairs: one GPU; two GPUs
    with peer access (the kernel runs on the destination and reads the source directly);
    pinned host <-> GPU; CPU <-> CPU. dst_ids must be distinct; src_ids may repeat.
    """
    _check_cache(src_cache, "src_cache")
    _check_cache(dst_cache, "dst_cache")
    src_geometry, dst_geometry = src_cache.geometry(), dst_cache.geometry()
    if src_geometry != dst_geometry:
        diff = ", ".join(f"{k} {src_geometry[k]} vs {dst_geometry[k]}"
                         for k in src_geometry if src_geometry[k] != dst_geometry[k])
        raise ValueError(f"src_cache and dst_cache: geometry differs ({diff})")
    n = _count(src_ids, "src_ids")
    if _count(dst_ids, "dst_ids") != n:
        raise ValueError(f"src_ids and dst_ids: lengths differ ({n} vs {_count(dst_ids, 'dst_ids')})")
    kernel_device = _placement(src_cache.device, src_cache.pinned, "src_cache", dst_cache.device,
                               dst_cache.pinned, "dst_cache")
    sids = _inline_ids(src_ids, "src_ids", src_cache.num_blocks, kernel_device, unique=False)
    dids = _inline_ids(dst_ids, "dst_ids", dst_cache.num_blocks, kernel_device, unique=True)
    if sids is None or dids is None:  # both sides inline, or both through device memory
        sids = _block_ids(src_ids, "src_ids", src_cache.num_blocks, kernel_device, unique=False,
                          check=check_ids)
        dids = _block_ids(dst_ids, "dst_ids", dst_cache.num_blocks, kernel_device, unique=True,
                          check=check_ids)
    if n and _share_memory(src_cache, dst_cache):
        _check_same_layout(src_cache, dst_cache)
        _check_disjoint(sids, dids, check_ids)
    _copy_prechecked(src_cache, sids, dst_cache, dids, kernel_device)


def block_digests(cache: KVCache, block_ids: BlockIds) -> List[int]:
    """One 64-bit digest per block of `cache` over every byte of it, as signed int64 values: a
    weighted sum of the 32-bit words of the block's row in the wire format (the definition is
    in csrc/vllm_ext.h), so it does not depend on the cache's layout, and the CPU and CUDA
    implementations agree bit for bit. It reads each byte once.

    On a GPU the work goes to the cache's GPU's current stream (so it follows what was queued
    there, e.g. the forward that wrote the blocks) and the call waits for that stream once, for
    the digests. Ids may repeat; the cache's slices must be whole 32-bit words.
    """
    _check_cache(cache, "cache")
    values = id_values(block_ids, "block_ids")
    check_id_values(values, "block_ids", cache.num_blocks, unique=False)
    if cache.alignment < 4:
        raise ValueError(f"cache: block digests read 32-bit words; this cache's addresses, strides or slices "
                         f"({cache.slice_nbytes} bytes) are only {cache.alignment}-byte aligned")
    if not values:
        return []
    device = cache.device if cache.device.type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        _lib.ensure_device(device.index)
        if _capturing(device):
            raise ValueError("block_digests: not during a CUDA graph capture (it waits for the digests; "
                             "a graph would replay only the kernel)")
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    _digests_prechecked(cache, array.array("q", values), out, device)
    return out.tolist()


def _digests_prechecked(cache: KVCache, ids: "array.array", out: torch.Tensor, device: torch.device) -> None:
    """The digests of checked host ids into `out` (int64 [len(ids)] on `device`, where the cache
    is); on a GPU only enqueued on the current stream (benchmarks time this)."""
    side = _cache_side(cache, None, device)
    if device.type == "cpu":
        _lib.block_digests_cpu(side, _address(ids), len(ids), cache.num_layers, cache.num_components,
                               cache.slice_nbytes, out.data_ptr(), torch.get_num_threads())
    else:
        _lib.block_digests_cuda(side, _address(ids), len(ids), cache.num_layers, cache.num_components,
                                cache.slice_nbytes, cache.alignment, out.data_ptr(), device.index,
                                _current_raw_stream(device.index))


# ---- the launches, after the checks --------------------------------------------------------------
# The public ops above check everything, then call these. The migration backends call them
# directly: they check a pair's caches once (geometry, placement, disjoint memory) and each
# pull's ids on the host. Ids (`Ids`) are either contiguous int64 tensors on `device`, where the
# copy runs, or host int64 arrays (array.array "q", at most _lib.MAX_INLINE_IDS, CUDA only)
# that the launch carries in the kernel's parameters. The launch goes to the device's current
# stream with no allocation. As for every launch, the kernel skips ids outside a cache and never
# touches other memory. `max_ctas` caps the grid (0 = no cap).
Ids = Union[torch.Tensor, "array.array"]


def _copy_prechecked(src_cache: KVCache, src_ids: Ids, dst_cache: KVCache, dst_ids: Ids,
                     device: torch.device) -> None:
    _launch(_cache_side(src_cache, src_ids, device), _cache_side(dst_cache, dst_ids, device),
            src_ids, dst_ids, src_cache, min(src_cache.alignment, dst_cache.alignment), device)


def _copy_inline(src: _lib.Side, dst: _lib.Side, src_ids: Optional[int], dst_ids: Optional[int], n: int,
                 cache: KVCache, alignment: int, device: torch.device, max_ctas: int = 0) -> None:
    """The launch with host ids carried by the kernel's parameters (no upload): the sides come
    from _cache_side(cache, None, device) / _buffer_side and were checked once; src_ids /
    dst_ids are addresses of host int64 arrays of n ids, or None for rows 0..n-1."""
    if n:
        _lib.copy_blocks_cuda_inline(src, dst, src_ids, dst_ids, n, cache.num_layers, cache.num_components,
                                     cache.slice_nbytes, alignment, device.index,
                                     _current_raw_stream(device.index), max_ctas)


def _gather_prechecked(cache: KVCache, ids: Ids, out: torch.Tensor, device: torch.device,
                       max_ctas: int = 0) -> None:
    _launch(_cache_side(cache, ids, device), _buffer_side(out, cache), ids, None, cache,
            min(cache.alignment, _buffer_alignment(out, cache)), device, max_ctas)


def _scatter_prechecked(buf: torch.Tensor, cache: KVCache, ids: Ids, device: torch.device,
                        max_ctas: int = 0) -> None:
    _launch(_buffer_side(buf, cache), _cache_side(cache, ids, device), None, ids, cache,
            min(cache.alignment, _buffer_alignment(buf, cache)), device, max_ctas)


def _launch(src: _lib.Side, dst: _lib.Side, src_ids: Optional[Ids], dst_ids: Optional[Ids],
            cache: KVCache, alignment: int, device: torch.device, max_ctas: int = 0) -> None:
    """One copy between two sides built by _cache_side/_buffer_side with these ids (None: the
    rows of a buffer). Host arrays of ids go inline; tensors are already in the sides."""
    n = len(src_ids if src_ids is not None else dst_ids)
    if isinstance(src_ids, array.array) or isinstance(dst_ids, array.array):
        _copy_inline(src, dst, _address(src_ids), _address(dst_ids), n, cache, alignment, device,
                     max_ctas)
    else:
        _run(src, dst, n, cache, alignment, device, max_ctas)


# ---- validation ------------------------------------------------------------------------------
def _check_cache(cache, name):
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name}: expected vllm_ext.KVCache, got {type(cache).__name__}")
    if cache.device.type == "cuda" and cache.layers is None and cache._ipc_mappings is None:
        raise ValueError(f"{name}: this imported peer cache was closed")


def _count(block_ids, name):
    if isinstance(block_ids, torch.Tensor):
        check_id_tensor(block_ids, name)
        return block_ids.shape[0]
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise TypeError(f"{name}: expected a list or 1-D tensor of ints, got {type(block_ids).__name__}")
    return len(block_ids)


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_pinned()


def _check_buffer(buf, name, n, cache):
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name}: dtype {buf.dtype}, expected torch.uint8 (the wire format is bytes)")
    if buf.dim() != 2 or buf.shape[1] != cache.block_nbytes or buf.shape[0] < n:
        raise ValueError(f"{name}: shape {list(buf.shape)}, expected [>= {n}, "
                         f"{cache.block_nbytes}] ({n} blocks of {cache.block_nbytes} bytes)")
    rows_apart = buf.shape[0] <= 1 or buf.stride(0) == cache.block_nbytes
    if not rows_apart or buf.stride(1) != 1:
        raise ValueError(f"{name}: not contiguous (strides {buf.stride()}); rows must be "
                         f"{cache.block_nbytes} bytes apart")
    if buf.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {buf.device} is not supported (cpu or cuda)")


def _placement(src_device, src_pinned, src_name, dst_device, dst_pinned, dst_name) -> torch.device:
    """Where the copy runs: the CPU, or the GPU of the destination (else of the source)."""
    if src_device.type == "cpu" and dst_device.type == "cpu":
        return torch.device("cpu")
    for device, pinned, name in ((src_device, src_pinned, src_name), (dst_device, dst_pinned, dst_name)):
        if device.type == "cpu" and not pinned:
            raise ValueError(f"{name}: CPU memory used with a CUDA tensor must be pinned "
                             "(tensor.pin_memory(), or KVCache.allocate(..., pin_memory=True))")
    kernel = dst_device if dst_device.type == "cuda" else src_device
    _lib.ensure_device(kernel.index)
    if src_device.type == "cuda" and dst_device.type == "cuda" and src_device != dst_device:
        _lib.ensure_device(src_device.index)
        _lib.enable_peer_access(dst_device.index, src_device.index)
    return kernel


def _capturing(device):
    """Is the stream the kernel will run on (the current stream of `device`) capturing?"""
    return device.type == "cuda" and _lib.stream_is_capturing(_current_raw_stream(device.index))


def _block_ids(block_ids, name, num_blocks, device, *, unique, check):
    """Validated ids as a contiguous int64 tensor on `device` (where the copy runs)."""
    if isinstance(block_ids, torch.Tensor):
        check_id_tensor(block_ids, name)
        ids = block_ids
        if ids.device.type == "cpu":
            if _capturing(device):
                raise ValueError(f"{name}: pass a CUDA tensor of ids while capturing a CUDA graph "
                                 "(a CPU tensor needs a host-to-device copy)")
            _check_id_values(ids, name, num_blocks, unique)
        elif check and not _capturing(device):  # unchecked device ids need no capture query
            _check_id_values(ids, name, num_blocks, unique)
        if ids.dtype != torch.int64 or ids.device != device:
            ids = _move_ids(ids, device)
        return ids.contiguous()
    values = id_values(block_ids, name)
    if _capturing(device):
        raise ValueError(f"{name}: pass a CUDA tensor of ids while capturing a CUDA graph "
                         "(a Python list needs a host-to-device copy)")
    check_id_values(values, name, num_blocks, unique)
    ids = torch.tensor(values, dtype=torch.int64)
    return ids if device.type == "cpu" else _move_ids(ids, device)


def _move_ids(ids, device):
    """int64 ids on `device`. Host ids go through pinned memory without blocking the stream;
    device ids bound for the CPU copy wait for their transfer (the CPU reads them at once)."""
    if device.type == "cpu":
        return ids.to(device=device, dtype=torch.int64)
    if ids.device.type == "cpu":
        ids = ids.to(torch.int64).pin_memory()
    return ids.to(device=device, dtype=torch.int64, non_blocking=True)


def _check_id_values(ids, name, num_blocks, unique):
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":  # host ids: the same checks as for a Python list
        check_id_values(ids.tolist(), name, num_blocks, unique)
        return
    # Device ids: one synchronisation for all checks.
    sorted_ids = ids.to(torch.int64).sort().values
    dups = (sorted_ids[1:] == sorted_ids[:-1]).sum() if unique else sorted_ids.new_zeros(())
    low, high, ndup = torch.stack([sorted_ids[0], sorted_ids[-1], dups]).tolist()
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{name}: id {low if low < 0 else high} out of range for a cache of "
                         f"{num_blocks} blocks")
    if ndup:
        raise ValueError(f"{name}: {ndup} duplicate ids; destination ids must be distinct")


def _share_memory(a: KVCache, b: KVCache) -> bool:
    """Do any layer extents of the two caches overlap (one cache, or two views of it)?"""
    if a is b:
        return True
    spans_a, spans_b = a._extents_sorted(), b._extents_sorted()
    if not spans_a or not spans_b:
        return False
    # Every span of a cache has the same length, so the last one ends last: caches in separate
    # allocations (the usual case) are told apart without the walk.
    if spans_a[-1][1] <= spans_b[0][0] or spans_b[-1][1] <= spans_a[0][0]:
        return False
    i = j = 0
    while i < len(spans_a) and j < len(spans_b):
        (start_a, end_a), (start_b, end_b) = spans_a[i], spans_b[j]
        if start_a < end_b and start_b < end_a:
            return True
        if end_a <= end_b:
            i += 1
        else:
            j += 1
    return False


_OVERLAP = ("src_ids and dst_ids: both caches are the same memory and the id sets overlap; "
            "a block cannot be read and written by one call")


def _check_same_layout(src_cache, dst_cache):
    if src_cache.layout_key() != dst_cache.layout_key():
        raise ValueError("src_cache and dst_cache: two views of the same memory with different layouts; "
                         "copy through a buffer (gather_blocks, then scatter_blocks)")


def _check_disjoint(src_ids: Ids, dst_ids: Ids, check):
    """Within one cache, reading and writing the same block in one launch is a race."""
    if isinstance(src_ids, array.array):
        if set(src_ids) & set(dst_ids):
            raise ValueError(_OVERLAP)
        return
    if src_ids.device.type == "cuda" and (not check or _capturing(src_ids.device)):
        return
    if torch.isin(dst_ids, src_ids).any().item():
        raise ValueError(_OVERLAP)


def _inline_ids(block_ids, name, num_blocks, device, *, unique):
    """Checked host ids for an inline launch (an int64 array), or None when the ids must go
    through device memory: a tensor, a CPU copy, more than MAX_INLINE_IDS ids, or a CUDA graph
    capture (whose refusal of host ids _block_ids reports)."""
    if isinstance(block_ids, torch.Tensor) or device.type != "cuda":
        return None
    values = id_values(block_ids, name)
    if len(values) > _lib.MAX_INLINE_IDS or _capturing(device):
        return None
    check_id_values(values, name, num_blocks, unique)
    return array.array("q", values)


def _address(ids: Optional["array.array"]) -> Optional[int]:
    """The address of a host array of ids; None for no ids (a buffer's rows) or none at all."""
    return ids.buffer_info()[0] if ids is not None and len(ids) else None


# ---- the call into the library -----------------------------------------------------------------
def _cache_side(cache: KVCache, ids: Optional[Ids], device: torch.device) -> _lib.Side:
    """The cache as a side of a copy run on `device`; ids that are not a tensor (None, a host
    array) are passed apart, to an inline launch."""
    tensor = isinstance(ids, torch.Tensor) and ids.numel()
    return _lib.Side(layer_ptrs=cache.layer_table(device).data_ptr(), base=0, layer_stride=0,
                     block_stride=cache.block_stride, component_stride=cache.component_stride,
                     num_blocks=cache.num_blocks, block_ids=ids.data_ptr() if tensor else None)


def _buffer_side(buf: torch.Tensor, cache: KVCache) -> _lib.Side:
    slice_nbytes = cache.slice_nbytes
    return _lib.Side(layer_ptrs=None, base=buf.data_ptr(),
                     layer_stride=cache.num_components * slice_nbytes, block_stride=cache.block_nbytes,
                     component_stride=slice_nbytes, num_blocks=buf.shape[0], block_ids=None)


def _buffer_alignment(buf, cache):
    return _pow2_alignment([buf.data_ptr(), cache.slice_nbytes])


try:  # the raw handle without building a torch.cuda.Stream object: a few us less per call
    _raw_stream = torch._C._cuda_getCurrentRawStream

    def _current_raw_stream(index):
        return _raw_stream(index)
except AttributeError:  # pragma: no cover - older or CPU-only torch
    def _current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _run(src: _lib.Side, dst: _lib.Side, n: int, cache: KVCache, alignment: int,
         device: torch.device, max_ctas: int = 0) -> None:
    if n == 0:
        return
    if device.type == "cpu":
        _lib.copy_blocks_cpu(src, dst, n, cache.num_layers, cache.num_components,
                             cache.slice_nbytes, torch.get_num_threads())
        return
    stream = _current_raw_stream(device.index)
    _lib.copy_blocks_cuda(src, dst, n, cache.num_layers, cache.num_components, cache.slice_nbytes,
                          alignment, device.index, stream, max_ctas)
