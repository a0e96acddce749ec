"""KV migration between CUDA caches: nccl between two GPUs (marked multi_gpu; NCCL refuses two ranks
on one GPU), ipc between two processes (marked gpu: on two GPUs where there are two, else both
on one), gloo with pinned staging on one GPU (marked gpu). Same checks as the CPU tests: random geometries,
layouts and ids, both directions, byte-for-byte; a stalled and a killed source; rejections.

    python -m pytest -p timeout --timeout 40 -m "gpu or multi_gpu" tests/test_migration_gpu.py

Every wait inside a test is shorter than that per-test limit, so a failure is reported as
itself; a worker left busy by a failed test is replaced before the next test uses it.
"""

import random
import time

import pytest
import torch

from tests.helpers.migration_harness import RemoteError, Worker, close_quietly, start_workers
from tests.helpers.specs import LAYOUT_PAIRS, random_spec, same_geometry

NUM_CASES = 4
OPTIONS = {
    "ipc": {},
    "nccl": {"chunk_bytes": 256 << 10},  # several chunks per pull: the pipeline runs
    "gloo": {"stripes": 2, "chunk_bytes": 256 << 10},
}
FAIL_OPTIONS = {"ipc": {}, "nccl": {"chunk_bytes": 1}, "gloo": {"stripes": 2, "chunk_bytes": 1}}
PULL_TIMEOUT_S = 15.0  # a pull's own deadline
CALL_TIMEOUT_S = 25.0  # how long the test waits for any worker's answer


def _devices(backend):
    """nccl needs two GPUs; ipc maps another process's memory, on a second GPU when there is one."""
    if backend == "gloo":
        return ("cuda:0", "cuda:0")
    second = "cuda:1" if backend == "nccl" or torch.cuda.device_count() > 1 else "cuda:0"
    return ("cuda:0", second)


@pytest.fixture(scope="module")
def gpu_workers(request):
    """get(devices) -> [worker on devices[0], worker on devices[1], another on devices[1]],
    shared by the module's tests; a group with a busy or dead worker (left by a failed test)
    is replaced, so one failure cannot hand stale answers or endpoints to the next test."""
    cache = {}
    replaced = []

    def get(devices):
        group = cache.get(devices)
        if group is not None and not all(w.healthy for w in group):
            for w in group:
                w.kill()
            replaced.append(devices)
            group = None
        if group is None:
            group = cache[devices] = start_workers(list(devices) + [devices[1]])
        return group

    yield get
    codes = {devices: [w.stop() for w in ws] for devices, ws in cache.items()}
    assert all(c == [0] * len(c) for c in codes.values()), f"worker exit codes {codes}"


def _marks(backend):
    return pytest.mark.multi_gpu if backend == "nccl" else pytest.mark.gpu


BACKENDS = [pytest.param(b, marks=_marks(b)) for b in ("ipc", "nccl", "gloo")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(NUM_CASES))
def test_gpu_pull_both_directions(gpu_workers, backend, case):
    devices = _devices(backend)
    a, b, _ = gpu_workers(devices)
    rng = random.Random(3000 + case)
    layout_a, layout_b = LAYOUT_PAIRS[case % len(LAYOUT_PAIRS)]
    spec_a = dict(random_spec(rng, layout_a, seed=40 + case), device=devices[0])
    spec_b = dict(same_geometry(spec_a, layout_b, 50 + case, rng.choice([23, 64, 100])),
                  device=devices[1])
    name = f"{backend}{case}"
    options = dict(OPTIONS[backend])
    if backend == "nccl":  # 1 to 4 lanes: chunks alternate over an even and an odd count
        options["lanes"] = case + 1
    try:
        desc_a = a.call("endpoint", name, spec_a, backend, options)
        desc_b = b.call("endpoint", name, spec_b, backend, options)
        for dst_w, dst_spec, src_w, src_desc, src_spec in ((a, spec_a, b, desc_b, spec_b),
                                                           (b, spec_b, a, desc_a, spec_a)):
            for _ in range(2):  # the second pull reuses the pair
                n = rng.randint(1, min(dst_spec["num_blocks"], 40))
                src = [rng.randrange(src_spec["num_blocks"]) for _ in range(n)]
                dst = rng.sample(range(dst_spec["num_blocks"]), n)
                others = [i for i in range(dst_spec["num_blocks"]) if i not in set(dst)]
                before = dst_w.call("blocks", name, others)
                all_src = list(range(src_spec["num_blocks"]))
                src_before = src_w.call("blocks", name, all_src)
                stats = dst_w.call("pull", name, src_desc, src, dst, PULL_TIMEOUT_S,
                                   timeout=CALL_TIMEOUT_S)
                assert stats.nbytes == n * src_before.shape[1]
                assert torch.equal(dst_w.call("blocks", name, dst), src_before[src])
                assert torch.equal(dst_w.call("blocks", name, others), before)
                assert torch.equal(src_w.call("blocks", name, all_src), src_before)
    finally:
        close_quietly(a, name)
        close_quietly(b, name)


