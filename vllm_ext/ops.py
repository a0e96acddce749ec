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

Head ranges (tensor parallelism of unequal sizes): `heads=(first, count)` moves KV heads
[first, first + count) of each block instead of all of them. A buffer then holds only those
heads: rows of `cache.buffer_row_nbytes(heads)` bytes, each slice's heads in the cache's own
order (flash / flashinfer: [block_size, count, head_size]). copy_blocks takes a range per side
(`src_heads`, `dst_heads`), so a decode rank can gather its heads from several prefill ranks
of fewer heads each, or take a slice of one rank's heads. The two caches must then agree on
everything but num_kv_heads, and order heads the same way within a block (KVCache.head_part);
`mla` caches have no KV heads and refuse a range. Without a range the ops move whole blocks on
the unchanged fast path.

Every argument is checked before any work starts; a bad one raises ValueError or TypeError
naming it, and nothing is written.
"""

import array
import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._ids import check_id_tensor, check_id_values, id_values
from .cache import HeadPart, KVCache, _pow2_alignment

Heads = Optional[Tuple[int, int]]

BlockIds = Union[Sequence[int], torch.Tensor]

__all__ = ["gather_blocks", "scatter_blocks", "copy_blocks", "block_digests"]


def gather_blocks(cache: KVCache, block_ids: BlockIds, out: Optional[torch.Tensor] = None,
                  *, heads: Heads = None, check_ids: bool = True) -> torch.Tensor:
    """Copies blocks `block_ids` of `cache` into rows of a buffer.

    Args:
        cache: the source KVCache.
        block_ids: n block ids of `cache` (list, CPU or CUDA tensor of ints); repeats allowed.
        out: optional uint8 [m >= n, cache.buffer_row_nbytes(heads)], row-contiguous: on the
            cache's GPU, pinned host memory (for a CUDA cache), or CPU (for a CPU cache).
            Default: a new tensor on the cache's device.
        heads: (first, count): only KV heads [first, first + count) of each block, so a row
            holds those heads alone (see the module docstring); None: every head
            (cache.block_nbytes per row).
        check_ids: check device-tensor ids on the host (one synchronisation); skipped
            automatically during CUDA graph capture.
    Returns:
        `out` (or the new buffer); rows n.. are left as they were.
    """
    _check_cache(cache, "cache")
    part = _head_part(cache, heads, "heads")
    n = _count(block_ids, "block_ids")
    row_nbytes = cache.buffer_row_nbytes(heads)
    if out is None:
        device = cache.device if cache.device.type == "cuda" else torch.device("cpu")
        out = torch.empty((n, row_nbytes), dtype=torch.uint8, device=device)
    _check_buffer(out, "out", n, cache, row_nbytes)
    kernel_device = _placement(cache.device, cache.pinned, "cache", out.device, _pinned(out), "out")
    ids = _inline_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=False)
    if ids is None:
        ids = _block_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=False,
                         check=check_ids)
    _gather_prechecked(cache, ids, out, kernel_device, part=part)
    return out


def scatter_blocks(buf: torch.Tensor, cache: KVCache, block_ids: BlockIds, *,
                   heads: Heads = None, check_ids: bool = True) -> None:
    """Writes rows 0..n-1 of `buf` (the wire format of gather_blocks) into blocks `block_ids`
    of `cache`. Ids must be distinct; `buf` may be on the cache's GPU, pinned host memory (for
    a CUDA cache) or CPU (for a CPU cache). `heads` = (first, count): the rows hold `count`
    heads per slice (cache.buffer_row_nbytes(heads) bytes), written into KV heads
    [first, first + count) of each block; the block's other heads are left as they were."""
    _check_cache(cache, "cache")
    part = _head_part(cache, heads, "heads")
    n = _count(block_ids, "block_ids")
    _check_buffer(buf, "buf", n, cache, cache.buffer_row_nbytes(heads))
    kernel_device = _placement(buf.device, _pinned(buf), "buf", cache.device, cache.pinned, "cache")
    ids = _inline_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=True)
    if ids is None:
        ids = _block_ids(block_ids, "block_ids", cache.num_blocks, kernel_device, unique=True,
                         check=check_ids)
    _scatter_prechecked(buf, cache, ids, kernel_device, part=part)


