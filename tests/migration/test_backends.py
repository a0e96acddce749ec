"""Backend pieces without a transfer: chunk ranges, nccl request segments and ramp bounds,
rayrpc chunk views, GPU backends refusing CPU caches, the harness, a clean exit after gloo,
lazy backend loading, and NCCL set-up with a fake library."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers.migration_harness import Worker, make_cache
from tests.helpers.specs import SMALL_SPEC
from vllm_ext.migration import (
    BACKEND_NAMES,
    MigrationEndpoint,
    MigrationError,
    get_backend_class,
)
from vllm_ext.migration.timing import Deadline

SPEC = SMALL_SPEC


def test_chunk_ranges_cover_the_ids_in_order():
    from vllm_ext.migration.base import chunk_ranges

    for n in range(0, 40):
        for per_chunk in (1, 3, 4, 8):
            ranges = chunk_ranges(n, per_chunk)
            assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(n))
            assert all(0 < hi - lo <= per_chunk for lo, hi in ranges)
            assert all(hi - lo == per_chunk for lo, hi in ranges[:-1])


def test_long_nccl_pulls_split_into_requests_the_pull_server_takes():
    """A pull is sent as requests of at most 128 full slots and 128 launches' worth of ids,
    within the pull server's limits, so no side ever queues more launches than those allow."""
    from vllm_ext import _lib
    from vllm_ext.migration.nccl import request_segments

    for slot_blocks in (1, 2, 3, 4, 7, 64, 448, 449, 1000, 1 << 40):
        step = 128 * min(slot_blocks, _lib.MAX_INLINE_IDS)  # slots, and launches of inline ids
        for n in (0, 1, step - 1, step, step + 1, 3 * step + 5):
            segments = request_segments(n, slot_blocks)
            assert segments == [(lo, min(lo + step, n)) for lo in range(0, n, step)]
            for lo, hi in segments:
                assert len(_lib.ramp_bounds(hi - lo, slot_blocks)) - 1 <= _lib.PULL_MAX_CHUNKS
                assert hi - lo <= _lib.PULL_MAX_REQUEST_IDS
    assert len(request_segments(128 * 4, 4)) == 1  # one request up to 128 slots (4 GiB of 8 MiB blocks)


def test_ramp_bounds_grow_from_one_block_to_a_slot():
    """The staged pull's chunks (the library's rule, which the source's pull server and the
    destination both use): they cover the ids in order, 1, 2, 4, ... blocks up to a slot."""
    from vllm_ext import _lib

    for n in range(0, 70):
        for slot_blocks in (1, 2, 3, 4, 5, 8, 64, 1 << 62):
            bounds = list(_lib.ramp_bounds(n, slot_blocks))
            assert bounds[0] == 0 and bounds[-1] == n
            sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
            assert all(0 < size <= slot_blocks for size in sizes)
            if n:
                assert sizes[0] == 1
                assert all(b == min(2 * a, slot_blocks) for a, b in zip(sizes, sizes[1:-1]))
    assert list(_lib.ramp_bounds(8, 4)) == [0, 1, 3, 7, 8]
    assert len(_lib.ramp_bounds(1024, 4)) - 1 == 258  # 1, 2 and 4 blocks, 254 slots of 4, then 1
    assert list(_lib.ramp_bounds(29, 4)) == [0, 1, 3, 7, 11, 15, 19, 23, 27, 29]
    for n, slot_blocks in ((-1, 4), (4, 0)):
        with pytest.raises(ValueError, match="ramp_bounds"):
            _lib.ramp_bounds(n, slot_blocks)


@pytest.mark.parametrize("contiguous", [True, False])
def test_rayrpc_slice_views_round_trip(contiguous):
    """The host source hands Ray zero-copy views of its chunks; the destination reads them as
    rows (one view when Ray stored them back to back, else one copy): the bytes of gather."""
    np = pytest.importorskip("numpy")
    from vllm_ext import ops
    from vllm_ext.migration.rayrpc import _as_rows, _slice_views

    spec = {"num_layers": 3, "num_blocks": 9, "block_size": 4, "num_kv_heads": 2, "head_size": 8,
            "dtype": "bfloat16", "layout": "flashinfer", "seed": 5}
    cache = make_cache(spec)
    ids = [7, 2, 2, 5]
    views = _slice_views(cache, ids)
    assert len(views) == len(ids) * cache.num_layers * cache.num_components
    if contiguous:  # what Ray's object store returns: the chunks back to back
        store = np.concatenate(views)
        views = np.split(store, len(views))
    rows = _as_rows(views, len(ids), cache)
    assert torch.equal(rows, ops.gather_blocks(cache, ids))
    assert (rows.data_ptr() == views[0].ctypes.data) == contiguous
    with pytest.raises(MigrationError, match="chunks"):
        _as_rows(views[:-1], len(ids), cache)



@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_gpu_backends_refuse_a_cpu_cache(monkeypatch, backend):
    """Even where the backend's libraries load (a GPU host), a CPU cache is refused at
    construction, naming the device, before any server starts."""
    cls = get_backend_class(backend)
    monkeypatch.setattr(cls, "is_available", classmethod(lambda c: (True, "")))
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="cache: on cpu; the .* backend"):
        MigrationEndpoint(make_cache(SPEC), backend=backend)
    # No server thread was started (threads of earlier tests may have ended meanwhile).
    assert set(threading.enumerate()) <= before


def test_harness_drops_late_replies():
    """A reply that arrives after its caller timed out is never taken as a later answer."""
    w = Worker()
    try:
        with pytest.raises(TimeoutError):
            w.call("sleep", 1.5, timeout=0.2)
        assert not w.healthy
        assert w.call("pid", timeout=10) == w.proc.pid  # not the sleep's late "slept"
        assert w.healthy
    finally:
        assert w.stop() == 0