FAIL_SPEC = {"num_layers": 4, "num_blocks": 64, "block_size": 16, "num_kv_heads": 8,
             "head_size": 128, "dtype": "bfloat16", "layout": "flash", "seed": 5}


@pytest.mark.parametrize("backend", [pytest.param(b, marks=_marks(b)) for b in ("nccl", "gloo")])
@pytest.mark.parametrize("kill", [False, True], ids=["stalled", "killed"])
def test_gpu_dead_or_stalled_source(gpu_workers, backend, kill):
    """The destination raises MigrationError within the deadline, its other blocks are
    untouched, and it keeps pulling from and serving other peers."""
    devices = _devices(backend)
    dst_w, _, healthy = gpu_workers(devices)
    src_w = Worker(devices[1])
    try:
        src_spec = dict(FAIL_SPEC, device=devices[1])
        src_desc = src_w.call("endpoint", "s", src_spec, backend, FAIL_OPTIONS[backend])
        healthy_desc = healthy.call("endpoint", "h", dict(src_spec, seed=6), backend,
                                    FAIL_OPTIONS[backend])
        dst_w.call("endpoint", "d", dict(FAIL_SPEC, seed=7, device=devices[0]), backend,
                   FAIL_OPTIONS[backend])
        before = dst_w.call("blocks", "d", list(range(64)))
        src_before = src_w.call("blocks", "s", list(range(64)))
        src_w.call("stall", "s", 2, 120.0)
        timeout = 6.0
        src, dst = list(range(10)), list(range(10, 20))
        start = time.monotonic()
        dst_w.send("pull", "d", src_desc, src, dst, timeout)
        if kill:
            time.sleep(2.0)
            src_w.kill()
        with pytest.raises(RemoteError) as info:
            dst_w.result(timeout=timeout + 15)
        elapsed = time.monotonic() - start
        assert info.value.type_name == "MigrationError", info.value
        assert info.value.fields["dst_block_ids"] == dst
        assert elapsed < timeout + 3.0, f"MigrationError after {elapsed:.1f} s"
        if not kill:
            assert torch.equal(src_w.call("blocks", "s", list(range(64))), src_before)
        others = list(range(20, 64)) + list(range(10))
        assert torch.equal(dst_w.call("blocks", "d", others), before[others])
        stats = dst_w.call("pull", "d", healthy_desc, [1, 2, 3], [10, 11, 12], PULL_TIMEOUT_S,
                           timeout=CALL_TIMEOUT_S)
        assert stats.num_blocks == 3
        assert torch.equal(dst_w.call("blocks", "d", [10, 11, 12]),
                           healthy.call("blocks", "h", [1, 2, 3]))
        desc_d = dst_w.call("endpoint", "d2", dict(FAIL_SPEC, seed=8, device=devices[0]),
                            backend, FAIL_OPTIONS[backend])
        healthy.call("pull", "h", desc_d, [0, 1], [30, 31], PULL_TIMEOUT_S,
                     timeout=CALL_TIMEOUT_S)
        assert torch.equal(healthy.call("blocks", "h", [30, 31]),
                           dst_w.call("blocks", "d2", [0, 1]))
    finally:
        src_w.kill()  # the stalled (or killed) source's worker is not reused
        close_quietly(dst_w, "d", "d2")
        close_quietly(healthy, "h")


