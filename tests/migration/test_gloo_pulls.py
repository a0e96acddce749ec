"""gloo pulls between spawned processes on loopback: random geometries, layouts and block ids,
both directions, byte for byte; pairs built, reused and released on both sides; dead, stalled
and closing sources."""

import random
import time

import pytest
import torch

from tests.helpers.migration_harness import RemoteError, Worker, close_quietly, expected_blocks
from tests.helpers.specs import LAYOUT_PAIRS, random_spec, same_geometry

NUM_CASES = 6
# Small chunks so even small pulls run through the multi-chunk, two-slot pipeline.
GLOO_OPTIONS = {"stripes": 2, "chunk_bytes": 48 << 10}




@pytest.fixture(scope="module")
def workers():
    ws = [Worker(), Worker()]
    yield ws
    codes = [w.stop() for w in ws]
    assert codes == [0, 0], f"worker exit codes {codes}"


def _ids(rng, spec_src, spec_dst, n):
    src = [rng.randrange(spec_src["num_blocks"]) for _ in range(n)]  # repeats allowed
    dst = rng.sample(range(spec_dst["num_blocks"]), n)
    return src, dst


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_gloo_pull_both_directions(workers, case):
    rng = random.Random(1000 + case)
    layout_a, layout_b = LAYOUT_PAIRS[case % len(LAYOUT_PAIRS)]
    spec_a = random_spec(rng, layout_a, seed=2 * case + 1)
    spec_b = same_geometry(spec_a, layout_b, 2 * case + 2, rng.choice([23, 64, 100]))
    a, b = workers
    name = f"case{case}"
    desc_a = a.call("endpoint", name, spec_a, "gloo", GLOO_OPTIONS)
    desc_b = b.call("endpoint", name, spec_b, "gloo", GLOO_OPTIONS)
    try:
        for dst_w, dst_spec, src_w, src_desc, src_spec in ((a, spec_a, b, desc_b, spec_b),
                                                           (b, spec_b, a, desc_a, spec_a)):
            n = rng.randint(1, min(dst_spec["num_blocks"], 40))
            src, dst = _ids(rng, src_spec, dst_spec, n)
            others = [i for i in range(dst_spec["num_blocks"]) if i not in set(dst)]
            before = dst_w.call("blocks", name, others)
            all_src = list(range(src_spec["num_blocks"]))
            src_before = src_w.call("blocks", name, all_src)
            stats = dst_w.call("pull", name, src_desc, src, dst, 30.0)
            assert stats.nbytes == n * src_before.shape[1] and stats.num_blocks == n
            assert stats.seconds > 0
            assert torch.equal(dst_w.call("blocks", name, dst), src_before[src])
            assert torch.equal(dst_w.call("blocks", name, others), before), "other blocks changed"
            assert torch.equal(src_w.call("blocks", name, all_src), src_before), "source changed"
    finally:
        a.call("close", name)
        b.call("close", name)


def _flash_spec(seed, num_blocks=32, dtype="bfloat16", num_layers=2, num_kv_heads=2):
    """A small flash-layout cache spec (block size 16, head size 64)."""
    return {"num_layers": num_layers, "num_blocks": num_blocks, "block_size": 16,
            "num_kv_heads": num_kv_heads, "head_size": 64, "dtype": dtype, "layout": "flash",
            "seed": seed}


def _gloo_endpoints(src_w, dst_w, name, spec, dst_seed, options=GLOO_OPTIONS):
    """A gloo endpoint `name` on both workers, the destination's cache filled from dst_seed;
    returns the source's descriptor."""
    desc = src_w.call("endpoint", name, spec, "gloo", options)
    dst_w.call("endpoint", name, dict(spec, seed=dst_seed), "gloo", options)
    return desc


def test_gloo_repeated_pulls_reuse_the_pair(workers):
    a, b = workers
    spec = _flash_spec(77)
    desc_a = _gloo_endpoints(a, b, "rep", spec, 78)
    try:
        for k in range(5):
            src = list(range(k, k + 8))
            dst = list(range(20, 28))
            b.call("pull", "rep", desc_a, src, dst, 30.0)
            assert torch.equal(b.call("blocks", "rep", dst), expected_blocks(spec, src))
            # The first pull builds the gloo groups; later ones reuse them.
            assert b.call("connects", "rep") == 1
    finally:
        a.call("close", "rep")
        b.call("close", "rep")