def copy_blocks(src_cache: KVCache, src_ids: BlockIds, dst_cache: KVCache, dst_ids: BlockIds, *,
                src_heads: Heads = None, dst_heads: Heads = None, check_ids: bool = True) -> None:
    """Copies block src_ids[i] of `src_cache` to block dst_ids[i] of `dst_cache` for all i.

    The caches must share geometry() (layers, components, block size, heads, head size,
    dtype); their layouts may differ (flash <-> flashinfer). Supported pairs: one GPU; two GPUs
    with peer access (the kernel runs on the destination and reads the source directly);
    pinned host <-> GPU; CPU <-> CPU. dst_ids must be distinct; src_ids may repeat.

    Head ranges: `src_heads` = (a, n) and `dst_heads` = (b, n) copy KV heads [a, a + n) of
    each source block into heads [b, b + n) of the destination block (None: every head of that
    cache); the destination's other heads are left as they were. The caches may then differ in
    num_kv_heads (and only in that), and must order heads the same way within a block.
    """
    _check_cache(src_cache, "src_cache")
    _check_cache(dst_cache, "dst_cache")
    src_geometry, dst_geometry = src_cache.geometry(), dst_cache.geometry()
    ranged = src_heads is not None or dst_heads is not None
    if ranged:  # heads may differ: their count, and so the slice's bytes
        for key in ("num_kv_heads", "slice_nbytes"):
            src_geometry.pop(key)
            dst_geometry.pop(key)
    if src_geometry != dst_geometry:
        diff = ", ".join(f"{k} {src_geometry[k]} vs {dst_geometry[k]}"
                         for k in src_geometry if src_geometry[k] != dst_geometry[k])
        raise ValueError(f"src_cache and dst_cache: geometry differs ({diff})")
    parts = _pair_parts(src_cache, src_heads, dst_cache, dst_heads) if ranged else None
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
    _copy_prechecked(src_cache, sids, dst_cache, dids, kernel_device, parts=parts)


def block_digests(cache: KVCache, block_ids: BlockIds, *, heads: Heads = None) -> List[int]:
    """One 64-bit digest per block of `cache` over every byte of it, as signed int64 values: a
    weighted sum of the 32-bit words of the block's row in the wire format (the definition is
    in csrc/vllm_ext.h), so it does not depend on the cache's layout, and the CPU and CUDA
    implementations agree bit for bit. It reads each byte once.

    On a GPU the work goes to the cache's GPU's current stream (so it follows what was queued
    there, e.g. the forward that wrote the blocks) and the call waits for that stream once, for
    the digests. Ids may repeat; the cache's slices must be whole 32-bit words.

    `heads` = (first, count): the digest of KV heads [first, first + count) of each block alone,
    defined on the block's row of gather_blocks(..., heads=heads); so the same heads digest the
    same in caches of other head counts (a source and a destination of unequal TP).
    """
    _check_cache(cache, "cache")
    part = _head_part(cache, heads, "heads")
    values = id_values(block_ids, "block_ids")
    check_id_values(values, "block_ids", cache.num_blocks, unique=False)
    alignment = cache.alignment if part is None else _part_alignment(cache.alignment, part)
    if alignment < 4:
        raise ValueError(f"cache: block digests read 32-bit words; this cache's addresses, strides or slices "
                         f"({cache.slice_nbytes} bytes"
                         + ("" if part is None else f", heads {heads}: runs of {part.row_nbytes} bytes")
                         + f") are only {alignment}-byte aligned")
    if not values:
        return []
    device = cache.device if cache.device.type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        _lib.ensure_device(device.index)
        if _capturing(device):
            raise ValueError("block_digests: not during a CUDA graph capture (it waits for the digests; "
                             "a graph would replay only the kernel)")
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    _digests_prechecked(cache, array.array("q", values), out, device, part=part)
    return out.tolist()


def _digests_prechecked(cache: KVCache, ids: "array.array", out: torch.Tensor, device: torch.device,
                        part: Optional[HeadPart] = None) -> None:
    """The digests of checked host ids into `out` (int64 [len(ids)] on `device`, where the cache
    is); on a GPU only enqueued on the current stream (benchmarks time this). `part`: a head
    range (cache.head_part), None for whole blocks."""
    rows = _Rows.of(cache, part, None)
    side = _cache_side(cache, None, device, rows.src)
    if device.type == "cpu":
        _lib.block_digests_cpu(side, _address(ids), len(ids), cache.num_layers, cache.num_components,
                               rows.slice_nbytes, out.data_ptr(), torch.get_num_threads(), rows.num_rows)
    else:
        alignment = cache.alignment if part is None else _part_alignment(cache.alignment, part)
        _lib.block_digests_cuda(side, _address(ids), len(ids), cache.num_layers, cache.num_components,
                                rows.slice_nbytes, alignment, out.data_ptr(), device.index,
                                _current_raw_stream(device.index), rows.num_rows)


