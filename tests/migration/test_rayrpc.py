"""KV migration through Ray (rayrpc) on the CPU: two instance actors (separate processes) on a
local Ray node, random geometries and layouts, both directions, byte-for-byte; a stalled and
a killed source; rejections. Skipped with the reason when ray is not installed."""

import dataclasses
import os
import random
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed (pip install vllm-ext[ray])")

from tests.helpers.migration_harness import make_cache  # noqa: E402
from tests.helpers.specs import LAYOUT_PAIRS, random_spec, same_geometry  # noqa: E402
from vllm_ext.migration import MigrationEndpoint  # noqa: E402

OPTIONS = {"chunk_bytes": 48 << 10}  # several chunks per pull
ONE_BLOCK_CHUNKS = {"chunk_bytes": 1}
NUM_CASES = 3


@ray.remote(max_concurrency=4)
class Instance:
    """A stand-in serving instance: one cache and one rayrpc endpoint per name."""

    def __init__(self):
        self.endpoints = {}

    def endpoint(self, name, spec, options):
        ep = MigrationEndpoint(make_cache(spec), backend="rayrpc", **options)
        self.endpoints[name] = ep
        return ep.descriptor()

    def pull(self, name, desc, src, dst, timeout):
        from vllm_ext.migration import MigrationError

        try:
            return "ok", self.endpoints[name].pull(desc, src, dst, timeout=timeout)
        except MigrationError as e:
            return "MigrationError", (str(e), e.dst_block_ids, e.remote_type)

    def connect(self, name, desc, timeout):
        from vllm_ext.migration import MigrationError

        try:
            return "ok", self.endpoints[name].connect(desc, timeout=timeout)
        except MigrationError as e:
            return "MigrationError", (str(e), e.remote_type)

    def blocks(self, name, ids):
        from vllm_ext import ops

        return ops.gather_blocks(self.endpoints[name].cache, list(ids))

    def stall(self, name, chunk, seconds):
        import time

        class Faults:  # the endpoint's fault hooks (vllm_ext.migration.base.Faults)
            native_stall = None

            def pause(self, step):
                if step == chunk:
                    time.sleep(seconds)

        self.endpoints[name]._context.faults = Faults()

    def close(self, name):
        self.endpoints.pop(name).close()


@pytest.fixture(scope="module")
def ray_node():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)  # the workers import tests.*
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def actors(ray_node):
    pair = [Instance.remote(), Instance.remote()]
    yield pair
    for a in pair:
        ray.kill(a)


def get(ref, timeout=60):
    return ray.get(ref, timeout=timeout)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_rayrpc_pull_both_directions(actors, case):
    rng = random.Random(2000 + case)
    layout_a, layout_b = LAYOUT_PAIRS[(case + 1) % len(LAYOUT_PAIRS)]
    spec_a = random_spec(rng, layout_a, seed=10 + case)
    spec_b = same_geometry(spec_a, layout_b, 20 + case, rng.choice([23, 64]))
    a, b = actors
    name = f"r{case}"
    desc_a = get(a.endpoint.remote(name, spec_a, OPTIONS))
    desc_b = get(b.endpoint.remote(name, spec_b, OPTIONS))
    try:
        for dst, dst_spec, src, src_desc, src_spec in ((a, spec_a, b, desc_b, spec_b),
                                                       (b, spec_b, a, desc_a, spec_a)):
            n = rng.randint(1, min(dst_spec["num_blocks"], 30))
            src_ids = [rng.randrange(src_spec["num_blocks"]) for _ in range(n)]
            dst_ids = rng.sample(range(dst_spec["num_blocks"]), n)
            all_src = list(range(src_spec["num_blocks"]))
            src_before = get(src.blocks.remote(name, all_src))
            status, stats = get(dst.pull.remote(name, src_desc, src_ids, dst_ids, 30.0))
            assert status == "ok", stats
            assert stats.nbytes == n * src_before.shape[1]
            assert torch.equal(get(dst.blocks.remote(name, dst_ids)), src_before[src_ids])
            assert torch.equal(get(src.blocks.remote(name, all_src)), src_before)
    finally:
        get(a.close.remote(name))
        get(b.close.remote(name))


SPEC = {"num_layers": 2, "num_blocks": 32, "block_size": 16, "num_kv_heads": 2, "head_size": 64,
        "dtype": "bfloat16", "layout": "flash", "seed": 5}