def test_a_process_that_pulled_over_gloo_exits_cleanly_after_close():
    """close() waits for the threads serving its connections, which release the source's gloo
    pairs. Left to the interpreter's exit, gloo's threads aborted the process ("terminate
    called without an active exception", exit code 134) after a clean pull and close."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from tests.helpers.migration_harness import make_cache\n"
            "from vllm_ext.migration import MigrationEndpoint\n"
            f"spec = {SPEC!r}\n"
            "b = MigrationEndpoint(make_cache(dict(spec, seed=2)), backend='gloo', stripes=1)\n"
            "a = MigrationEndpoint(make_cache(spec), backend='gloo', stripes=1)\n"
            "a.pull(b.descriptor(), [1, 5], [1, 2], timeout=30)\n"
            "a.close()\n"
            "b.close()\n"
            "print('closed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-3000:]
    assert "terminate called" not in out.stderr


def test_import_loads_no_backend():
    code = ("import sys, vllm_ext, vllm_ext.migration as m; "
            "bad = [k for k in sys.modules if k == 'ray' or k.startswith('ray.') "
            "or k.startswith('vllm_ext.migration.') and k.rsplit('.', 1)[1] in "
            "('ipc', 'nccl', 'gloo', 'rayrpc', '_nccl_lib')]; "
            "assert not bad, bad; print(m.BACKEND_NAMES)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(BACKEND_NAMES) == {"ipc", "nccl", "gloo", "rayrpc"}


def test_a_set_up_that_completes_after_its_deadline_is_released():
    """nccl's communicator set-up cannot be interrupted: past the deadline the pull gives up
    on it, and when it completes later after all, what it built is released, not leaked."""
    from vllm_ext.migration.nccl import _run_bounded

    released = []
    gate = threading.Event()

    def slow():
        gate.wait(10)
        return "comm"

    start = time.monotonic()
    with pytest.raises(MigrationError, match="set-up: not complete at the deadline of 0.2 s"):
        _run_bounded(slow, Deadline(0.2), "set-up", on_abandoned=released.append)
    assert time.monotonic() - start < 2.0
    assert released == []
    gate.set()
    end = time.monotonic() + 5
    while not released and time.monotonic() < end:
        time.sleep(0.01)
    assert released == ["comm"]
    # In time: the value, and nothing released; a failure: MigrationError with the cause.
    assert _run_bounded(lambda: 7, Deadline(5), "set-up", on_abandoned=released.append) == 7
    def failing():
        raise OSError("boom")

    with pytest.raises(MigrationError, match="set-up: boom") as info:
        _run_bounded(failing, Deadline(5), "set-up")
    assert isinstance(info.value.__cause__, OSError)
    assert released == ["comm"]


class _FakeNccl:
    """The NCCL calls init_ranks makes, recorded; init number `fail_at` (0-based) fails, or
    the group's end when fail_at is "end" (where NCCL reports a failed set-up inside a group)."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at, self.made = [], fail_at, 0

    def ncclGroupStart(self):
        self.calls.append("start")
        return 0

    def ncclGroupEnd(self):
        self.calls.append("end")
        return 2 if self.fail_at == "end" else 0  # 2: ncclSystemError

    def ncclCommInitRank(self, comm_ref, nranks, uid, rank):
        self.made += 1
        self.calls.append(("init", nranks, bytes(bytearray(uid.internal))[:1], rank))
        if self.made - 1 == self.fail_at:
            return 3  # ncclInternalError, and no communicator
        comm_ref._obj.value = 0x1000 + self.made
        return 0

    def ncclCommAbort(self, comm):
        self.calls.append(("abort", comm))
        return 0

    def ncclGetErrorString(self, result):
        return b"internal error"


def _fake_library(fake):
    from vllm_ext.migration import _nccl_lib

    lib = object.__new__(_nccl_lib.NcclLibrary)  # no libnccl needed: the calls are the fake's
    for name in ("ncclGroupStart", "ncclGroupEnd", "ncclCommInitRank", "ncclCommAbort", "ncclGetErrorString"):
        setattr(lib, name, getattr(fake, name))
    return lib, _nccl_lib.NcclError


def test_lane_communicators_are_set_up_in_one_nccl_group_and_a_failure_aborts_them():
    uids = [bytes([i]) * 128 for i in (1, 2, 3)]
    fake = _FakeNccl()
    lib, _ = _fake_library(fake)
    assert lib.init_ranks(2, uids, 1) == [0x1001, 0x1002, 0x1003]
    assert fake.calls == ["start"] + [("init", 2, bytes([i]), 1) for i in (1, 2, 3)] + ["end"]
    # The second fails: the group still ends, the communicator made is aborted, the third is
    # never started, and the error names the call.
    fake = _FakeNccl(fail_at=1)
    lib, error = _fake_library(fake)
    with pytest.raises(error, match="ncclCommInitRank: NCCL error 3: internal error"):
        lib.init_ranks(2, uids, 0)
    assert fake.calls == ["start", ("init", 2, bytes([1]), 0), ("init", 2, bytes([2]), 0), "end",
                          ("abort", 0x1001)]
    # The set-ups fail at the group's end: every communicator is aborted.
    fake = _FakeNccl(fail_at="end")
    lib, error = _fake_library(fake)
    with pytest.raises(error, match=r"ncclGroupEnd \(communicator set-up\): NCCL error 2"):
        lib.init_ranks(2, uids[:2], 0)
    assert fake.calls[-3:] == ["end", ("abort", 0x1001), ("abort", 0x1002)]
    with pytest.raises(ValueError, match="uid: 5 bytes, expected 128"):
        lib.init_ranks(2, [uids[0], b"short"], 0)