# ---- the launches, after the checks --------------------------------------------------------------
# The public ops above check everything, then call these. The migration backends call them
# directly: they check a pair's caches once (geometry, placement, disjoint memory) and each
# pull's ids on the host. Ids (`Ids`) are either contiguous int64 tensors on `device`, where the
# copy runs, or host int64 arrays (array.array "q", at most _lib.MAX_INLINE_IDS, CUDA only)
# that the launch carries in the kernel's parameters. The launch goes to the device's current
# stream with no allocation. As for every launch, the kernel skips ids outside a cache and never
# touches other memory. `max_ctas` caps the grid (0 = no cap). `part` / `parts`: head ranges
# (KVCache.head_part; for a copy, the pair _pair_parts made), None for whole blocks.
Ids = Union[torch.Tensor, "array.array"]


@dataclasses.dataclass(frozen=True)
class _Rows:
    """What one launch moves of each slice: slice_nbytes bytes in num_rows rows; src / dst are
    each side's (slice_offset, row_stride), row_stride 0 for adjacent rows (csrc/vllm_ext.h)."""

    slice_nbytes: int
    num_rows: int = 1
    src: Tuple[int, int] = (0, 0)
    dst: Tuple[int, int] = (0, 0)

    @staticmethod
    def of(cache: KVCache, src: Optional[HeadPart], dst: Optional[HeadPart]) -> "_Rows":
        """The launch of head parts on either side (None: a buffer, or every head of `cache`).
        Parts of a pair have the same rows (_pair_parts); where every side's rows touch, the
        launch moves one contiguous run per slice, on the whole-slice kernel."""
        parts = [p for p in (src, dst) if p is not None]
        if not parts:
            return _Rows(cache.slice_nbytes)
        adjacent = all(p.adjacent for p in parts)

        def side(p):
            if p is None:
                return (0, 0)
            return (p.offset, 0 if adjacent or p.adjacent else p.row_stride)

        return _Rows(parts[0].slice_nbytes, 1 if adjacent else parts[0].num_rows, side(src), side(dst))


def _part_alignment(alignment: int, part: HeadPart) -> int:
    """A cache's alignment narrowed to what a head range's offset, runs and stride allow."""
    return _pow2_alignment([alignment, part.offset, part.row_nbytes, part.row_stride])


def _pair_alignment(src_cache: KVCache, dst_cache: KVCache,
                    parts: Optional[Tuple[HeadPart, HeadPart]] = None) -> int:
    """The access width a copy between two caches allows (of head ranges `parts`, if any)."""
    alignment = min(src_cache.alignment, dst_cache.alignment)
    for part in parts or ():
        alignment = _part_alignment(alignment, part)
    return alignment


def _copy_prechecked(src_cache: KVCache, src_ids: Ids, dst_cache: KVCache, dst_ids: Ids,
                     device: torch.device, parts: Optional[Tuple[HeadPart, HeadPart]] = None) -> None:
    src_part, dst_part = parts or (None, None)
    rows = _Rows.of(src_cache, src_part, dst_part)
    alignment = _pair_alignment(src_cache, dst_cache, parts)
    _launch(_cache_side(src_cache, src_ids, device, rows.src), _cache_side(dst_cache, dst_ids, device, rows.dst),
            src_ids, dst_ids, src_cache, alignment, device, rows=rows)


def _copy_inline(src: _lib.Side, dst: _lib.Side, src_ids: Optional[int], dst_ids: Optional[int], n: int,
                 cache: KVCache, alignment: int, device: torch.device, max_ctas: int = 0,
                 rows: Optional[_Rows] = None) -> None:
    """The launch with host ids carried by the kernel's parameters (no upload): the sides come
    from _cache_side(cache, None, device) / _buffer_side and were checked once; src_ids /
    dst_ids are addresses of host int64 arrays of n ids, or None for rows 0..n-1."""
    if n:
        rows = rows or _Rows(cache.slice_nbytes)
        _lib.copy_blocks_cuda_inline(src, dst, src_ids, dst_ids, n, cache.num_layers, cache.num_components,
                                     rows.slice_nbytes, alignment, device.index,
                                     _current_raw_stream(device.index), max_ctas, rows.num_rows)


