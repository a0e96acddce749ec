"""The only module that knows about ctypes: loads libvllm_ext.so once, declares its C ABI
(csrc/vllm_ext.h) as a table, and sends every return code through one check."""

import array
import ctypes
import functools
import json
import os
import threading
from pathlib import Path

from .errors import VllmExtError

_DIR = Path(__file__).resolve().parent
# VLLM_EXT_LIBRARY loads another build of the library (tests use it for arch checks).
LIBRARY_PATH = Path(os.environ.get("VLLM_EXT_LIBRARY") or _DIR / "libvllm_ext.so")
BUILD_INFO_PATH = _DIR / "_build_info.json"
ABI_VERSION = 10
IPC_HANDLE_BYTES = 64

# vllm_ext_status
OK, ERR_INVALID_ARGUMENT, ERR_NO_CUDA, ERR_CUDA, ERR_NO_KERNEL_IMAGE, ERR_TRANSFER = range(6)


class Side(ctypes.Structure):
    """vllm_ext_side: one side of a block copy (see csrc/vllm_ext.h). slice_offset and row_stride
    (0 unless given) place a part of each slice (a head range) that moves in num_rows rows."""

    _fields_ = [
        ("layer_ptrs", ctypes.c_void_p),
        ("base", ctypes.c_uint64),
        ("layer_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("component_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_ids", ctypes.c_void_p),
        ("slice_offset", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
    ]


MAX_INLINE_IDS = 448  # VLLM_EXT_MAX_INLINE_IDS: ids one inline launch carries
STAGE_SEND, STAGE_RECV = 0, 1
MAX_LANES = 8  # VLLM_EXT_MAX_LANES


class Staging(ctypes.Structure):
    """vllm_ext_staging: one lane of a staged pull (its slots, streams, events, communicator
    and transfer function)."""

    _fields_ = [
        ("direction", ctypes.c_int32),
        ("max_ctas", ctypes.c_int32),
        ("slots", ctypes.c_uint64 * 2),
        ("slot_blocks", ctypes.c_int64),
        ("copy_stream", ctypes.c_void_p),
        ("comm_stream", ctypes.c_void_p),
        ("copied", ctypes.c_void_p * 2),
        ("moved", ctypes.c_void_p * 2),
        ("tail", ctypes.c_void_p),
        ("transfer", ctypes.c_void_p),
        ("comm", ctypes.c_void_p),
        ("peer", ctypes.c_int32),
        ("datatype", ctypes.c_int32),
    ]


class PullHeads(ctypes.Structure):
    """vllm_ext_pull_heads: where a pull server's cache keeps its KV heads (head-range requests)."""

    _fields_ = [
        ("num_kv_heads", ctypes.c_int32),
        ("whole_blocks", ctypes.c_int32),
        ("head_stride", ctypes.c_int64),
    ]


# The pull server's limits per request (its wire format is migration/protocol.py's) and ends.
PULL_MAX_CHUNKS = 256
PULL_MAX_REQUEST_IDS = PULL_MAX_CHUNKS * MAX_INLINE_IDS
SERVER_PEER_CLOSED, SERVER_STOPPED, SERVER_FAILED, SERVER_DEADLINE = range(4)

_i32, _i64, _u64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
_side_p, _i32_p, _u64_p = ctypes.POINTER(Side), ctypes.POINTER(_i32), ctypes.POINTER(_u64)
_staging_p = ctypes.POINTER(Staging)
_handle = ctypes.c_uint8 * IPC_HANDLE_BYTES

# name: (restype, argtypes). The C prototype of each row is in csrc/vllm_ext.h.
_FUNCTIONS = {
    # int vllm_ext_copy_blocks_cuda(const side* src, const side* dst, int64 num_ids,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int64 num_rows,
    #     int32 alignment, int32 device, void* stream, int32 max_ctas)
    "vllm_ext_copy_blocks_cuda": (_i32, [_side_p, _side_p, _i64, _i32, _i32, _i64, _i64, _i32, _i32, _ptr, _i32]),
    # int vllm_ext_copy_blocks_cuda_inline(const side* src, const side* dst,
    #     const int64* src_ids, const int64* dst_ids, int64 num_ids, int32 num_layers,
    #     int32 num_components, int64 slice_nbytes, int64 num_rows, int32 alignment, int32 device,
    #     void* stream, int32 max_ctas)
    "vllm_ext_copy_blocks_cuda_inline": (_i32, [_side_p, _side_p, _ptr, _ptr, _i64, _i32, _i32, _i64, _i64,
                                                _i32, _i32, _ptr, _i32]),
    # int vllm_ext_staged_transfer(const side* cache, const staging* lanes, int32 num_lanes,
    #     const int64* ids, const int64* bounds, int32 first_chunk, int32 num_chunks,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int64 num_rows,
    #     int32 alignment, int32 device, void* after_stream, void* after_event, void* done)
    "vllm_ext_staged_transfer": (_i32, [_side_p, _staging_p, _i32, _ptr, _ptr, _i32, _i32, _i32, _i32, _i64,
                                        _i64, _i32, _i32, _ptr, _ptr, _ptr]),
    # int64 vllm_ext_ramp_bounds(int64 n, int64 slot_blocks, int64* bounds, int64 capacity)
    "vllm_ext_ramp_bounds": (_i64, [_i64, _i64, _ptr, _i64]),
    # int vllm_ext_pull_server_start(int32 fd, const side* cache, const staging* lanes,
    #     int32 num_lanes, int32 num_layers, int32 num_components, int64 slice_nbytes,
    #     int32 alignment, int32 device, void* done_event, const int32* grants,
    #     const pull_heads* heads, pull_server** server)
    "vllm_ext_pull_server_start": (_i32, [_i32, _side_p, _staging_p, _i32, _i32, _i32, _i64, _i32, _i32, _ptr,
                                          _ptr, ctypes.POINTER(PullHeads), ctypes.POINTER(_ptr)]),
    # int vllm_ext_pull_server_test_stall(pull_server* server, const int64* stall)  (tests only)
    "vllm_ext_pull_server_test_stall": (_i32, [_ptr, _ptr]),
    # int vllm_ext_pull_server_stop(pull_server* server)
    "vllm_ext_pull_server_stop": (_i32, [_ptr]),
    # int vllm_ext_pull_server_wait(pull_server* server, int64 timeout_us, int32* ended,
    #     int32* reason, char* message, int32 message_len)
    "vllm_ext_pull_server_wait": (_i32, [_ptr, _i64, _i32_p, _i32_p, ctypes.c_char_p, _i32]),
    # int vllm_ext_pull_server_destroy(pull_server* server)
    "vllm_ext_pull_server_destroy": (_i32, [_ptr]),
    # int vllm_ext_copy_blocks_memcpy(const side* src, const side* dst, int64 num_ids,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int32 device, void* stream)
    "vllm_ext_copy_blocks_memcpy": (_i32, [_side_p, _side_p, _i64, _i32, _i32, _i64, _i32, _ptr]),
    # int vllm_ext_copy_blocks_cpu(const side* src, const side* dst, int64 num_ids,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int64 num_rows,
    #     int32 num_threads)
    "vllm_ext_copy_blocks_cpu": (_i32, [_side_p, _side_p, _i64, _i32, _i32, _i64, _i64, _i32]),
    # int vllm_ext_block_digests_cuda(const side* cache, const int64* ids, int64 num_ids,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int64 num_rows,
    #     int32 alignment, uint64* out, int32 device, void* stream)
    "vllm_ext_block_digests_cuda": (_i32, [_side_p, _ptr, _i64, _i32, _i32, _i64, _i64, _i32, _ptr, _i32, _ptr]),
    # int vllm_ext_block_digests_cpu(const side* cache, const int64* ids, int64 num_ids,
    #     int32 num_layers, int32 num_components, int64 slice_nbytes, int64 num_rows, uint64* out,
    #     int32 num_threads)
    "vllm_ext_block_digests_cpu": (_i32, [_side_p, _ptr, _i64, _i32, _i32, _i64, _i64, _ptr, _i32]),
    # int vllm_ext_check_device(int32 device, int32* major, int32* minor)
    "vllm_ext_check_device": (_i32, [_i32, _i32_p, _i32_p]),
    # int vllm_ext_stream_is_capturing(void* stream, int32* capturing)
    "vllm_ext_stream_is_capturing": (_i32, [_ptr, _i32_p]),
    # int32 vllm_ext_device_count(void)
    "vllm_ext_device_count": (_i32, []),
    # int vllm_ext_enable_peer_access(int32 device, int32 peer_device)
    "vllm_ext_enable_peer_access": (_i32, [_i32, _i32]),
    # int vllm_ext_can_access_peer(int32 device, int32 peer_device, int32* can_access)
    "vllm_ext_can_access_peer": (_i32, [_i32, _i32, _i32_p]),
    # int vllm_ext_device_pci_bus_id(int32 device, char* buf, int32 buf_len)
    "vllm_ext_device_pci_bus_id": (_i32, [_i32, ctypes.c_char_p, _i32]),
    # int vllm_ext_ipc_export(uint64 address, uint8 handle[64], uint64* offset, uint64* nbytes)
    "vllm_ext_ipc_export": (_i32, [_u64, _handle, _u64_p, _u64_p]),
    # int vllm_ext_ipc_import(const uint8 handle[64], int32 device, uint64* mapped_base)
    "vllm_ext_ipc_import": (_i32, [_handle, _i32, _u64_p]),
    # int vllm_ext_ipc_close(uint64 mapped_base, int32 device)
    "vllm_ext_ipc_close": (_i32, [_u64, _i32]),
    # const char* vllm_ext_status_string(int status)
    "vllm_ext_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    # const char* vllm_ext_last_error(void)
    "vllm_ext_last_error": (ctypes.c_char_p, []),
    # int32 vllm_ext_abi_version(void)
    "vllm_ext_abi_version": (_i32, []),
    # int32 vllm_ext_built_with_cuda(void)
    "vllm_ext_built_with_cuda": (_i32, []),
    # const char* vllm_ext_cuda_archs(void)
    "vllm_ext_cuda_archs": (ctypes.c_char_p, []),
}

_load_lock = threading.Lock()


@functools.cache
def lib():
    """The loaded library, with every function of the table declared."""
    with _load_lock:
        if not LIBRARY_PATH.exists():
            raise ImportError(
                f"vllm-ext: {LIBRARY_PATH.name} is missing next to {__file__}; the package was "
                "not built (pip install . or make develop builds it)"
            )
        handle = ctypes.CDLL(str(LIBRARY_PATH), mode=os.RTLD_LOCAL)
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(handle, name)
            fn.restype, fn.argtypes = restype, argtypes
        abi = handle.vllm_ext_abi_version()
        if abi != ABI_VERSION:
            raise ImportError(f"vllm-ext: {LIBRARY_PATH} has ABI {abi}, this package wants {ABI_VERSION}")
        return handle


def check(status, what):
    """Raises VllmExtError with the decoded status and the library's detailed message."""
    if status != OK:
        h = lib()
        name = h.vllm_ext_status_string(status).decode()
        detail = (h.vllm_ext_last_error() or b"").decode()
        raise VllmExtError(f"{what} failed: {name}: {detail}", status)


@functools.cache
def build_info():
    """The build-info record written next to the library at build time."""
    try:
        info = json.loads(BUILD_INFO_PATH.read_text())
    except FileNotFoundError as e:
        raise ImportError(f"vllm-ext: {BUILD_INFO_PATH.name} is missing; the package was not built") from e
    return dict(info)


def built_with_cuda():
    return bool(lib().vllm_ext_built_with_cuda())


def stream_is_capturing(stream):
    """True while `stream` (a raw cudaStream_t of any device) captures a CUDA graph."""
    capturing = _i32(0)
    check(lib().vllm_ext_stream_is_capturing(stream, ctypes.byref(capturing)), "cudaStreamIsCapturing")
    return bool(capturing.value)


def device_count():
    return int(lib().vllm_ext_device_count())


_checked_devices = {}
_checked_lock = threading.Lock()


def ensure_device(device):
    """Raises one readable error when the library has no code for GPU `device`; cached."""
    if device in _checked_devices:  # the hot path: no lock once a device is known good
        return
    with _checked_lock:
        if device in _checked_devices:
            return
        if not built_with_cuda():
            raise ValueError(
                f"vllm-ext was built without CUDA (target device "
                f"{build_info().get('target_device')!r}), so it cannot work on cuda:{device}; "
                "rebuild where nvcc is available or with VLLM_EXT_TARGET_DEVICE=cuda"
            )
        major, minor = _i32(0), _i32(0)
        status = lib().vllm_ext_check_device(device, ctypes.byref(major), ctypes.byref(minor))
        if status == ERR_NO_KERNEL_IMAGE:
            archs = lib().vllm_ext_cuda_archs().decode().split()
            raise VllmExtError(
                f"vllm-ext has no code for cuda:{device}, a GPU of compute capability "
                f"{major.value}.{minor.value} (sm_{major.value}{minor.value}); this build holds "
                f"{' '.join(archs)}. Rebuild with TORCH_CUDA_ARCH_LIST including "
                f"{major.value}.{minor.value}.",
                status,
            )
        check(status, f"checking cuda:{device}")
        _checked_devices[device] = (major.value, minor.value)


_peers_enabled = set()


def enable_peer_access(device, peer_device):
    """Lets kernels on `device` address memory of `peer_device`; raises if the link lacks P2P."""
    key = (device, peer_device)
    if key in _peers_enabled or device == peer_device:
        return
    can = _i32(0)
    check(lib().vllm_ext_can_access_peer(device, peer_device, ctypes.byref(can)), "cudaDeviceCanAccessPeer")
    if not can.value:
        raise ValueError(
            f"cuda:{device} cannot access memory of cuda:{peer_device} (no peer access between "
            "them); stage through a buffer instead (gather_blocks + scatter_blocks)"
        )
    check(lib().vllm_ext_enable_peer_access(device, peer_device), "enabling peer access")
    _peers_enabled.add(key)


def device_pci_bus_id(device):
    buf = ctypes.create_string_buffer(64)
    check(lib().vllm_ext_device_pci_bus_id(device, buf, len(buf)), "cudaDeviceGetPCIBusId")
    return buf.value.decode()


def ipc_export(address):
    """-> (64-byte handle, offset of `address` in its allocation, allocation size)."""
    handle, offset, nbytes = _handle(), _u64(0), _u64(0)
    check(lib().vllm_ext_ipc_export(address, handle, ctypes.byref(offset), ctypes.byref(nbytes)),
          "exporting a CUDA IPC handle")
    return bytes(handle), offset.value, nbytes.value


def ipc_import(handle_bytes, device):
    """Maps an allocation exported by another process on `device`; -> its base address."""
    if not isinstance(handle_bytes, (bytes, bytearray)) or len(handle_bytes) != IPC_HANDLE_BYTES:
        raise ValueError(f"IPC handle must be {IPC_HANDLE_BYTES} bytes")
    base = _u64(0)
    check(lib().vllm_ext_ipc_import(_handle.from_buffer_copy(handle_bytes), device, ctypes.byref(base)),
          "opening a CUDA IPC handle")
    return base.value


def ipc_close(base, device):
    check(lib().vllm_ext_ipc_close(base, device), "closing a CUDA IPC mapping")


def copy_blocks_cuda(src, dst, num_ids, num_layers, num_components, slice_nbytes, alignment, device,
                     stream, max_ctas=0, num_rows=1):
    """num_rows > 1: each slice's slice_nbytes move as that many rows (a head range; the sides'
    slice_offset and row_stride place them)."""
    check(lib().vllm_ext_copy_blocks_cuda(ctypes.byref(src), ctypes.byref(dst), num_ids, num_layers,
                                          num_components, slice_nbytes, num_rows, alignment, device, stream,
                                          max_ctas),
          "vllm_ext_copy_blocks_cuda")


def copy_blocks_cuda_inline(src, dst, src_ids, dst_ids, num_ids, num_layers, num_components, slice_nbytes,
                            alignment, device, stream, max_ctas=0, num_rows=1):
    """src_ids / dst_ids: addresses of [host] int64 arrays of num_ids ids, or None (rows 0..)."""
    check(lib().vllm_ext_copy_blocks_cuda_inline(ctypes.byref(src), ctypes.byref(dst), src_ids, dst_ids, num_ids,
                                                 num_layers, num_components, slice_nbytes, num_rows, alignment,
                                                 device, stream, max_ctas),
          "vllm_ext_copy_blocks_cuda_inline")


def staged_transfer(cache, lanes, ids, bounds, first_chunk, num_chunks, num_layers, num_components,
                    slice_nbytes, alignment, device, after_stream=None, after_event=None, done=None, num_rows=1):
    """lanes: a ctypes array of Staging; ids / bounds: addresses of [host] int64 arrays; the
    streams and events are raw CUDA handles (see vllm_ext_staged_transfer). num_rows > 1: the
    cache side's head range moves in that many rows per slice."""
    check(lib().vllm_ext_staged_transfer(ctypes.byref(cache), lanes, len(lanes), ids, bounds, first_chunk,
                                         num_chunks, num_layers, num_components, slice_nbytes, num_rows, alignment,
                                         device, after_stream, after_event, done),
          "vllm_ext_staged_transfer")


def ramp_bounds(n, slot_blocks):
    """The chunk bounds of a staged pull of n blocks, [0, ..., n] (vllm_ext_ramp_bounds): the
    rule both sides of a pull share."""
    count = lib().vllm_ext_ramp_bounds(n, slot_blocks, None, 0)
    if count < 0:
        raise ValueError(f"ramp_bounds: n {n} and slot_blocks {slot_blocks} (n >= 0, slot_blocks >= 1)")
    bounds = array.array("q", bytes(8 * (count + 1)))
    lib().vllm_ext_ramp_bounds(n, slot_blocks, bounds.buffer_info()[0], count + 1)
    return bounds


class PullServer:
    """A library thread serving the source side of staged pulls on a socket (see
    vllm_ext_pull_server_start in csrc/vllm_ext.h). The owner (one thread) calls wait() until
    the server ends, then destroy(); stop() may come from any thread before destroy()."""

    def __init__(self, fd, cache, lanes, num_layers, num_components, slice_nbytes, alignment, device,
                 done_event, grants=None, heads=None):
        """fd: a socket descriptor the server takes over (closed by destroy, or here on
        failure); cache (Side), lanes (a ctypes array of Staging) and grants (c_int32 * num_blocks,
        or None: every block) are kept alive; heads (PullHeads, copied; None: whole blocks only)
        lets requests name a head range."""
        handle = ctypes.c_void_p()
        self._keep = [cache, lanes, grants]
        self._lock = threading.Lock()
        status = lib().vllm_ext_pull_server_start(fd, ctypes.byref(cache), lanes, len(lanes), num_layers,
                                                  num_components, slice_nbytes, alignment, device, done_event,
                                                  None if grants is None else ctypes.addressof(grants),
                                                  None if heads is None else ctypes.byref(heads),
                                                  ctypes.byref(handle))
        if status != OK:
            os.close(fd)
        check(status, "vllm_ext_pull_server_start")
        self._handle = handle

    def test_stall(self, stall):
        """Tests only: the {chunk, microseconds} array (c_int64 * 2, kept alive) the server
        reads at every request (vllm_ext_pull_server_test_stall)."""
        with self._lock:
            if self._handle is not None:
                self._keep.append(stall)
                check(lib().vllm_ext_pull_server_test_stall(self._handle, ctypes.addressof(stall)),
                      "vllm_ext_pull_server_test_stall")

    def stop(self):
        with self._lock:
            if self._handle is not None:
                lib().vllm_ext_pull_server_stop(self._handle)

    def wait(self, timeout_s):
        """(reason, message) once the server has ended, else None after timeout_s."""
        ended, reason = _i32(0), _i32(0)
        message = ctypes.create_string_buffer(4096)
        check(lib().vllm_ext_pull_server_wait(self._handle, int(timeout_s * 1e6), ctypes.byref(ended),
                                              ctypes.byref(reason), message, len(message)),
              "vllm_ext_pull_server_wait")
        return (reason.value, message.value.decode(errors="replace")) if ended.value else None

    def destroy(self):
        with self._lock:
            if self._handle is not None:
                lib().vllm_ext_pull_server_destroy(self._handle)
                self._handle = None


def copy_blocks_memcpy(src, dst, num_ids, num_layers, num_components, slice_nbytes, device, stream):
    check(lib().vllm_ext_copy_blocks_memcpy(ctypes.byref(src), ctypes.byref(dst), num_ids, num_layers,
                                            num_components, slice_nbytes, device, stream),
          "vllm_ext_copy_blocks_memcpy")


def copy_blocks_cpu(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_threads, num_rows=1):
    check(lib().vllm_ext_copy_blocks_cpu(ctypes.byref(src), ctypes.byref(dst), num_ids, num_layers,
                                         num_components, slice_nbytes, num_rows, num_threads),
          "vllm_ext_copy_blocks_cpu")


def block_digests_cuda(cache, ids, num_ids, num_layers, num_components, slice_nbytes, alignment, out, device,
                       stream, num_rows=1):
    """ids: address of a [host] int64 array; out: address of num_ids uint64 on the device."""
    check(lib().vllm_ext_block_digests_cuda(ctypes.byref(cache), ids, num_ids, num_layers, num_components,
                                            slice_nbytes, num_rows, alignment, out, device, stream),
          "vllm_ext_block_digests_cuda")


def block_digests_cpu(cache, ids, num_ids, num_layers, num_components, slice_nbytes, out, num_threads, num_rows=1):
    """ids: address of a [host] int64 array; out: address of num_ids uint64 in host memory."""
    check(lib().vllm_ext_block_digests_cpu(ctypes.byref(cache), ids, num_ids, num_layers, num_components,
                                           slice_nbytes, num_rows, out, num_threads),
          "vllm_ext_block_digests_cpu")