def test_a_pull_with_the_longest_timeout_is_accepted(workers):
    """A timeout of MAX_TIMEOUT_S: the destination's progress-following wait is clamped to it
    (as the source's), not refused as past it."""
    from vllm_ext.migration.timing import MAX_TIMEOUT_S

    a, b = workers
    spec = _flash_spec(91)
    desc_a = _gloo_endpoints(a, b, "longest", spec, 92)
    try:
        src, dst = [3, 1, 4], [20, 21, 22]
        b.call("pull", "longest", desc_a, src, dst, MAX_TIMEOUT_S)
        assert torch.equal(b.call("blocks", "longest", dst), expected_blocks(spec, src))
    finally:
        a.call("close", "longest")
        b.call("close", "longest")


def _served_pairs(worker, name, want, seconds=10.0):
    """The source's count of pairs it serves, once it equals `want` (it learns of a closed
    connection on its own thread) or after `seconds`."""
    end = time.monotonic() + seconds
    while True:
        served = worker.call("links", name)[1]
        if served == want or time.monotonic() > end:
            return served
        time.sleep(0.05)


def test_disconnect_releases_the_pair_on_both_sides_and_a_later_pull_connects_again(workers):
    a, b = workers
    spec = _flash_spec(91, num_blocks=24, dtype="float16")
    desc_a = _gloo_endpoints(a, b, "disc", spec, 92)
    try:
        assert b.call("disconnect", "disc", desc_a, 5.0) is False  # nothing held yet
        b.call("pull", "disc", desc_a, [3, 4, 5], [0, 1, 2], 30.0)
        assert b.call("links", "disc")[0] == 1
        assert _served_pairs(a, "disc", 1) == 1
        assert b.call("disconnect", "disc", desc_a, 5.0) is True
        assert b.call("links", "disc")[0] == 0
        assert _served_pairs(a, "disc", 0) == 0, "the source kept the pair of a closed connection"
        # Idle pairs are freed, not parked (parking is for pairs a failure left mid-transfer).
        assert b.call("links", "disc")[2] == 0 and a.call("links", "disc")[2] == 0
        assert b.call("disconnect", "disc", desc_a, 5.0) is False
        b.call("pull", "disc", desc_a, [7, 8], [10, 11], 30.0)
        assert torch.equal(b.call("blocks", "disc", [0, 1, 2, 10, 11]),
                           expected_blocks(spec, [3, 4, 5, 7, 8]))
        assert b.call("connects", "disc") == 2
        with pytest.raises(RemoteError, match="TypeError: peer: expected PeerDescriptor"):
            b.call("disconnect", "disc", "not a descriptor", 5.0)
    finally:
        a.call("close", "disc")
        b.call("close", "disc")


def test_connect_builds_the_pair_ahead_of_the_first_pull_on_both_sides(workers):
    a, b = workers
    spec = _flash_spec(61, num_blocks=20)
    desc_a = _gloo_endpoints(a, b, "ahead", spec, 62)
    try:
        assert b.call("connect", "ahead", desc_a, 30.0) is True
        assert b.call("connects", "ahead") == 1 and b.call("links", "ahead")[0] == 1
        assert _served_pairs(a, "ahead", 1) == 1, "the source did not build its side"
        assert b.call("connect", "ahead", desc_a, 30.0) is False  # built already: nothing done
        b.call("pull", "ahead", desc_a, [9, 1, 9], [4, 5, 6], 30.0)
        assert torch.equal(b.call("blocks", "ahead", [4, 5, 6]), expected_blocks(spec, [9, 1, 9]))
        assert b.call("connects", "ahead") == 1, "the pull built a second pair"
        assert b.call("disconnect", "ahead", desc_a, 5.0) is True
        assert b.call("connect", "ahead", desc_a, 30.0) is True  # built again after a disconnect
        assert b.call("connects", "ahead") == 2 and _served_pairs(a, "ahead", 1) == 1
    finally:
        a.call("close", "ahead")
        b.call("close", "ahead")