def _gather_prechecked(cache: KVCache, ids: Ids, out: torch.Tensor, device: torch.device,
                       max_ctas: int = 0, part: Optional[HeadPart] = None) -> None:
    rows = _Rows.of(cache, part, None)
    alignment = cache.alignment if part is None else _part_alignment(cache.alignment, part)
    _launch(_cache_side(cache, ids, device, rows.src), _buffer_side(out, cache, rows.slice_nbytes), ids, None,
            cache, min(alignment, _buffer_alignment(out, cache, rows.slice_nbytes)), device, max_ctas, rows)


def _scatter_prechecked(buf: torch.Tensor, cache: KVCache, ids: Ids, device: torch.device,
                        max_ctas: int = 0, part: Optional[HeadPart] = None) -> None:
    rows = _Rows.of(cache, None, part)
    alignment = cache.alignment if part is None else _part_alignment(cache.alignment, part)
    _launch(_buffer_side(buf, cache, rows.slice_nbytes), _cache_side(cache, ids, device, rows.dst), None, ids,
            cache, min(alignment, _buffer_alignment(buf, cache, rows.slice_nbytes)), device, max_ctas, rows)


def _launch(src: _lib.Side, dst: _lib.Side, src_ids: Optional[Ids], dst_ids: Optional[Ids],
            cache: KVCache, alignment: int, device: torch.device, max_ctas: int = 0,
            rows: Optional[_Rows] = None) -> None:
    """One copy between two sides built by _cache_side/_buffer_side with these ids (None: the
    rows of a buffer). Host arrays of ids go inline; tensors are already in the sides."""
    n = len(src_ids if src_ids is not None else dst_ids)
    if isinstance(src_ids, array.array) or isinstance(dst_ids, array.array):
        _copy_inline(src, dst, _address(src_ids), _address(dst_ids), n, cache, alignment, device,
                     max_ctas, rows)
    else:
        _run(src, dst, n, cache, alignment, device, max_ctas, rows)


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


def _check_buffer(buf, name, n, cache, row_nbytes=None):
    """`row_nbytes`: a row's bytes, cache.buffer_row_nbytes(heads) (None: cache.block_nbytes)."""
    row_nbytes = cache.block_nbytes if row_nbytes is None else row_nbytes
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name}: dtype {buf.dtype}, expected torch.uint8 (the wire format is bytes)")
    if buf.dim() != 2 or buf.shape[1] != row_nbytes or buf.shape[0] < n:
        raise ValueError(f"{name}: shape {list(buf.shape)}, expected [>= {n}, "
                         f"{row_nbytes}] ({n} blocks of {row_nbytes} bytes)")
    rows_apart = buf.shape[0] <= 1 or buf.stride(0) == row_nbytes
    if not rows_apart or buf.stride(1) != 1:
        raise ValueError(f"{name}: not contiguous (strides {buf.stride()}); rows must be "
                         f"{row_nbytes} bytes apart")
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


def _head_part(cache: KVCache, heads: Heads, name: str) -> Optional[HeadPart]:
    """The checked head range of one cache; None for every head (the whole-block path)."""
    return None if heads is None else cache.head_part(heads, name)


def _pair_parts(src_cache: KVCache, src_heads: Heads, dst_cache: KVCache,
                dst_heads: Heads) -> Tuple[HeadPart, HeadPart]:
    """The head ranges of a copy (None: every head of that cache), checked against each other
    (see pair_head_parts)."""
    return pair_head_parts(src_cache.head_part(src_heads, "src_heads"), src_cache.num_kv_heads,
                           dst_cache.head_part(dst_heads, "dst_heads"), dst_cache.num_kv_heads)


