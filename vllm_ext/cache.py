"""KVCache: a paged KV cache described the way the copy kernel sees it.

Per layer the cache holds `num_blocks` blocks; each block has one or two components (K and V,
or the single latent of MLA), and each component of a block is one contiguous slice of
`slice_nbytes` bytes. Layouts of one layer tensor:

    flash       [2, num_blocks, block_size, num_kv_heads, head_size]   (vLLM FlashAttention)
    flashinfer  [num_blocks, 2, block_size, num_kv_heads, head_size]
    mla         [num_blocks, block_size, head_size]                     (one component)
    blocks      [num_blocks, num_kv_heads, block_size, C]                (one component)

The block and component dimensions may have any stride (padding between blocks is fine); the
dimensions inside a block half must be dense, in this order. `blocks` is vLLM's per-layer view
(0.32: `[B, H, N, C]` of one allocation in any of its LB**/BL** physical orders; 0.26: the
FlashAttention tensor `[B, H, N, 2 * head_size]`): its dimensions after the first may be dense
in any order, and the whole block of a layer, as it lies in memory, is the one slice.

Head ranges (`KVCache.head_part`): the ops can move KV heads [first, first + count) of each
block instead of all of them (tensor parallelism of unequal sizes). Within a slice the heads
lie in `rows` runs of num_kv_heads heads (`head_nbytes` bytes each): block_size runs for the
token-major layouts (flash, flashinfer, a `blocks` view in N-before-H order), one for a
heads-major `blocks` view (H before N). A head range is then `rows` runs of count heads; `mla`
has no KV heads (one latent per token) and refuses them.
"""

import dataclasses
import math
import os
import socket
import weakref
from typing import Optional, Sequence, Tuple

import torch

from . import _lib

LAYOUTS = ("flash", "flashinfer", "mla", "blocks")
_MAX_ALIGNMENT = 16