def test_a_link_whose_peer_closed_its_end_is_released_by_itself(workers):
    a, b = workers
    spec = _flash_spec(95, num_blocks=16, num_layers=1, num_kv_heads=1)
    desc_a = _gloo_endpoints(a, b, "gone", spec, 96)
    desc_c = a.call("endpoint", "stays", dict(spec, seed=97), "gloo", GLOO_OPTIONS)
    try:
        b.call("pull", "gone", desc_a, [1, 2], [3, 4], 30.0)
        b.call("pull", "gone", desc_c, [5], [6], 30.0)
        assert b.call("links", "gone")[0] == 2
        a.call("close", "gone")  # that peer's endpoint closes: its connections end
        end = time.monotonic() + 10
        while b.call("links", "gone")[0] != 1 and time.monotonic() < end:
            time.sleep(0.1)
        assert b.call("links", "gone")[0] == 1, "the link to the closed peer was kept"
        assert b.call("disconnect", "gone", desc_a, 5.0) is False  # already released
        b.call("pull", "gone", desc_c, [7], [8], 30.0)  # the other peer's link is intact
        assert b.call("connects", "gone") == 2
        assert torch.equal(b.call("blocks", "gone", [6, 8]), expected_blocks(dict(spec, seed=97), [5, 7]))
    finally:
        close_quietly(a, "gone", "stays")
        close_quietly(b, "gone")


@pytest.mark.parametrize("patient", [False, True], ids=["gives-up", "waits"])
def test_disconnect_during_a_pull_waits_for_it_or_gives_up_leaving_it_intact(workers, patient):
    a, b = workers
    spec = dict(TIMEOUT_SPEC, seed=93)
    desc_a = _gloo_endpoints(a, b, "dp", spec, 94, ONE_BLOCK_CHUNKS)
    try:
        b.call("pull", "dp", desc_a, [0], [0], 30.0)  # the pair exists
        a.call("stall", "dp", 1, 1.5)  # the next pull pauses 1.5 s at its second chunk
        src, dst = [5, 6, 7], [20, 21, 22]
        out = b.call("pull_and_disconnect", "dp", desc_a, src, dst, 30.0, 0.3, 10.0 if patient else 0.2)
        assert not isinstance(out["pull"], str), out["pull"]  # the pull completed either way
        assert torch.equal(b.call("blocks", "dp", dst), expected_blocks(spec, src))
        if patient:
            assert out["disconnect"] is True and out["waited"] > 0.5
            assert b.call("links", "dp")[0] == 0
        else:
            assert out["disconnect"].startswith("MigrationError: disconnect from"), out["disconnect"]
            assert "still runs after 0.2 s" in out["disconnect"]
            assert b.call("links", "dp")[0] == 1 and b.call("connects", "dp") == 1
    finally:
        a.call("stall", "dp", None, 0)
        a.call("close", "dp")
        b.call("close", "dp")


# ---- failures: a stalled source, a killed source ----------------------------------------------
TIMEOUT_SPEC = {"num_layers": 2, "num_blocks": 32, "block_size": 16, "num_kv_heads": 2,
                "head_size": 64, "dtype": "bfloat16", "layout": "flash", "seed": 5}
ONE_BLOCK_CHUNKS = {"stripes": 2, "chunk_bytes": 1}  # one block per chunk


# A dead or closing source is noticed within 1 s (the destination watches the control
# connection while it waits for data); the slack covers a loaded 2-core host.
NOTICE_S, NOTICE_SLACK_S = 1.0, 2.0