@pytest.mark.multi_gpu
@pytest.mark.parametrize("pause_at", [0, 3])
def test_nccl_pull_paused_midway_lands_intact(gpu_workers, pause_at):
    """The source enqueues a pull in two calls around a pause (chunks before it, then the
    rest with their global chunk index, so the staging slots keep alternating): the blocks
    still land byte for byte."""
    dst_w, src_w, _ = gpu_workers(("cuda:0", "cuda:1"))
    options = {"chunk_bytes": 2 * (256 << 10)}  # FAIL_SPEC blocks are 256 KiB: chunks 1,2,2,2,...
    name = f"pause{pause_at}"
    try:
        desc = src_w.call("endpoint", name, dict(FAIL_SPEC, device="cuda:1"), "nccl", options)
        dst_w.call("endpoint", name, dict(FAIL_SPEC, seed=9, device="cuda:0"), "nccl", options)
        src_w.call("stall", name, pause_at, 0.3)
        rng = random.Random(pause_at)
        src = [rng.randrange(64) for _ in range(11)]
        dst = rng.sample(range(64), 11)
        others = sorted(set(range(64)) - set(dst))
        before = dst_w.call("blocks", name, others)
        stats = dst_w.call("pull", name, desc, src, dst, PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
        assert stats.chunks == 6
        assert torch.equal(dst_w.call("blocks", name, dst), src_w.call("blocks", name, src))
        assert torch.equal(dst_w.call("blocks", name, others), before)
    finally:
        close_quietly(dst_w, name)
        close_quietly(src_w, name)


@pytest.mark.multi_gpu
def test_nccl_source_endpoint_closing_during_a_pull(gpu_workers):
    """A source endpoint closed while its pull server holds a pull (paused before chunk 0):
    the close ends the server at once instead of waiting out the pause, the destination gets a
    MigrationError with its other blocks untouched, and it pulls from a new source endpoint."""
    dst_w, src_w, _ = gpu_workers(("cuda:0", "cuda:1"))
    name = "closing"
    try:
        desc = src_w.call("endpoint", name, dict(FAIL_SPEC, device="cuda:1"), "nccl", {})
        dst_w.call("endpoint", name, dict(FAIL_SPEC, seed=9, device="cuda:0"), "nccl", {})
        dst_w.call("pull", name, desc, [1], [2], PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
        others = [b for b in range(64) if b not in (5, 6)]  # 5 and 6: undefined after the failure
        before = dst_w.call("blocks", name, others)
        src_w.call("stall", name, 0, 60.0)
        dst_w.send("pull", name, desc, [3, 4], [5, 6], 30.0)
        time.sleep(1.0)  # the request is with the paused server
        start = time.monotonic()
        assert src_w.call("close", name, timeout=30) is True
        assert time.monotonic() - start < 10, "the close waited out the pause"
        with pytest.raises(RemoteError) as info:
            dst_w.result(timeout=30)
        assert info.value.type_name == "MigrationError", info.value
        assert info.value.fields["dst_block_ids"] == [5, 6]
        assert time.monotonic() - start < 10
        assert torch.equal(dst_w.call("blocks", name, others), before)
        desc2 = src_w.call("endpoint", "again", dict(FAIL_SPEC, seed=11, device="cuda:1"), "nccl", {})
        dst_w.call("pull", name, desc2, [7, 8], [9, 10], PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
        assert torch.equal(dst_w.call("blocks", name, [9, 10]), src_w.call("blocks", "again", [7, 8]))
    finally:
        close_quietly(dst_w, name)
        close_quietly(src_w, name, "again")


@pytest.mark.multi_gpu
def test_nccl_source_that_joins_late_is_cut_off_then_cleaned_up(gpu_workers):
    """A source that accepts the connect but joins the communicator only after the pull's
    deadline: the destination raises MigrationError within the deadline, its cache is
    untouched, and once the late join has run its course (both sides give it up), new pulls
    to that source and to others work. (The release of a set-up that completes after its
    deadline is tested on its own in test_migration.py.)"""
    _, _, healthy = gpu_workers(("cuda:0", "cuda:1"))
    # Own workers, killed at the end: a process whose abandoned set-up thread is still inside
    # NCCL may abort at exit, which is no verdict on this test.
    src_w, dst_w = Worker("cuda:1"), Worker("cuda:0")
    try:
        desc = src_w.call("endpoint", "late", dict(FAIL_SPEC, device="cuda:1"), "nccl", {})
        healthy_desc = healthy.call("endpoint", "h", dict(FAIL_SPEC, seed=6, device="cuda:1"),
                                    "nccl", {})
        dst_w.call("endpoint", "d", dict(FAIL_SPEC, seed=7, device="cuda:0"), "nccl", {})
        before = dst_w.call("blocks", "d", list(range(64)))
        src_w.call("stall", "late", "connect", 4.0)
        timeout = 2.0
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            dst_w.call("pull", "d", desc, [0, 1], [2, 3], timeout, timeout=CALL_TIMEOUT_S)
        elapsed = time.monotonic() - start
        assert info.value.type_name == "MigrationError", info.value
        assert "set-up" in info.value.message
        assert elapsed < timeout + 2.0, f"MigrationError after {elapsed:.1f} s"
        assert torch.equal(dst_w.call("blocks", "d", list(range(64))), before)
        src_w.call("stall", "late", "never", 0.0)
        for wait in (0.0, 5.0):  # at once, and after the late join has run its course
            time.sleep(wait)
            dst_w.call("pull", "d", desc, [0, 1], [2, 3], PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
            assert torch.equal(dst_w.call("blocks", "d", [2, 3]),
                               src_w.call("blocks", "late", [0, 1]))
            dst_w.call("pull", "d", healthy_desc, [5], [6], PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
            assert torch.equal(dst_w.call("blocks", "d", [6]), healthy.call("blocks", "h", [5]))
    finally:
        src_w.kill()
        dst_w.kill()
        close_quietly(healthy, "h")


@pytest.mark.gpu
def test_ipc_killed_source_is_reported(gpu_workers):
    """ipc has no per-pull message: a source that exited is noticed through its closed
    control connection before its memory is read (by the pull, or already by the endpoint's
    reaper of idle links, after which the pull finds no server to connect to)."""
    dst_w, _, _ = gpu_workers(_devices("ipc"))
    src_w = Worker(_devices("ipc")[1])
    try:
        desc = src_w.call("endpoint", "s", dict(FAIL_SPEC, device=_devices("ipc")[1]), "ipc", {})
        dst_w.call("endpoint", "d", dict(FAIL_SPEC, seed=7, device="cuda:0"), "ipc", {})
        dst_w.call("pull", "d", desc, [0, 1], [2, 3], PULL_TIMEOUT_S,
                   timeout=CALL_TIMEOUT_S)  # maps the source
        assert torch.equal(dst_w.call("blocks", "d", [2, 3]), src_w.call("blocks", "s", [0, 1]))
        src_w.kill()
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            dst_w.call("pull", "d", desc, [0, 1], [4, 5], 10.0, timeout=CALL_TIMEOUT_S)
        assert info.value.type_name == "MigrationError"
        assert ("connection closed by the peer" in info.value.message
                or "control channel: cannot connect" in info.value.message), info.value.message
        assert time.monotonic() - start < 5.0, "a dead ipc source must be noticed at once"
    finally:
        src_w.kill()
        close_quietly(dst_w, "d")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "gloo"])
def test_gpu_backends_reject_cpu_caches_and_mismatches(gpu_workers, backend):
    dst_w, src_w, _ = gpu_workers(_devices(backend))
    try:
        with pytest.raises(RemoteError, match="cache: on cpu") as info:
            dst_w.call("endpoint", "cpu", dict(FAIL_SPEC), backend, {})
        assert info.value.type_name == "ValueError"
        other_dtype = src_w.call("endpoint", "f16", dict(FAIL_SPEC, device=_devices(backend)[1],
                                                         dtype="float16"), backend, {})
        desc = src_w.call("endpoint", "m", dict(FAIL_SPEC, device=_devices(backend)[1]), backend, {})
        dst_w.call("endpoint", "m", dict(FAIL_SPEC, device="cuda:0"), backend, {})
        with pytest.raises(RemoteError, match="peer: cache geometry differs.*dtype"):
            dst_w.call("pull", "m", other_dtype, [0], [0], 10.0)
        with pytest.raises(RemoteError, match="src_block_ids: id 64 out of range"):
            dst_w.call("pull", "m", desc, [64], [0], 10.0)
        with pytest.raises(RemoteError, match="dst_block_ids: duplicate id 1"):
            dst_w.call("pull", "m", desc, [0, 1], [1, 1], 10.0)
        if backend == "ipc":  # CUDA cannot map a process's own memory through IPC
            own = dst_w.call("endpoint", "own", dict(FAIL_SPEC, device=_devices(backend)[1]), backend, {})
            with pytest.raises(RemoteError, match="peer: lives in this process"):
                dst_w.call("pull", "m", own, [0], [0], 10.0)
        # and the pair still works
        dst_w.call("pull", "m", desc, [3], [4], PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
        assert torch.equal(dst_w.call("blocks", "m", [4]), src_w.call("blocks", "m", [3]))
    finally:
        close_quietly(dst_w, "m", "own")
        close_quietly(src_w, "m", "f16")


def _pull_random_and_check(dst_w, src_w, name, desc, n, src_before, rng):
    """Pulls n random source blocks (repeats allowed) into n distinct random destination blocks
    of caches of equal size; checks the pulled blocks, the destination's other blocks and the
    whole source, byte for byte. Returns the PullStats."""
    all_ids = list(range(src_before.shape[0]))
    src = [rng.randrange(len(all_ids)) for _ in range(n)]
    dst = rng.sample(all_ids, n)
    others = sorted(set(all_ids) - set(dst))
    before = dst_w.call("blocks", name, others)
    stats = dst_w.call("pull", name, desc, src, dst, PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
    assert torch.equal(dst_w.call("blocks", name, dst), src_before[src])
    assert torch.equal(dst_w.call("blocks", name, others), before)
    assert torch.equal(src_w.call("blocks", name, all_ids), src_before)
    return stats


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "gloo"])
def test_gpu_pulls_of_more_ids_than_one_launch_carries(gpu_workers, backend):
    """A launch carries at most 448 ids in its parameters: a longer ipc pull uploads its ids,
    and an nccl chunk of more blocks copies in several launches. Pulls of 448, 449 and 1500
    tiny blocks land byte for byte, and nothing else changes."""
    dst_w, src_w, _ = gpu_workers(_devices(backend))
    spec = {"num_layers": 2, "num_blocks": 1600, "block_size": 2, "num_kv_heads": 2,
            "head_size": 8, "dtype": "bfloat16", "layout": "flash"}
    options = {"chunk_bytes": 1 << 20} if backend == "nccl" else {}  # chunks up to 4096 blocks
    rng = random.Random(77)
    try:
        desc = src_w.call("endpoint", "many", dict(spec, seed=1, device=_devices(backend)[1]), backend, options)
        dst_w.call("endpoint", "many", dict(spec, seed=2, layout="flashinfer", device="cuda:0"),
                   backend, options)
        all_ids = list(range(spec["num_blocks"]))
        src_before = src_w.call("blocks", "many", all_ids)
        for n in (448, 449, 1500):
            _pull_random_and_check(dst_w, src_w, "many", desc, n, src_before, rng)
    finally:
        close_quietly(dst_w, "many")
        close_quietly(src_w, "many")


def _endpoints(src_w, dst_w, name, backend, devices, src_seed, dst_seed):
    """Endpoints `name` of FAIL_SPEC's geometry on the source (devices[1]) and destination
    (devices[0]) workers, with OPTIONS[backend]; returns the source's descriptor."""
    desc = src_w.call("endpoint", name, dict(FAIL_SPEC, seed=src_seed, device=devices[1]), backend,
                      OPTIONS[backend])
    dst_w.call("endpoint", name, dict(FAIL_SPEC, seed=dst_seed, device=devices[0]), backend,
               OPTIONS[backend])
    return desc


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_connect_builds_the_pair_that_pulls_then_use(gpu_workers, backend):
    """connect() builds the data path ahead (nccl's communicators and staging, ipc's mapping,
    gloo's groups); pulls then use it without building another, and land byte for byte."""
    devices = _devices(backend)
    dst_w, src_w, _ = gpu_workers(devices)
    name = f"ahead-{backend}"
    try:
        desc = _endpoints(src_w, dst_w, name, backend, devices, 12, 13)
        assert dst_w.call("connect", name, desc, PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S) is True
        assert dst_w.call("connect", name, desc, PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S) is False
        src_rows = src_w.call("blocks", name, list(range(64)))
        for src, dst in (([3, 60, 3], [0, 1, 2]), (list(range(10, 30)), list(range(40, 60)))):
            dst_w.call("pull", name, desc, src, dst, PULL_TIMEOUT_S, timeout=CALL_TIMEOUT_S)
            assert torch.equal(dst_w.call("blocks", name, dst), src_rows[src])
        assert dst_w.call("connects", name) == 1
    finally:
        close_quietly(dst_w, name)
        close_quietly(src_w, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_pull_follows_the_work_on_the_current_stream(gpu_workers, backend):
    """pull is called while the destination's current stream still sleeps and then writes the
    target blocks: the pull lands after that work, so they hold the source's bytes."""
    devices = _devices(backend)
    dst_w, src_w, _ = gpu_workers(devices)
    name = f"order-{backend}"
    try:
        desc = _endpoints(src_w, dst_w, name, backend, devices, 8, 9)
        src_rows = src_w.call("blocks", name, list(range(64)))
        src, dst = [5, 6, 7, 8, 9], [40, 41, 42, 43, 44]
        dst_w.call("pull_after_write", name, desc, src, dst, PULL_TIMEOUT_S, 0x5A,
                   timeout=CALL_TIMEOUT_S)
        assert torch.equal(dst_w.call("blocks", name, dst), src_rows[src])
    finally:
        close_quietly(dst_w, name)
        close_quietly(src_w, name)


@pytest.mark.multi_gpu
def test_gpu_nccl_pull_longer_than_one_request(gpu_workers):
    """With one-block slots, a pull of 300 blocks goes to the source as three requests (at most
    128 slots each, so neither side queues more than the pull server's chunk limit): every
    block lands, nothing else changes, and the pull counts every chunk."""
    dst_w, src_w, _ = gpu_workers(("cuda:0", "cuda:1"))
    spec = {"num_layers": 2, "num_blocks": 400, "block_size": 2, "num_kv_heads": 2,
            "head_size": 8, "dtype": "bfloat16", "layout": "flash"}
    options = {"chunk_bytes": 1}  # one block per slot: a chunk per block after the ramp
    rng = random.Random(78)
    try:
        desc = src_w.call("endpoint", "long", dict(spec, seed=3, device="cuda:1"), "nccl", options)
        dst_w.call("endpoint", "long", dict(spec, seed=4, device="cuda:0"), "nccl", options)
        all_ids = list(range(spec["num_blocks"]))
        src_before = src_w.call("blocks", "long", all_ids)
        stats = _pull_random_and_check(dst_w, src_w, "long", desc, 300, src_before, rng)
        assert stats.chunks == 300
    finally:
        close_quietly(dst_w, "long")
        close_quietly(src_w, "long")


@pytest.mark.gpu
def test_id_staging_reuses_and_grows_its_buffers():
    """Every pull's ids go through one pinned and one device buffer per pair: reused while they
    fit, regrown when not; each upload must deliver exactly its own ids."""
    from vllm_ext.migration.base import IdStaging

    staging = IdStaging(torch.device("cuda:0"))
    rng = random.Random(4)
    for n in (1, 3, 300, 2, 1000, 5, 0):
        first = [rng.randrange(1 << 40) for _ in range(n)]
        second = [rng.randrange(1 << 40) for _ in range(n + 1)]
        dev_first, dev_second = staging.upload(first, second)
        assert dev_first.device.type == "cuda" and dev_first.dtype == torch.int64
        assert dev_first.tolist() == first and dev_second.tolist() == second