def _pow2_alignment(values):
    """Largest power of two (at most 16) dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if g == 0:
        return _MAX_ALIGNMENT
    return min(_MAX_ALIGNMENT, g & -g)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _dtype_from_name(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass(frozen=True)
class HeadPart:
    """Where KV heads [first, first + count) lie in each slice of a cache: `num_rows` runs of
    `row_nbytes` bytes, the first `offset` bytes from the slice's start, `row_stride` bytes apart
    (see the module docstring). `slice_nbytes` is what moves of each slice, and a buffer row of
    the head range holds num_layers x num_components of them (the heads in the cache's order:
    for flash, [block_size, count, head_size] per slice)."""

    first: int
    count: int
    num_rows: int
    row_nbytes: int
    offset: int
    row_stride: int
    head_nbytes: int  # bytes of one head in one run

    @property
    def slice_nbytes(self) -> int:
        return self.num_rows * self.row_nbytes

    @property
    def adjacent(self) -> bool:
        """The runs touch (every head of the cache, or one run): one contiguous range."""
        return self.num_rows == 1 or self.row_stride == self.row_nbytes


@dataclasses.dataclass(frozen=True)
class IpcCacheHandle:
    """What a peer process needs to map a CUDA KVCache (picklable, a few hundred bytes + 64 per
    allocation). Made by KVCache.export_ipc(), used by KVCache.import_ipc()."""

    layout: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_stride: int
    component_stride: int
    allocations: Tuple[Tuple[bytes, int], ...]  # (64-byte handle, allocation size)
    layer_offsets: Tuple[Tuple[int, int], ...]  # per layer: (allocation index, byte offset)
    pci_bus_id: str
    host: str
    pid: int
    head_stride: int = 0  # KVCache.head_stride (0: none, as for mla)


class KVCache:
    """A paged KV cache: per-layer tensors (or, for an imported peer cache, raw addresses) plus
    the strides the copy kernel needs. Construct with `from_layers`, `allocate` or
    `import_ipc`; the constructor itself is internal."""

    def __init__(self, *, layout, num_layers, num_blocks, block_size, num_kv_heads, head_size,
                 dtype, device, layer_addresses, block_stride, component_stride, layers=None,
                 pinned=False, ipc_mappings=None, head_stride=None):
        self.layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = layers
        self.pinned = pinned
        self.num_components = _num_components(layout)
        self.slice_nbytes = block_size * num_kv_heads * head_size * dtype.itemsize
        self.block_nbytes = num_layers * self.num_components * self.slice_nbytes
        self.block_stride = block_stride
        self.component_stride = component_stride
        self.layer_addresses = tuple(int(a) for a in layer_addresses)
        self.alignment = _pow2_alignment(
            [*self.layer_addresses, block_stride, component_stride, self.slice_nbytes])
        # Bytes from one KV head to the next inside a slice (None: unknown, or no heads (mla)).
        if layout in ("flash", "flashinfer"):
            head_stride = head_size * dtype.itemsize
        elif num_kv_heads == 1 and layout == "blocks":
            head_stride = self.slice_nbytes
        self.head_stride = None if layout == "mla" else head_stride
        self._ipc_mappings = ipc_mappings  # [(base, device)] for an imported cache
        self._tables = {}
        self._extents = None  # the layers' byte ranges, computed on first use (never change)
        if self.device.type == "cuda":
            self.layer_table(self.device)  # upload now, so a later graph capture needs none
        self._finalizer = None
        if ipc_mappings:  # an imported cache unmaps when dropped, if close() was not called
            self._finalizer = weakref.finalize(self, _close_mappings, list(ipc_mappings))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_layers(cls, layers: Sequence[torch.Tensor], layout: str = "flash") -> "KVCache":
        """Wraps existing per-layer tensors (no copy). All layers must share dtype, device,
        shape and strides."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
        if isinstance(layers, torch.Tensor) or not isinstance(layers, (list, tuple)):
            raise TypeError(f"layers: expected a list or tuple of torch.Tensor, got {type(layers).__name__}")
        if len(layers) == 0:
            raise ValueError("layers: empty; a cache needs at least one layer")
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layers[{i}]: expected torch.Tensor, got {type(t).__name__}")
        first = layers[0]
        for i, t in enumerate(layers[1:], start=1):
            for attr in ("dtype", "device", "shape"):
                if getattr(t, attr) != getattr(first, attr):
                    raise ValueError(f"layers[{i}]: {attr} {getattr(t, attr)} differs from "
                                     f"layers[0]'s {getattr(first, attr)}")
            if t.stride() != first.stride():
                raise ValueError(f"layers[{i}]: strides {t.stride()} differ from layers[0]'s "
                                 f"{first.stride()}")
        if first.is_sparse or first.layout != torch.strided:
            raise TypeError("layers: sparse tensors are not supported")
        if first.device.type not in ("cpu", "cuda"):
            raise ValueError(f"layers: device {first.device} is not supported (cpu or cuda)")
        geometry = _layer_geometry(first, layout)
        num_blocks, block_size, num_kv_heads, head_size, block_dim, comp_dim = geometry
        if layout == "blocks":
            _check_dense_block(layers)
        else:
            inner = first.shape[-3:] if layout != "mla" else first.shape[-2:]
            _check_dense_inner(layers, inner, layout)
        item = first.element_size()
        block_stride = first.stride(block_dim) * item
        component_stride = first.stride(comp_dim) * item if comp_dim is not None else 0
        cache = cls(
            layout=layout, num_layers=len(layers), num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=num_kv_heads, head_size=head_size, dtype=first.dtype, device=first.device,
            layer_addresses=[t.data_ptr() for t in layers], block_stride=block_stride,
            component_stride=component_stride, layers=list(layers),
            pinned=_all_pinned(layers),
            head_stride=first.stride(1) * item if layout == "blocks" else None,
        )
        _check_no_overlap(cache)
        return cache

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype = torch.bfloat16, device="cuda",
                 layout: str = "flash", pin_memory: bool = False) -> "KVCache":
        """Allocates an uninitialised cache of `num_layers` layer tensors."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_size", head_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected torch.dtype, got {type(dtype).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
        if layout == "mla" and num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: an mla cache has one latent head, got {num_kv_heads}")
        shape = layer_shape(layout, num_blocks, block_size, num_kv_heads, head_size)
        device = torch.device(device)
        pin = bool(pin_memory) and device.type == "cpu"
        layers = [torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
                  for _ in range(num_layers)]
        return cls.from_layers(layers, layout=layout)

    # ---- description --------------------------------------------------------------------
    def geometry(self) -> dict:
        """What two caches must share to exchange blocks (the layout may differ)."""
        return {
            "num_layers": self.num_layers,
            "num_components": self.num_components,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": _dtype_name(self.dtype),
            "slice_nbytes": self.slice_nbytes,
        }

    def head_part(self, heads, name: str = "heads") -> HeadPart:
        """Where KV heads [first, first + count) lie in each slice, for `heads = (first, count)`
        (None: every head). Raises ValueError or TypeError naming `name` for a range outside the
        cache's num_kv_heads, a count below 1, an `mla` cache (no KV heads), or an imported
        `blocks` cache of several heads whose handle does not say where they lie."""
        return head_part(heads, name, layout=self.layout, num_kv_heads=self.num_kv_heads,
                         slice_nbytes=self.slice_nbytes, head_stride=self.head_stride)

    def buffer_row_nbytes(self, heads=None) -> int:
        """Bytes of one buffer row (one block) of gather_blocks / scatter_blocks with `heads`
        (first, count); None: every head, `block_nbytes`."""
        if heads is None:
            return self.block_nbytes
        return self.num_layers * self.num_components * self.head_part(heads).slice_nbytes

    def __repr__(self):
        return (f"KVCache(layout={self.layout!r}, num_layers={self.num_layers}, "
                f"num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"dtype={self.dtype}, device={self.device}, block_nbytes={self.block_nbytes})")

    def layout_key(self) -> tuple:
        """Where every slice lives: equal keys mean the same memory described the same way."""
        return (self.layer_addresses, self.block_stride, self.component_stride, self.slice_nbytes)

    def extents(self) -> list:
        """Sorted [start, end) byte ranges of the layers (address-space footprint)."""
        return list(self._extents_sorted())

    def _extents_sorted(self) -> tuple:
        """extents() as a tuple, computed once (ops checks overlap on every copy)."""
        if self._extents is None:
            span = ((self.num_blocks - 1) * self.block_stride
                    + (self.num_components - 1) * self.component_stride + self.slice_nbytes)
            self._extents = tuple(sorted((a, a + span) for a in self.layer_addresses))
        return self._extents

    def layer_table(self, device: torch.device) -> Optional[torch.Tensor]:
        """The per-layer base addresses as an int64 tensor on `device` (where the kernel
        runs), uploaded on first use per device and cached (see prepare)."""
        key = (device.type, device.index)
        table = self._tables.get(key)
        if table is None:
            table = torch.tensor(self.layer_addresses, dtype=torch.int64)
            if device.type == "cuda":
                if _lib.stream_is_capturing(torch.cuda.current_stream(device).cuda_stream):
                    raise ValueError(
                        f"cache: its pointer table for {device} is uploaded on first use, which a CUDA graph "
                        f"capture cannot do; call cache.prepare('{device}') (or run the op once) before capturing")
                table = table.to(device)
            self._tables[key] = table
        return table

    def prepare(self, *devices) -> "KVCache":
        """Uploads the pointer table for each GPU a kernel using this cache will run on (the
        cache's own GPU is done at construction; a peer copy runs on the destination's GPU,
        a pinned host cache's copies on the GPU of the other side). Needed before capturing
        such calls in a CUDA graph."""
        for device in devices:
            device = torch.device(device)
            if device.type != "cuda" or device.index is None:
                raise ValueError(f"devices: expected CUDA devices with an index, got {device}")
            self.layer_table(device)
        return self

    # ---- CUDA IPC -----------------------------------------------------------------------
    def export_ipc(self) -> IpcCacheHandle:
        """Handles another process on this host uses to map this cache (see import_ipc).
        The cache must stay alive while peers use the mapping."""
        if self.device.type != "cuda":
            raise ValueError(f"export_ipc: the cache is on {self.device}; only CUDA caches can "
                             "be shared through CUDA IPC")
        if self._ipc_mappings is not None:
            raise ValueError("export_ipc: this cache is itself an imported peer cache")
        _lib.ensure_device(self.device.index)
        allocations, index_of, offsets = [], {}, []
        for address in self.layer_addresses:
            handle, offset, nbytes = _lib.ipc_export(address)
            if handle not in index_of:
                index_of[handle] = len(allocations)
                allocations.append((handle, nbytes))
            offsets.append((index_of[handle], offset))
        return IpcCacheHandle(
            layout=self.layout, num_layers=self.num_layers, num_blocks=self.num_blocks,
            block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            dtype=_dtype_name(self.dtype), block_stride=self.block_stride,
            component_stride=self.component_stride, allocations=tuple(allocations),
            layer_offsets=tuple(offsets), pci_bus_id=_lib.device_pci_bus_id(self.device.index),
            host=socket.gethostname(), pid=os.getpid(), head_stride=self.head_stride or 0,
        )

    @classmethod
    def import_ipc(cls, handle: IpcCacheHandle, device=None) -> "KVCache":
        """Maps a peer process's CUDA cache on `device` (default: the current CUDA device).
        The result has no tensors (`layers` is None); use it as a side of ops.copy_blocks and
        call close() when done."""
        if not isinstance(handle, IpcCacheHandle):
            raise TypeError(f"handle: expected IpcCacheHandle, got {type(handle).__name__}")
        if handle.host != socket.gethostname():
            raise ValueError(f"handle: made on host {handle.host!r}, this is "
                             f"{socket.gethostname()!r}; CUDA IPC works within one host")
        if handle.pid == os.getpid():
            raise ValueError("handle: made by this process; use the cache itself, CUDA cannot "
                             "map its own allocations through IPC")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"device: expected a CUDA device with an index, got {device}")
        if handle.layout not in LAYOUTS:
            raise ValueError(f"handle: layout {handle.layout!r} is not one of {', '.join(LAYOUTS)}")
        dtype = _dtype_from_name(handle.dtype)
        for field in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            if not isinstance(getattr(handle, field), int) or getattr(handle, field) <= 0:
                raise ValueError(f"handle: {field} {getattr(handle, field)!r} is not a positive int")
        for field in ("block_stride", "component_stride"):
            if not isinstance(getattr(handle, field), int) or getattr(handle, field) < 0:
                raise ValueError(f"handle: {field} {getattr(handle, field)!r} is not a non-negative int")
        if not isinstance(handle.head_stride, int) or handle.head_stride < 0:
            raise ValueError(f"handle: head_stride {handle.head_stride!r} is not a non-negative int")
        if len(handle.layer_offsets) != handle.num_layers or handle.num_layers <= 0:
            raise ValueError(f"handle: {len(handle.layer_offsets)} layer offsets for "
                             f"{handle.num_layers} layers")
        num_components = _num_components(handle.layout)
        slice_nbytes = handle.block_size * handle.num_kv_heads * handle.head_size * dtype.itemsize
        extent = ((handle.num_blocks - 1) * handle.block_stride
                  + (num_components - 1) * handle.component_stride + slice_nbytes)
        for layer, (alloc, offset) in enumerate(handle.layer_offsets):
            if not 0 <= alloc < len(handle.allocations):
                raise ValueError(f"handle: layer {layer} names allocation {alloc} of "
                                 f"{len(handle.allocations)}")
            nbytes = handle.allocations[alloc][1]
            if offset < 0 or offset + extent > nbytes:
                raise ValueError(f"handle: layer {layer} spans bytes [{offset}, {offset + extent}) "
                                 f"of an allocation of {nbytes} bytes")
        _lib.ensure_device(device.index)
        mappings = []
        try:
            for raw, _ in handle.allocations:
                mappings.append((_lib.ipc_import(raw, device.index), device.index))
            addresses = [mappings[alloc][0] + offset for alloc, offset in handle.layer_offsets]
            cache = cls(
                layout=handle.layout, num_layers=handle.num_layers, num_blocks=handle.num_blocks,
                block_size=handle.block_size, num_kv_heads=handle.num_kv_heads,
                head_size=handle.head_size, dtype=dtype, device=device, layer_addresses=addresses,
                block_stride=handle.block_stride, component_stride=handle.component_stride,
                ipc_mappings=mappings, head_stride=handle.head_stride or None,
            )
            _check_no_overlap(cache)
        except BaseException:
            try:
                _close_mappings(mappings)
            except Exception:  # noqa: BLE001 - the original failure is the one to report
                pass
            raise
        return cache

    def close(self):
        """Unmaps an imported peer cache once the GPU is done with it; a no-op for a cache that
        owns its tensors (they, and the pointer tables captured graphs use, stay valid)."""
        if self._ipc_mappings is None:
            return
        mappings, self._ipc_mappings = self._ipc_mappings, None
        if self._finalizer is not None:
            self._finalizer.detach()
        devices = {device for _, device in mappings}
        for device in devices:  # kernels still reading the peer's memory must finish first
            torch.cuda.synchronize(device)
        self._tables.clear()
        _close_mappings(mappings)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def head_part(heads, name: str, *, layout: str, num_kv_heads: int, slice_nbytes: int,
              head_stride: Optional[int], whose: str = "the cache's") -> HeadPart:
    """KVCache.head_part for a cache known by its numbers (a peer's descriptor): heads
    (first, count) or None (every head); head_stride None or 0: unknown (refused)."""
    given = heads
    if heads is None:
        heads = (0, num_kv_heads)
    if (not isinstance(heads, (tuple, list)) or len(heads) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in heads)):
        raise TypeError(f"{name}: expected (first, count), two ints, got {heads!r}")
    first, count = heads
    if layout == "mla":
        what = "every head" if given is None else f"{tuple(heads)}"
        raise ValueError(f"{name}: a head range ({what}) of an 'mla' cache; it holds one latent per "
                         "token, replicated across TP ranks, and has no KV heads to split")
    if not head_stride:
        raise ValueError(f"{name}: {tuple(heads)} given for a '{layout}' cache of {num_kv_heads} KV heads "
                         "that does not say where its heads lie (an imported view, or a peer of an older "
                         "release); move whole blocks")
    if count < 1:
        raise ValueError(f"{name}: count {count} in {tuple(heads)}; a head range holds at least one head")
    if first < 0 or first + count > num_kv_heads:
        raise ValueError(f"{name}: heads [{first}, {first + count}) of {tuple(heads)} are outside {whose} "
                         f"{num_kv_heads} KV heads [0, {num_kv_heads})")
    run = num_kv_heads * head_stride
    if run <= 0 or slice_nbytes % run:
        raise ValueError(f"{name}: {num_kv_heads} heads of {head_stride} bytes do not tile a slice of "
                         f"{slice_nbytes} bytes")
    return HeadPart(first=first, count=count, num_rows=slice_nbytes // run, row_nbytes=count * head_stride,
                    offset=first * head_stride, row_stride=run, head_nbytes=head_stride)


def _all_pinned(layers) -> bool:
    """Host layers are all pinned or all pageable (a GPU kernel may only touch pinned ones)."""
    if layers[0].device.type != "cpu":
        return False
    pinned = [t.is_pinned() for t in layers]
    if any(pinned) and not all(pinned):
        i = pinned.index(not pinned[0])
        raise ValueError(f"layers[{i}]: {'pinned' if pinned[i] else 'pageable'} host memory, but layers[0] is "
                         f"{'pinned' if pinned[0] else 'pageable'}; pin all layers or none")
    return pinned[0]


def _close_mappings(mappings):
    """Unmaps every mapping, even when one fails; raises the first failure afterwards."""
    first_error = None
    for base, device in mappings:
        try:
            _lib.ipc_close(base, device)
        except Exception as e:  # noqa: BLE001 - keep closing the rest
            first_error = first_error or e
    if first_error is not None:
        raise first_error


def _num_components(layout) -> int:
    return 1 if layout in ("mla", "blocks") else 2


def layer_shape(layout, num_blocks, block_size, num_kv_heads, head_size) -> Tuple[int, ...]:
    if layout == "flash":
        return (2, num_blocks, block_size, num_kv_heads, head_size)
    if layout == "flashinfer":
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
    if layout == "mla":
        return (num_blocks, block_size, head_size)
    if layout == "blocks":
        return (num_blocks, num_kv_heads, block_size, head_size)
    raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")


def _layer_geometry(t: torch.Tensor, layout: str):
    """-> (num_blocks, block_size, num_kv_heads, head_size, block_dim, component_dim)."""
    want = {"flash": "[2, num_blocks, block_size, num_kv_heads, head_size]",
            "flashinfer": "[num_blocks, 2, block_size, num_kv_heads, head_size]",
            "mla": "[num_blocks, block_size, head_size]",
            "blocks": "[num_blocks, num_kv_heads, block_size, C]"}[layout]
    shape = tuple(t.shape)
    if layout == "blocks":
        if len(shape) != 4:
            raise ValueError(f"layers: shape {list(shape)} does not match layout 'blocks' {want}")
        num_blocks, num_kv_heads, block_size, head_size = shape
        result = (num_blocks, block_size, num_kv_heads, head_size, 0, None)
    elif layout == "mla":
        if len(shape) != 3:
            raise ValueError(f"layers: shape {list(shape)} does not match layout 'mla' {want}")
        num_blocks, block_size, head_size = shape
        result = (num_blocks, block_size, 1, head_size, 0, None)
    else:
        comp_dim, block_dim = (0, 1) if layout == "flash" else (1, 0)
        if len(shape) != 5 or shape[comp_dim] != 2:
            raise ValueError(f"layers: shape {list(shape)} does not match layout {layout!r} {want}")
        result = (shape[block_dim], *shape[2:], block_dim, comp_dim)
    if min(shape) <= 0:
        raise ValueError(f"layers: shape {list(shape)} has an empty dimension")
    return result


def _check_dense_inner(layers, inner, layout):
    """The bytes of one block half must be one dense run in [block_size, heads, head_size] order."""
    expected, acc = [], 1
    for size in reversed(inner):
        expected.append(acc)
        acc *= size
    expected = tuple(reversed(expected))
    n = len(inner)
    for i, t in enumerate(layers):
        actual = t.stride()[-n:]
        dense = all(s == e or size == 1 for s, e, size in zip(actual, expected, inner))
        if not dense:
            raise ValueError(
                f"layers[{i}]: not contiguous: strides {t.stride()} for shape {list(t.shape)}; "
                f"layout {layout!r} needs each block's last {n} dims dense (strides "
                f"{expected}); call .contiguous() or allocate with KVCache.allocate")


def _check_dense_block(layers):
    """Layout `blocks`: the dims after the first, ordered by stride, must tile one dense run
    (any order: vLLM's LBHNC and LBNHC views both qualify; LHBNC's heads-outer blocks do not)."""
    for i, t in enumerate(layers):
        dims = sorted((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] != 1)
        expected = 1
        for stride, size in dims:
            if stride != expected:
                raise ValueError(
                    f"layers[{i}]: strides {t.stride()} for shape {list(t.shape)} do not make each "
                    f"block one dense run; layout 'blocks' needs dims 1.. to tile "
                    f"{math.prod(t.shape[1:])} contiguous elements in some order")
            expected *= size


def _check_no_overlap(cache):
    """Chunks of a layer must not share bytes, or a copy into them would be undefined: with the
    two strides sorted, each must clear everything the smaller one spans."""
    dims = [(cache.block_stride, cache.num_blocks)]
    if cache.num_components == 2:
        dims.append((cache.component_stride, 2))
    span = cache.slice_nbytes
    for stride, count in sorted(d for d in dims if d[1] > 1):
        if stride < span:
            raise ValueError(
                f"layers: strides (block {cache.block_stride} bytes, component "
                f"{cache.component_stride} bytes) make blocks or K/V of one layer overlap "
                f"(a slice is {cache.slice_nbytes} bytes)")
        span = stride * (count - 1) + span
