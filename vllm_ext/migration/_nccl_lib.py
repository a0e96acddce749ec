"""The only module that knows NCCL's C API: loads libnccl once (the copy torch already loaded
when there is one) and declares the few functions the nccl backend uses as a table.

Imported by nccl.py only, so `import vllm_ext` / `import vllm_ext.migration` never load NCCL.
"""

import contextlib
import ctypes
import glob
import os
import threading
from typing import List, Optional

from ..errors import Error

NCCL_SO_ENV = "VLLM_EXT_NCCL_SO"

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
NCCL_SUCCESS = 0
NCCL_UINT8 = 1  # ncclDataType_t ncclUint8


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


# name: (restype, argtypes); the C prototype is above each row.
_FUNCTIONS = {
    # ncclResult_t ncclGetVersion(int* version)
    "ncclGetVersion": (ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId)
    "ncclGetUniqueId": (ncclResult_t, [ctypes.POINTER(NcclUniqueId)]),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
    "ncclCommInitRank": (ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, NcclUniqueId,
                                        ctypes.c_int]),
    # ncclResult_t ncclGroupStart(void)
    "ncclGroupStart": (ncclResult_t, []),
    # ncclResult_t ncclGroupEnd(void)
    "ncclGroupEnd": (ncclResult_t, []),
    # ncclResult_t ncclCommAbort(ncclComm_t comm)
    "ncclCommAbort": (ncclResult_t, [ncclComm_t]),
    # const char* ncclGetErrorString(ncclResult_t result)
    "ncclGetErrorString": (ctypes.c_char_p, [ncclResult_t]),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
    #                       int peer, ncclComm_t comm, cudaStream_t stream)
    "ncclSend": (ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ncclComm_t, cudaStream_t]),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream)
    "ncclRecv": (ncclResult_t, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ncclComm_t, cudaStream_t]),
}


class NcclError(Error, RuntimeError):
    """An NCCL call failed."""


class NcclLibrary:
    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)

    def check(self, result: int, what: str) -> None:
        if result != NCCL_SUCCESS:
            msg = self.ncclGetErrorString(result)
            raise NcclError(f"{what}: NCCL error {result}: {msg.decode() if msg else '?'}")

    def address(self, name: str) -> int:
        """The C address of a declared function (ncclSend, ncclRecv): vllm_ext's staged transfer
        calls it without linking NCCL."""
        return ctypes.cast(getattr(self, name), ctypes.c_void_p).value

    def version(self) -> int:
        v = ctypes.c_int()
        self.check(self.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def init_ranks(self, nranks: int, uids: List[bytes], rank: int) -> List[int]:
        """Joins one communicator per uid, all in one NCCL group, so that their set-ups run
        at once; the other ranks join the same uids. Blocking: returns when every rank
        joined every communicator (run it where it can be abandoned). On a failure the
        communicators made so far are aborted."""
        ids = []
        for uid in uids:
            if len(uid) != 128:
                raise ValueError(f"uid: {len(uid)} bytes, expected 128")
            ids.append(NcclUniqueId())
            ctypes.memmove(ids[-1].internal, uid, 128)
        comms: List[int] = []
        try:
            with self.group("communicator set-up"):
                for u in ids:
                    comm = ncclComm_t()
                    result = self.ncclCommInitRank(ctypes.byref(comm), nranks, u, rank)
                    if comm.value:
                        comms.append(comm.value)
                    self.check(result, "ncclCommInitRank")
        except BaseException:
            for comm in comms:
                self.ncclCommAbort(comm)
            raise
        return comms

    @contextlib.contextmanager
    def group(self, what: str):
        """ncclGroupStart ... ncclGroupEnd around the block. When the block raises, the group
        is still ended and the block's exception is the one raised; otherwise a failed
        ncclGroupEnd (where NCCL reports what failed inside the group) raises NcclError."""
        self.check(self.ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        except BaseException:
            self.ncclGroupEnd()
            raise
        self.check(self.ncclGroupEnd(), f"ncclGroupEnd ({what})")

    def abort(self, comm: int) -> None:
        self.check(self.ncclCommAbort(comm), "ncclCommAbort")

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self.check(self.ncclSend(ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclSend")

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self.check(self.ncclRecv(ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclRecv")


_library: Optional[NcclLibrary] = None
_library_lock = threading.Lock()


def _candidates():
    env = os.environ.get(NCCL_SO_ENV)
    if env:
        yield env
        return
    # Already loaded by torch (CUDA builds link it): dlopen by soname returns that copy.
    yield "libnccl.so.2"
    try:
        import nvidia  # the nvidia-nccl-cu* wheel torch depends on

        for base in getattr(nvidia, "__path__", []):
            yield from sorted(glob.glob(os.path.join(base, "nccl", "lib", "libnccl.so*")))
            yield from sorted(glob.glob(os.path.join(base, "cu*", "lib", "libnccl.so*")))
    except ImportError:
        pass
    try:
        import torch

        yield from sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib",
                                                 "libnccl.so*")))
    except ImportError:
        pass


def library() -> NcclLibrary:
    """The loaded NCCL (ImportError, naming every path tried, when there is none)."""
    global _library
    with _library_lock:
        if _library is None:
            tried = []
            for path in _candidates():
                try:
                    _library = NcclLibrary(path)
                    break
                except (OSError, AttributeError) as e:
                    tried.append(f"{path} ({e})")
            else:
                raise ImportError("libnccl not found; set " + NCCL_SO_ENV + " to its path. Tried: "
                                  + "; ".join(tried))
        return _library