@pytest.mark.parametrize("fault", ["stalled", "killed", "closed"])
def test_gloo_dead_or_stalled_source(workers, fault):
    dst_w, healthy = workers
    src_w = Worker()
    try:
        src_desc = src_w.call("endpoint", "s", TIMEOUT_SPEC, "gloo", ONE_BLOCK_CHUNKS)
        healthy_desc = healthy.call("endpoint", "h", dict(TIMEOUT_SPEC, seed=6), "gloo",
                                    ONE_BLOCK_CHUNKS)
        dst_w.call("endpoint", "d", dict(TIMEOUT_SPEC, seed=7), "gloo", ONE_BLOCK_CHUNKS)
        before = dst_w.call("blocks", "d", list(range(32)))
        src_w.call("stall", "s", 2, 120.0)  # serves chunks 0, 1, then hangs
        timeout = 4.0 if fault == "stalled" else 60.0
        src, dst = list(range(10)), list(range(10, 20))
        start = time.monotonic()
        dst_w.send("pull", "d", src_desc, src, dst, timeout)
        if fault != "stalled":
            time.sleep(1.0)
            faulted = time.monotonic()
            if fault == "killed":
                src_w.kill()
            else:
                src_w.send("close", "s")  # the source's endpoint closes mid-pull
        with pytest.raises(RemoteError) as info:
            dst_w.result(timeout=timeout + 30)
        elapsed = time.monotonic() - start
        assert info.value.type_name == "MigrationError", info.value
        assert info.value.fields["dst_block_ids"] == dst
        assert "left undefined" in info.value.message
        if fault == "stalled":
            assert timeout - 0.5 <= elapsed < timeout + 2.0, f"MigrationError after {elapsed:.1f} s"
            # The stalled source's blocks are untouched.
            assert torch.equal(src_w.call("blocks", "s", list(range(32))),
                               expected_blocks(TIMEOUT_SPEC, range(32)))
        else:
            noticed = time.monotonic() - faulted
            assert noticed < NOTICE_S + NOTICE_SLACK_S, f"a {fault} source noticed after {noticed:.1f} s"
            if fault == "closed":
                assert "closing" in info.value.message, info.value.message
        # The failed pair is parked (gloo may still have operations pending on it).
        assert dst_w.call("links", "d")[2] == 1
        # Blocks other than the targets are untouched; the endpoint still pulls from others.
        others = list(range(20, 32)) + list(range(10))
        assert torch.equal(dst_w.call("blocks", "d", others), before[others])
        stats = dst_w.call("pull", "d", healthy_desc, [1, 2, 3], [10, 11, 12], 30.0)
        assert stats.num_blocks == 3
        assert torch.equal(dst_w.call("blocks", "d", [10, 11, 12]),
                           expected_blocks(dict(TIMEOUT_SPEC, seed=6), [1, 2, 3]))
        # ... and still serves: the healthy worker pulls from it.
        healthy.call("pull", "h", dst_w.call("endpoint", "d2", dict(TIMEOUT_SPEC, seed=8),
                                             "gloo", ONE_BLOCK_CHUNKS), [0, 1], [30, 31], 30.0)
        assert torch.equal(healthy.call("blocks", "h", [30, 31]),
                           expected_blocks(dict(TIMEOUT_SPEC, seed=8), [0, 1]))
    finally:
        for w, names in ((dst_w, ("d", "d2")), (healthy, ("h",))):
            for n in names:
                try:
                    w.call("close", n)
                except RemoteError:
                    pass
        code = src_w.stop(timeout=5.0)
        assert code == (-9 if fault == "killed" else code)




class EveryChunk:
    """A stall step (the harness's StallFaults) that is every chunk: the source pauses before
    each, as one whose forward beside it takes the host's cores."""

    def __eq__(self, step):
        return isinstance(step, int) and not isinstance(step, bool)

    def __hash__(self):
        return 0


def test_a_slow_source_that_makes_progress_is_waited_for(workers):
    """Each of 6 one-block chunks leaves the source 1.2 s late: 7 s in all, past the pull's
    timeout of 3 s, but never 3 s without a sign of the source's life (a chunk, or gloo.progress
    while it serves). The pull follows that progress and completes, byte for byte; a source that
    goes silent still fails one timeout after its last sign (test_gloo_dead_or_stalled_source)."""
    dst_w, _ = workers
    src_w = Worker()
    try:
        src_desc = src_w.call("endpoint", "slow", TIMEOUT_SPEC, "gloo", ONE_BLOCK_CHUNKS)
        dst_w.call("endpoint", "d-slow", dict(TIMEOUT_SPEC, seed=9), "gloo", ONE_BLOCK_CHUNKS)
        src_w.call("stall", "slow", EveryChunk(), 1.2)
        rng = random.Random()
        src, dst = rng.sample(range(32), 6), rng.sample(range(32), 6)
        stats = dst_w.call("pull", "d-slow", src_desc, src, dst, 3.0, timeout=120.0)
        assert stats.num_blocks == 6
        assert torch.equal(dst_w.call("blocks", "d-slow", dst), expected_blocks(TIMEOUT_SPEC, src))
    finally:
        close_quietly(dst_w, "d-slow")
        src_w.stop(timeout=5.0)