@pytest.mark.parametrize("kill", [False, True], ids=["stalled", "killed"])
def test_rayrpc_dead_or_stalled_source(actors, kill):
    dst, healthy = actors
    src = Instance.remote()
    try:
        src_desc = get(src.endpoint.remote("s", SPEC, ONE_BLOCK_CHUNKS))
        healthy_desc = get(healthy.endpoint.remote("h", dict(SPEC, seed=6), ONE_BLOCK_CHUNKS))
        get(dst.endpoint.remote("d", dict(SPEC, seed=7), ONE_BLOCK_CHUNKS))
        get(src.stall.remote("s", 2, 120.0))
        src_before = get(src.blocks.remote("s", list(range(32))))
        timeout = 4.0
        start = time.monotonic()
        ref = dst.pull.remote("d", src_desc, list(range(10)), list(range(10, 20)), timeout)
        if kill:
            time.sleep(1.0)
            ray.kill(src)
        status, value = get(ref, timeout=timeout + 30)
        elapsed = time.monotonic() - start
        assert status == "MigrationError", value
        message, dst_ids, _ = value
        assert dst_ids == list(range(10, 20)) and "left undefined" in message
        assert elapsed < timeout + 2.0, f"MigrationError after {elapsed:.1f} s"
        if kill:
            assert elapsed < timeout, "a dead source must be noticed before the deadline"
        else:
            assert torch.equal(get(src.blocks.remote("s", list(range(32)))), src_before)
        status, stats = get(dst.pull.remote("d", healthy_desc, [1, 2], [10, 11], 30.0))
        assert status == "ok", stats
        expected = get(healthy.blocks.remote("h", [1, 2]))
        assert torch.equal(get(dst.blocks.remote("d", [10, 11])), expected)
    finally:
        get(dst.close.remote("d"))
        get(healthy.close.remote("h"))
        ray.kill(src)


def test_rayrpc_rejections(actors):
    a, b = actors
    desc_a = get(a.endpoint.remote("x", SPEC, OPTIONS))
    desc_b = get(b.endpoint.remote("x", dict(SPEC, seed=9, num_blocks=8), OPTIONS))
    try:
        forged = dataclasses.replace(desc_b, num_blocks=100)  # b has 8 blocks
        start = time.monotonic()
        status, value = get(a.pull.remote("x", forged, [0, 50], [0, 1], 20.0))
        assert status == "MigrationError"
        message, _, remote_type = value
        assert remote_type == "ValueError" and "src_block_ids: id 50 out of range" in message
        assert time.monotonic() - start < 10
        forged = dataclasses.replace(desc_b, geometry=dict(desc_b.geometry, num_kv_heads=4))
        with pytest.raises(ray.exceptions.RayTaskError, match="peer: cache geometry differs"):
            get(a.pull.remote("x", forged, [0], [0], 20.0))
        with pytest.raises(ray.exceptions.RayTaskError, match="lengths differ"):
            get(a.pull.remote("x", desc_b, [0, 1], [0], 20.0))
        del desc_a
    finally:
        get(a.close.remote("x"))
        get(b.close.remote("x"))


def test_rayrpc_connect_checks_the_peer_actor(actors):
    """rayrpc builds nothing ahead: connect is one call to the peer's actor, which must serve
    that endpoint; a closed endpoint or a dead actor is a MigrationError."""
    a, b = actors
    src = Instance.remote()
    try:
        desc_b = get(b.endpoint.remote("c", dict(SPEC, seed=3), OPTIONS))
        desc_src = get(src.endpoint.remote("c", dict(SPEC, seed=4), OPTIONS))
        get(a.endpoint.remote("c", SPEC, OPTIONS))
        assert get(a.connect.remote("c", desc_b, 20.0)) == ("ok", True)
        assert get(a.connect.remote("c", desc_b, 20.0)) == ("ok", False)
        assert get(a.connect.remote("c", desc_src, 20.0)) == ("ok", True)
        get(src.close.remote("c"))  # the actor lives, its endpoint is gone
        status, value = get(a.pull.remote("c", desc_src, [0], [1], 20.0))
        assert status == "MigrationError" and value[2] == "ValueError", value
        # The failed pull left nothing for that peer: connect asks its actor again.
        status, (message, remote_type) = get(a.connect.remote("c", desc_src, 20.0))
        assert status == "MigrationError" and remote_type == "ValueError", message
        assert "no endpoint" in message
        ray.kill(src)
        start = time.monotonic()
        status, (message, _) = get(a.connect.remote("c", desc_src, 20.0))
        assert status == "MigrationError" and "Actor" in message, message
        assert time.monotonic() - start < 20
    finally:
        get(a.close.remote("c"))
        get(b.close.remote("c"))
        ray.kill(src)


def test_rayrpc_endpoint_needs_an_actor(ray_node):
    with pytest.raises(RuntimeError, match="inside a Ray actor"):
        MigrationEndpoint(make_cache(SPEC), backend="rayrpc")
