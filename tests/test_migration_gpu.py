"""KV migration between CUDA caches: ipc and nccl between two GPUs (marked multi_gpu), gloo with
pinned staging on one GPU (marked gpu). Same checks as the CPU tests: random geometries,
layouts and ids, both directions, byte-for-byte; a stalled and a killed source; rejections.

    python -m pytest -m "gpu or multi_gpu" tests/test_migration_gpu.py
"""

import random
import time

import pytest
import torch
from test_migration import LAYOUT_PAIRS, random_spec, same_geometry
from test_migration_harness import RemoteError, Worker

NUM_CASES = 4
OPTIONS = {
    "ipc": {},
    "nccl": {"chunk_bytes": 256 << 10},  # several chunks per pull: the pipeline runs
    "gloo": {"stripes": 2, "chunk_bytes": 256 << 10},
}
FAIL_OPTIONS = {"ipc": {}, "nccl": {"chunk_bytes": 1}, "gloo": {"stripes": 2, "chunk_bytes": 1}}


def _devices(backend):
    return ("cuda:0", "cuda:0") if backend == "gloo" else ("cuda:0", "cuda:1")


@pytest.fixture(scope="module")
def gpu_workers(request):
    cache = {}

    def get(devices):
        if devices not in cache:
            cache[devices] = [Worker(d) for d in devices] + [Worker(devices[1])]
        return cache[devices]

    yield get
    for ws in cache.values():
        codes = [w.stop() for w in ws]
        assert codes == [0] * len(ws), f"worker exit codes {codes}"


def _marks(backend):
    return pytest.mark.gpu if backend == "gloo" else pytest.mark.multi_gpu


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
    desc_a = a.call("endpoint", name, spec_a, backend, OPTIONS[backend])
    desc_b = b.call("endpoint", name, spec_b, backend, OPTIONS[backend])
    try:
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
                stats = dst_w.call("pull", name, src_desc, src, dst, 60.0)
                assert stats.nbytes == n * src_before.shape[1]
                assert torch.equal(dst_w.call("blocks", name, dst), src_before[src])
                assert torch.equal(dst_w.call("blocks", name, others), before)
                assert torch.equal(src_w.call("blocks", name, all_src), src_before)
    finally:
        a.call("close", name)
        b.call("close", name)


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
            dst_w.result(timeout=timeout + 60)
        elapsed = time.monotonic() - start
        assert info.value.type_name == "MigrationError", info.value
        assert info.value.fields["dst_block_ids"] == dst
        assert elapsed < timeout + 3.0, f"MigrationError after {elapsed:.1f} s"
        if not kill:
            assert torch.equal(src_w.call("blocks", "s", list(range(64))), src_before)
        others = list(range(20, 64)) + list(range(10))
        assert torch.equal(dst_w.call("blocks", "d", others), before[others])
        stats = dst_w.call("pull", "d", healthy_desc, [1, 2, 3], [10, 11, 12], 60.0)
        assert stats.num_blocks == 3
        assert torch.equal(dst_w.call("blocks", "d", [10, 11, 12]),
                           healthy.call("blocks", "h", [1, 2, 3]))
        desc_d = dst_w.call("endpoint", "d2", dict(FAIL_SPEC, seed=8, device=devices[0]),
                            backend, FAIL_OPTIONS[backend])
        healthy.call("pull", "h", desc_d, [0, 1], [30, 31], 60.0)
        assert torch.equal(healthy.call("blocks", "h", [30, 31]),
                           dst_w.call("blocks", "d2", [0, 1]))
    finally:
        for w, names in ((dst_w, ("d", "d2")), (healthy, ("h",))):
            for n in names:
                try:
                    w.call("close", n)
                except (RemoteError, KeyError):
                    pass
        src_w.stop(timeout=10.0)


@pytest.mark.multi_gpu
def test_ipc_killed_source_is_reported(gpu_workers):
    """ipc has no per-pull message: a source that exited is noticed through its closed
    control connection before its memory is read."""
    dst_w, _, _ = gpu_workers(("cuda:0", "cuda:1"))
    src_w = Worker("cuda:1")
    try:
        desc = src_w.call("endpoint", "s", dict(FAIL_SPEC, device="cuda:1"), "ipc", {})
        dst_w.call("endpoint", "d", dict(FAIL_SPEC, seed=7, device="cuda:0"), "ipc", {})
        dst_w.call("pull", "d", desc, [0, 1], [2, 3], 30.0)  # maps the source
        src_w.kill()
        time.sleep(0.5)
        with pytest.raises(RemoteError) as info:
            dst_w.call("pull", "d", desc, [0, 1], [4, 5], 10.0)
        assert info.value.type_name == "MigrationError"
    finally:
        dst_w.call("close", "d")
        src_w.stop(timeout=10.0)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_gpu_backends_reject_cpu_caches_and_mismatches(gpu_workers, backend):
    dst_w, src_w, _ = gpu_workers(("cuda:0", "cuda:1"))
    with pytest.raises(RemoteError, match="cache: on cpu"):
        dst_w.call("endpoint", "cpu", dict(FAIL_SPEC), backend, {})
    other_dtype = src_w.call("endpoint", "f16", dict(FAIL_SPEC, device="cuda:1",
                                                     dtype="float16"), backend, {})
    desc = src_w.call("endpoint", "m", dict(FAIL_SPEC, device="cuda:1"), backend, {})
    dst_w.call("endpoint", "m", dict(FAIL_SPEC, device="cuda:0"), backend, {})
    try:
        with pytest.raises(RemoteError, match="peer: cache geometry differs.*dtype"):
            dst_w.call("pull", "m", other_dtype, [0], [0], 10.0)
        with pytest.raises(RemoteError, match="src_block_ids: id 64 out of range"):
            dst_w.call("pull", "m", desc, [64], [0], 10.0)
        with pytest.raises(RemoteError, match="dst_block_ids: duplicate id 1"):
            dst_w.call("pull", "m", desc, [0, 1], [1, 1], 10.0)
        dst_w.call("pull", "m", desc, [3], [4], 30.0)  # and the pair still works
        assert torch.equal(dst_w.call("blocks", "m", [4]), src_w.call("blocks", "m", [3]))
    finally:
        dst_w.call("close", "m")
        src_w.call("close", "m")
        src_w.call("close", "f16")