def pair_head_parts(sp: HeadPart, src_num_heads: int, dp: HeadPart,
                    dst_num_heads: int) -> Tuple[HeadPart, HeadPart]:
    """Two head ranges that move into each other: the same count, and the heads in the same
    order in both caches (the same runs per slice and bytes per head). A cache of one KV head
    has one order only and takes the other's runs. ValueError naming src_heads / dst_heads or
    the caches otherwise. Returns the parts to launch with (_Rows.of)."""
    def given(p: HeadPart, total: int) -> str:
        return "all" if (p.first, p.count) == (0, total) else f"({p.first}, {p.count})"

    if sp.count != dp.count:
        raise ValueError(f"src_heads and dst_heads: {sp.count} heads ({given(sp, src_num_heads)} of "
                         f"{src_num_heads}) vs {dp.count} ({given(dp, dst_num_heads)} of "
                         f"{dst_num_heads}); a copy moves the same heads on both sides")

    def rerow(p: HeadPart, num_rows: int) -> HeadPart:
        run = p.slice_nbytes // num_rows
        return dataclasses.replace(p, num_rows=num_rows, row_nbytes=run, row_stride=run, head_nbytes=run)

    src_one, dst_one = src_num_heads == 1, dst_num_heads == 1
    if src_one and not dst_one:
        sp = rerow(sp, dp.num_rows)
    elif dst_one and not src_one:
        dp = rerow(dp, sp.num_rows)
    elif not src_one and (sp.num_rows, sp.head_nbytes) != (dp.num_rows, dp.head_nbytes):
        raise ValueError(
            f"src_cache and dst_cache: their KV heads lie differently in a block (src: {sp.num_rows} "
            f"run(s) of heads of {sp.head_nbytes} bytes per slice, dst: {dp.num_rows} of "
            f"{dp.head_nbytes}); a head range needs both in one order (token-major, as flash and "
            f"flashinfer, or heads-major)")
    if sp.slice_nbytes != dp.slice_nbytes:  # equal geometry makes them equal; never reached
        raise ValueError(f"src_heads and dst_heads: {sp.slice_nbytes} vs {dp.slice_nbytes} bytes per slice")
    return sp, dp


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
def _cache_side(cache: KVCache, ids: Optional[Ids], device: torch.device,
                rows: Tuple[int, int] = (0, 0)) -> _lib.Side:
    """The cache as a side of a copy run on `device`; ids that are not a tensor (None, a host
    array) are passed apart, to an inline launch. `rows`: the side's (slice_offset, row_stride)
    of a head range (_Rows)."""
    tensor = isinstance(ids, torch.Tensor) and ids.numel()
    return _lib.Side(layer_ptrs=cache.layer_table(device).data_ptr(), base=0, layer_stride=0,
                     block_stride=cache.block_stride, component_stride=cache.component_stride,
                     num_blocks=cache.num_blocks, block_ids=ids.data_ptr() if tensor else None,
                     slice_offset=rows[0], row_stride=rows[1])


def _buffer_side(buf: torch.Tensor, cache: KVCache, slice_nbytes: Optional[int] = None) -> _lib.Side:
    """A buffer of rows of `cache`'s blocks, slices of `slice_nbytes` (a head range's; None:
    cache.slice_nbytes) one after the other."""
    slice_nbytes = cache.slice_nbytes if slice_nbytes is None else slice_nbytes
    return _lib.Side(layer_ptrs=None, base=buf.data_ptr(),
                     layer_stride=cache.num_components * slice_nbytes,
                     block_stride=cache.num_layers * cache.num_components * slice_nbytes,
                     component_stride=slice_nbytes, num_blocks=buf.shape[0], block_ids=None)


def _buffer_alignment(buf, cache, slice_nbytes=None):
    return _pow2_alignment([buf.data_ptr(), cache.slice_nbytes if slice_nbytes is None else slice_nbytes])


try:  # the raw handle without building a torch.cuda.Stream object: a few us less per call
    _raw_stream = torch._C._cuda_getCurrentRawStream

    def _current_raw_stream(index):
        return _raw_stream(index)
except AttributeError:  # pragma: no cover - older or CPU-only torch
    def _current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _run(src: _lib.Side, dst: _lib.Side, n: int, cache: KVCache, alignment: int,
         device: torch.device, max_ctas: int = 0, rows: Optional[_Rows] = None) -> None:
    if n == 0:
        return
    rows = rows or _Rows(cache.slice_nbytes)
    if device.type == "cpu":
        _lib.copy_blocks_cpu(src, dst, n, cache.num_layers, cache.num_components,
                             rows.slice_nbytes, torch.get_num_threads(), rows.num_rows)
        return
    stream = _current_raw_stream(device.index)
    _lib.copy_blocks_cuda(src, dst, n, cache.num_layers, cache.num_components, rows.slice_nbytes,
                          alignment, device.index, stream, max_ctas, rows.num_rows)
