"""KV migration on the CPU: the gloo backend between spawned processes on loopback (random
geometries, layouts and block ids, both directions, byte-for-byte), the timeout and
dead-peer paths, every rejection, the control channel, and lazy backend loading."""

import dataclasses
import os
import queue as queue_mod
import random
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_migration_harness import RemoteError, StallFaults, Worker, close_quietly, expected_blocks, make_cache

from vllm_ext.migration import (
    BACKEND_NAMES,
    ClosedError,
    MigrationEndpoint,
    MigrationError,
    PeerDescriptor,
    control,
    get_backend_class,
    protocol,
)
from vllm_ext.migration.control import LOCAL_SOCKETS, Connection, ControlServer
from vllm_ext.migration.timing import Deadline

TEST_SECRET = b"secret-of-the-control-channel-tests"
SERVER_ID = "s" * 32


def _server(handle, **kw):
    """A control server of a test endpoint, serving `handle` after authentication."""
    return ControlServer("127.0.0.1", 0, handle, endpoint_id=SERVER_ID, secret=TEST_SECRET, max_payload=1 << 20, **kw)


def _open(server, local=""):
    return control.open_connection(server.host, server.port, local, Deadline(5), client_id="c" * 32,
                                   server_id=SERVER_ID, secret=TEST_SECRET, max_payload=1 << 20)

LAYOUT_PAIRS = [("flash", "flash"), ("flash", "flashinfer"), ("flashinfer", "flash"),
                ("mla", "mla")]
DTYPES = ["bfloat16", "float16", "float32", "uint8"]
NUM_CASES = 6
# Small chunks so even small pulls run through the multi-chunk, two-slot pipeline.
GLOO_OPTIONS = {"stripes": 2, "chunk_bytes": 48 << 10}


def random_spec(rng, layout, seed, num_blocks=None):
    mla = layout == "mla"
    return {
        "num_layers": rng.choice([1, 2, 5]),
        "num_blocks": num_blocks or rng.choice([17, 64, 130]),
        "block_size": rng.choice([1, 8, 16]),
        "num_kv_heads": 1 if mla else rng.choice([1, 2, 4]),
        "head_size": rng.choice([16, 64, 80]),
        "dtype": rng.choice(DTYPES),
        "layout": layout,
        "seed": seed,
    }


def same_geometry(spec, layout, seed, num_blocks):
    return dict(spec, layout=layout, seed=seed, num_blocks=num_blocks)


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


# ---- rejections (in one process: they never reach a transfer) -------------------------------
SPEC = {"num_layers": 2, "num_blocks": 16, "block_size": 4, "num_kv_heads": 2, "head_size": 16,
        "dtype": "bfloat16", "layout": "flash", "seed": 1}


@pytest.fixture
def local_pair():
    a = MigrationEndpoint(make_cache(SPEC), backend="gloo", stripes=1)
    b = MigrationEndpoint(make_cache(dict(SPEC, seed=2, num_blocks=8)), backend="gloo", stripes=1)
    yield a, b
    a.close()
    b.close()


def test_local_pull_between_two_endpoints(local_pair):
    a, b = local_pair  # both in this process: gloo's two ranks run on two threads
    stats = a.pull(b.descriptor(), [7, 0, 7], [1, 2, 3], timeout=30)
    assert stats.num_blocks == 3
    assert torch.equal(expected_blocks(dict(SPEC, seed=2, num_blocks=8), [7, 0, 7]),
                       expected_blocks_of(a, [1, 2, 3]))


def expected_blocks_of(ep, ids):
    from test_migration_harness import block_rows

    return block_rows(ep.cache, ids)


BAD_ARGUMENTS = [
    # (name, src, dst, kwargs, exception, message fragment)
    ("lengths differ", [0, 1], [0], {}, ValueError, "lengths differ (2 vs 1)"),
    ("src out of range", [8], [0], {}, ValueError, "src_block_ids: id 8 out of range for a cache of 8"),
    ("negative src", [-1], [0], {}, ValueError, "src_block_ids: id -1 out of range"),
    ("dst out of range", [0], [16], {}, ValueError, "dst_block_ids: id 16 out of range for a cache of 16"),
    ("duplicate dst", [0, 1], [3, 3], {}, ValueError, "dst_block_ids: duplicate id 3"),
    ("float id", [0.0], [0], {}, TypeError, "src_block_ids: 0.0 is not an int"),
    ("bool id", [True], [0], {}, TypeError, "src_block_ids: True is not an int"),
    ("string ids", "01", [0, 1], {}, TypeError, "src_block_ids: expected a list"),
    ("2-D tensor", torch.zeros(1, 1, dtype=torch.int64), [0], {}, ValueError, "1-D tensor"),
    ("float tensor", torch.zeros(1), [0], {}, TypeError, "src_block_ids: dtype torch.float32"),
    ("zero timeout", [0], [0], {"timeout": 0}, ValueError, "timeout: must be a positive number"),
    ("bad timeout", [0], [0], {"timeout": "5"}, ValueError, "timeout: must be a positive number"),
    ("infinite timeout", [0], [0], {"timeout": float("inf")}, ValueError, "up to 1e+06, got inf"),
    ("nan timeout", [0], [0], {"timeout": float("nan")}, ValueError, "up to 1e+06, got nan"),
    ("huge timeout", [0], [0], {"timeout": 1e10}, ValueError, "up to 1e+06, got 10000000000.0"),
]


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_pull_rejects_bad_arguments(local_pair, case):
    _, src, dst, kwargs, exc, fragment = case
    a, b = local_pair
    before = expected_blocks_of(a, range(16))
    with pytest.raises(exc) as info:
        a.pull(b.descriptor(), src, dst, **kwargs)
    assert fragment in str(info.value)
    assert torch.equal(expected_blocks_of(a, range(16)), before)
    assert not a._destination._links, "a rejected pull must not contact the peer"


GEOMETRY_CHANGES = [("dtype", "float16"), ("num_kv_heads", 4), ("num_layers", 3),
                    ("head_size", 32), ("block_size", 8)]


@pytest.mark.parametrize("key,value", GEOMETRY_CHANGES, ids=[k for k, _ in GEOMETRY_CHANGES])
def test_pull_rejects_geometry_mismatch(key, value):
    a = MigrationEndpoint(make_cache(SPEC), backend="gloo", stripes=1)
    b = MigrationEndpoint(make_cache(dict(SPEC, **{key: value})), backend="gloo", stripes=1)
    try:
        with pytest.raises(ValueError, match=f"peer: cache geometry differs.*{key}"):
            a.pull(b.descriptor(), [0], [0])
        # A descriptor that lies about the geometry is refused by the source itself.
        forged = dataclasses.replace(b.descriptor(), geometry=a.cache.geometry())
        with pytest.raises(MigrationError, match="hello: cache geometry differs") as info:
            a.pull(forged, [0], [0], timeout=10)
        assert info.value.remote_type == "ValueError"
    finally:
        a.close()
        b.close()


def test_source_refuses_ids_out_of_its_range(local_pair):
    a, b = local_pair
    forged = dataclasses.replace(b.descriptor(), num_blocks=1000)  # b has 8 blocks
    before = expected_blocks_of(a, range(16))
    start = time.monotonic()
    with pytest.raises(MigrationError, match="src_block_ids: id 500 out of range") as info:
        a.pull(forged, [0, 500], [0, 1], timeout=20)
    assert time.monotonic() - start < 5, "a refusal must not wait for the deadline"
    assert info.value.remote_type == "ValueError"
    assert info.value.dst_block_ids == [0, 1]
    assert torch.equal(expected_blocks_of(a, range(16)), before)
    # The pair was discarded and is rebuilt: the next pull works.
    a.pull(b.descriptor(), [5], [9], timeout=20)
    assert torch.equal(expected_blocks_of(a, [9]), expected_blocks_of(b, [5]))


def test_stale_descriptor_is_refused(local_pair):
    a, b = local_pair
    stale = dataclasses.replace(b.descriptor(), endpoint_id="0" * 32)
    with pytest.raises(MigrationError, match="authentication failed"):
        a.pull(stale, [0], [0], timeout=10)


def test_mixed_protocol_versions_are_refused_at_hello(local_pair):
    """Two vllm-ext versions whose pairs would disagree (chunking, request formats) are refused
    before any transfer, and the source keeps serving."""
    a, b = local_pair
    desc = b.descriptor()
    conn = Connection(socket.create_connection((desc.host, desc.port), timeout=5), "test")
    try:
        conn.send(protocol.AuthHello(protocol.PROTOCOL - 1, "old" * 10, desc.endpoint_id, "00" * 32).header())
        with pytest.raises(MigrationError, match=f"migration protocol {protocol.PROTOCOL - 1} there"):
            conn.recv_reply(Deadline(5), "hello")
    finally:
        conn.close()
    a.pull(desc, [5], [6], timeout=30)
    assert torch.equal(expected_blocks_of(a, [6]), expected_blocks(dict(SPEC, seed=2, num_blocks=8), [5]))


def test_a_changed_descriptor_is_checked_again(local_pair):
    """The endpoint skips the checks for a descriptor object it already checked, never for
    another one naming the same peer."""
    a, b = local_pair
    desc = b.descriptor()
    a.pull(desc, [1], [2], timeout=30)
    bad = dataclasses.replace(desc, geometry=dict(desc.geometry, num_layers=3))
    before = expected_blocks_of(a, range(16))
    with pytest.raises(ValueError, match="geometry differs"):
        a.pull(bad, [1], [3], timeout=30)
    assert torch.equal(expected_blocks_of(a, range(16)), before)
    a.pull(desc, [3], [4], timeout=30)
    assert torch.equal(expected_blocks_of(a, [2, 4]),
                       expected_blocks(dict(SPEC, seed=2, num_blocks=8), [1, 3]))


def _transport(dst, src):
    """The socket family of dst's control connection to src."""
    return dst._destination._links[src.endpoint_id].conn.sock.family


@pytest.mark.skipif(not LOCAL_SOCKETS, reason="abstract Unix sockets are Linux-only")
def test_peers_of_one_host_talk_over_the_local_socket_else_tcp(local_pair):
    a, b = local_pair
    c = MigrationEndpoint(make_cache(dict(SPEC, seed=3)), backend="gloo", stripes=1)
    try:
        assert b.descriptor().local
        # A peer on another host (as the descriptor says) is reached over TCP only.
        a.pull(dataclasses.replace(b.descriptor(), hostname="another-host"), [5], [6], timeout=30)
        assert _transport(a, b) == socket.AF_INET
        # A local socket that does not answer (another network namespace): TCP.
        b.pull(dataclasses.replace(a.descriptor(), local="vllm-ext-migration-" + "0" * 32),
               [9], [2], timeout=30)
        assert _transport(b, a) == socket.AF_INET
        c.pull(b.descriptor(), [1, 7], [3, 4], timeout=30)
        assert _transport(c, b) == socket.AF_UNIX
        b8 = dict(SPEC, seed=2, num_blocks=8)
        assert torch.equal(expected_blocks_of(a, [6]), expected_blocks(b8, [5]))
        assert torch.equal(expected_blocks_of(b, [2]), expected_blocks(SPEC, [9]))
        assert torch.equal(expected_blocks_of(c, [3, 4]), expected_blocks(b8, [1, 7]))
    finally:
        c.close()


def _wait_for(predicate, seconds=10.0):
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.05)
    return predicate()


def test_the_reaper_releases_idle_links_of_departed_or_talking_peers_and_ends_with_its_endpoint(local_pair):
    a, b = local_pair
    c = MigrationEndpoint(make_cache(dict(SPEC, seed=3)), backend="gloo", stripes=1)
    try:
        a.pull(b.descriptor(), [1], [2], timeout=30)
        a.pull(c.descriptor(), [3], [4], timeout=30)
        assert a._destination._reaper.is_alive() and set(a._destination._links) == {b.endpoint_id, c.endpoint_id}
        c.close()  # a departed peer: its link goes
        assert _wait_for(lambda: c.endpoint_id not in a._destination._links), "the closed peer's link was kept"
        time.sleep(1.5)  # more passes: the idle, healthy link stays
        assert b.endpoint_id in a._destination._links
        # A message between pulls (a late failure report) would be misread by the next pull:
        # the link goes, and the next pull connects again.
        (served,) = b._server._connections
        served.send({"ok": False, "async": True, "type": "MigrationError", "error": "late"})
        assert _wait_for(lambda: b.endpoint_id not in a._destination._links), "a link with a stale message was kept"
        a.pull(b.descriptor(), [5], [6], timeout=30)
        assert torch.equal(expected_blocks_of(a, [2, 6]),
                           expected_blocks(dict(SPEC, seed=2, num_blocks=8), [1, 5]))
        reaper = a._destination._reaper
        a.close()
        assert not reaper.is_alive()
        with pytest.raises(ClosedError, match="endpoint is closed"):
            a._destination._register(b.descriptor(), "pull from")  # no link can be made once closed
    finally:
        c.close()


def test_a_pull_that_waited_for_a_link_disconnected_meanwhile_takes_a_new_one(local_pair):
    a, b = local_pair
    desc = b.descriptor()
    old = a._destination._register(desc, "pull from")
    old.lock.acquire()  # a pull in progress holds the link
    got = {}

    def second_pull():
        with a._destination._locked(desc, Deadline(10), "pull from", [0]) as link:
            got.update(link=link, locked=link.lock.locked())

    waiter = threading.Thread(target=second_pull)
    waiter.start()
    time.sleep(0.2)  # the second pull waits for the lock
    with a._destination._lock:  # the link is disconnected before the first pull lets go
        del a._destination._links[desc.endpoint_id]
    old.lock.release()
    waiter.join(10)
    new = got["link"]
    assert new is not old and a._destination._links[desc.endpoint_id] is new and got["locked"]
    assert not new.lock.locked()  # released when the block ended
    a.pull(desc, [2], [3], timeout=30)  # and the pull goes through on it
    assert torch.equal(expected_blocks_of(a, [3]), expected_blocks(dict(SPEC, seed=2, num_blocks=8), [2]))


def test_a_pull_that_outlasts_close_releases_its_link_when_it_ends(local_pair, monkeypatch):
    from vllm_ext.migration import endpoint as endpoint_mod

    monkeypatch.setattr(endpoint_mod, "_CLOSE_WAIT_S", 0.3)
    a, b = local_pair
    a.pull(b.descriptor(), [0], [0], timeout=30)  # the pair exists
    link = a._destination._links[b.endpoint_id]
    b._context.faults = StallFaults()
    b._context.faults.stall(0, 1.5)  # the next pull's first chunk waits 1.5 s at the source
    out = {}
    puller = threading.Thread(target=lambda: out.update(stats=a.pull(b.descriptor(), [1], [1], timeout=30)))
    puller.start()
    time.sleep(0.3)
    start = time.monotonic()
    a.close()  # gives up waiting for the pull after 0.3 s
    assert time.monotonic() - start < 1.2 and puller.is_alive()
    puller.join(20)
    assert out["stats"].num_blocks == 1  # the pull itself completed
    assert link.conn is None and link.pair is None, "the link outlived its closed endpoint"


def test_unreachable_peer_raises_migration_error(local_pair):
    a, b = local_pair
    desc = b.descriptor()
    b.close()
    start = time.monotonic()
    with pytest.raises(MigrationError, match="cannot connect"):
        a.pull(desc, [0], [0], timeout=5)
    assert time.monotonic() - start < 6


def test_connect_refuses_bad_peers_and_keeps_nothing_after_a_failure(local_pair, monkeypatch):
    a, b = local_pair
    with pytest.raises(TypeError, match="peer: expected PeerDescriptor"):
        a.connect("not a descriptor")
    other = MigrationEndpoint(make_cache(dict(SPEC, head_size=8)), backend="gloo", stripes=1)
    try:
        with pytest.raises(ValueError, match="peer: cache geometry differs"):
            a.connect(other.descriptor())
    finally:
        other.close()
    with pytest.raises(ValueError, match="timeout"):
        a.connect(b.descriptor(), timeout=-1)
    with pytest.raises(ValueError, match="peer: is this endpoint itself"):
        a.connect(a.descriptor())
    assert not a._destination._links, "a refused connect made a link"
    desc = b.descriptor()
    # The source refuses the pair after the control connection is up: MigrationError with
    # the source's exception type, and nothing kept for that peer; a later connect works.
    original = b.backend._serve_connect

    def refuse(session, request):
        raise ValueError("no pairs today")

    monkeypatch.setattr(b.backend, "_serve_connect", refuse)
    with pytest.raises(MigrationError, match="connect to .*no pairs today") as info:
        a.connect(desc, timeout=10)
    assert info.value.remote_type == "ValueError" and info.value.dst_block_ids is None
    assert info.value.peer == desc.endpoint_id
    assert desc.endpoint_id not in a._destination._links, "a failed connect kept its link"
    assert a.disconnect(desc) is False  # nothing held
    monkeypatch.setattr(b.backend, "_serve_connect", original)
    assert a.connect(desc, timeout=10) is True
    assert a.connect(desc, timeout=10) is False
    # The peer leaves: connect does not report its dead pair as built, it builds again (and
    # fails: the peer is gone), and keeps nothing.
    b.close()
    start = time.monotonic()
    with pytest.raises(MigrationError, match="connect to .*cannot connect") as info:
        a.connect(desc, timeout=5)
    assert time.monotonic() - start < 6
    assert desc.endpoint_id not in a._destination._links, "a failed connect kept its link"
    a.close()
    with pytest.raises(ClosedError, match="connect: this endpoint is closed"):
        a.connect(desc)


def test_a_connect_that_close_overtakes_raises_and_keeps_nothing(local_pair, monkeypatch):
    a, b = local_pair
    build = a.backend.connect
    closer = threading.Thread(target=a.close)

    def build_then_close(link, deadline):
        build(link, deadline)
        closer.start()  # close() marks the endpoint closed, then waits for this call's link
        end = time.monotonic() + 5
        while not a._closed and time.monotonic() < end:
            time.sleep(0.01)

    monkeypatch.setattr(a.backend, "connect", build_then_close)
    with pytest.raises(MigrationError, match="this endpoint closed meanwhile"):
        a.connect(b.descriptor(), timeout=10)
    closer.join(10)
    assert not closer.is_alive()
    assert not a._destination._links or all(link.conn is None for link in a._destination._links.values())


def test_other_rejections(local_pair):
    a, b = local_pair
    with pytest.raises(TypeError, match="peer: expected PeerDescriptor"):
        a.pull({"host": "x"}, [0], [0])
    with pytest.raises(ValueError, match="peer: is this endpoint itself"):
        a.pull(a.descriptor(), [0], [1])
    other_backend = dataclasses.replace(b.descriptor(), backend="rayrpc")
    with pytest.raises(ValueError, match="peer: uses backend 'rayrpc', this endpoint uses 'gloo'"):
        a.pull(other_backend, [0], [0])
    assert a.pull(b.descriptor(), [], []).nbytes == 0
    with pytest.raises(ValueError, match="backend: unknown backend 'tcp'"):
        MigrationEndpoint(a.cache, backend="tcp")
    with pytest.raises(ValueError, match="backend: unknown backend"):
        get_backend_class("NCCL")
    with pytest.raises(TypeError, match="cache: expected vllm_ext.KVCache"):
        MigrationEndpoint(torch.zeros(4), backend="gloo")
    with pytest.raises(TypeError, match="unexpected keyword argument .stripe."):
        MigrationEndpoint(a.cache, backend="gloo", stripe=2)
    with pytest.raises(ValueError, match="stripes: must be in 1..8"):
        MigrationEndpoint(a.cache, backend="gloo", stripes=0)
    from vllm_ext.migration.nccl import NcclBackend  # its options are checked before any GPU use

    for bad, message in (({"lanes": 0}, "lanes: must be 1 to 8"), ({"lanes": 9}, "lanes: must be 1 to 8"),
                         ({"chunk_bytes": 0}, "chunk_bytes: must be positive"),
                         ({"copy_ctas": -1}, "copy_ctas: must be 0")):
        with pytest.raises(ValueError, match=message):
            NcclBackend(None, **bad)
    for backend in ("ipc", "nccl"):
        ok, _ = get_backend_class(backend).is_available()
        if ok:  # with a GPU: a CPU cache is refused
            with pytest.raises(ValueError, match="cache: on cpu"):
                MigrationEndpoint(a.cache, backend=backend)
        else:
            with pytest.raises(RuntimeError, match="not available"):
                MigrationEndpoint(a.cache, backend=backend)
    a.close()
    with pytest.raises(ClosedError, match="endpoint is closed"):
        a.pull(b.descriptor(), [0], [0])


def test_descriptor_is_small_and_picklable(local_pair):
    import pickle

    a, _ = local_pair
    desc = a.descriptor()
    assert isinstance(desc, PeerDescriptor)
    data = pickle.dumps(desc)
    assert pickle.loads(data) == desc
    assert len(data) < 1024


# ---- control channel and packaging ------------------------------------------------------------
def test_control_channel_round_trips_in_order():
    def echo(conn):
        while True:
            try:
                header, payload = conn.recv()
            except EOFError:
                return
            conn.reply_ok(n=len(payload), i=header["i"], first=payload[:1].hex())

    server = _server(echo)
    try:
        conn = _open(server)
        rng = random.Random(3)
        for i in range(200):
            payload = bytes([i % 256]) * rng.randint(1, 4096)
            conn.send({"op": "echo", "i": i}, payload)
            reply = conn.recv_reply(Deadline(5), "ping")
            assert (reply["n"], reply["i"], reply["first"]) == (len(payload), i, payload[:1].hex())
        conn.close()
    finally:
        server.close()


@pytest.mark.skipif(not LOCAL_SOCKETS, reason="abstract Unix sockets are Linux-only")
def test_control_server_serves_tcp_and_its_local_socket_and_closes_both():
    def echo(conn):
        while True:
            try:
                header, _ = conn.recv()
            except EOFError:
                return
            conn.reply_ok(i=header["i"])

    name = f"vllm-ext-test-{os.getpid()}-{random.getrandbits(32)}"
    server = _server(echo, local=name)
    try:
        assert server.local == name
        for local, family in (("", socket.AF_INET), (name, socket.AF_UNIX)):
            conn = _open(server, local)
            assert conn.sock.family == family
            for i in range(3):
                conn.send({"op": "ping", "i": i})
                assert conn.recv_reply(Deadline(5), "ping")["i"] == i
            conn.close()
    finally:
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 4, "an accept thread did not end"
    probe = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError):  # the name is free again: nothing listens
        probe.connect("\0" + name)
    probe.close()


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
def test_rayrpc_chunk_views_round_trip(contiguous):
    """The host source hands Ray zero-copy views of its chunks; the destination reads them as
    rows (one view when Ray stored them back to back, else one copy): the bytes of gather."""
    np = pytest.importorskip("numpy")
    from vllm_ext import ops
    from vllm_ext.migration.rayrpc import _as_rows, _chunk_views

    spec = {"num_layers": 3, "num_blocks": 9, "block_size": 4, "num_kv_heads": 2, "head_size": 8,
            "dtype": "bfloat16", "layout": "flashinfer", "seed": 5}
    cache = make_cache(spec)
    ids = [7, 2, 2, 5]
    views = _chunk_views(cache, ids)
    assert len(views) == len(ids) * cache.num_layers * cache.num_components
    if contiguous:  # what Ray's object store returns: the chunks back to back
        store = np.concatenate(views)
        views = np.split(store, len(views))
    rows = _as_rows(views, len(ids), cache)
    assert torch.equal(rows, ops.gather_blocks(cache, ids))
    assert (rows.data_ptr() == views[0].ctypes.data) == contiguous
    with pytest.raises(MigrationError, match="chunks"):
        _as_rows(views[:-1], len(ids), cache)


def test_control_channel_deadline_and_eof():
    release = threading.Event()

    def silent(conn):
        release.wait(10)

    server = _server(silent)
    try:
        conn = _open(server)
        conn.send({"op": "ping"})
        start = time.monotonic()
        with pytest.raises(MigrationError, match="no answer within the deadline"):
            conn.recv(Deadline(0.3))
        assert 0.25 < time.monotonic() - start < 5
        release.set()
        with pytest.raises(MigrationError, match="connection closed by the peer"):
            conn.recv(Deadline(5))
        conn.close()
    finally:
        server.close()


def test_a_send_to_a_peer_that_stopped_reading_ends_at_the_deadline():
    release = threading.Event()
    server = _server(lambda conn: release.wait(20))  # never reads
    try:
        conn = _open(server)
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1  # TCP: keepalive
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        payload = bytes(16 << 20)  # far more than the socket buffers hold: the send must wait
        start = time.monotonic()
        with pytest.raises(MigrationError, match="did not take .* bytes within"):
            conn.send({"op": "ping"}, payload, Deadline(0.5))
        assert time.monotonic() - start >= 0.5  # the deadline, not the host's speed, ended it
        with pytest.raises(MigrationError, match="passed before the send"):
            conn.send_bytes(b"x", Deadline(1e-9))
        conn.close()
    finally:
        release.set()
        server.close()


def test_the_accept_loop_survives_a_failed_accept():
    got = queue_mod.Queue()
    server = _server(lambda conn: got.put(conn.recv(Deadline(5))[0]))
    ours, theirs = socket.socketpair()
    go_on = threading.Event()

    class Listener:  # the first accept fails (out of descriptors), the next one works
        calls = 0

        def accept(self):
            self.calls += 1
            if self.calls == 1:
                raise OSError(24, "Too many open files")
            if self.calls == 2:
                return theirs, "local"
            go_on.wait(10)
            raise OSError(9, "Bad file descriptor")  # the server closed its listener

    loop = threading.Thread(target=server._accept_loop, args=(Listener(),), daemon=True)
    try:
        loop.start()
        client = Connection(ours, "test")
        control._authenticate_client(client, Deadline(5), "c" * 32, SERVER_ID, TEST_SECRET)
        client.send({"op": "hello-after-a-failed-accept"})
        assert got.get(timeout=10) == {"op": "hello-after-a-failed-accept"}
    finally:
        server.close()
        go_on.set()
        loop.join(10)
        ours.close()
    assert not loop.is_alive()


def test_closed_by_peer_never_blocks():
    """A receive with a deadline leaves a timeout on the socket; the liveness check must still
    answer at once (it once waited out that timeout and then reported the peer as gone)."""
    release = threading.Event()

    def holder(conn):
        conn.recv()  # the hello below
        conn.reply_ok()
        release.wait(10)

    server = _server(holder)
    try:
        conn = _open(server)
        conn.send({"op": "hello"})
        conn.recv_reply(Deadline(30), "hello")  # leaves a ~30 s timeout on the socket
        start = time.monotonic()
        assert not conn.closed_by_peer()
        assert not conn.readable()
        assert time.monotonic() - start < 5, "the check waited out the socket timeout (30 s)"
        release.set()
        end = time.monotonic() + 5
        while not conn.closed_by_peer():
            assert time.monotonic() < end, "the closed connection was never noticed"
            time.sleep(0.01)
        conn.close()
    finally:
        server.close()


def test_server_failure_reaches_the_peer_as_an_error():
    """An exception on the serving side is reported to the peer, not a silent close."""

    def failing(conn):
        conn.recv()
        raise RuntimeError("boom in the server")

    server = _server(failing)
    try:
        conn = _open(server)
        conn.send({"op": "ping"})
        with pytest.raises(MigrationError, match="RuntimeError: .*boom in the server"):
            conn.recv_reply(Deadline(5), "ping")
        conn.close()
    finally:
        server.close()


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
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r})\n"
            "from test_migration_harness import make_cache\n"
            "from vllm_ext.migration import MigrationEndpoint\n"
            f"spec = {SPEC!r}\n"
            "b = MigrationEndpoint(make_cache(dict(spec, seed=2)), backend='gloo', stripes=1)\n"
            "a = MigrationEndpoint(make_cache(spec), backend='gloo', stripes=1)\n"
            "a.pull(b.descriptor(), [1, 5], [1, 2], timeout=30)\n"
            "a.close()\n"
            "b.close()\n"
            "print('closed')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
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


def test_spin_until_readable_sees_a_message_or_eof_and_leaves_it():
    """The server's poll after a pull: True once a message (or EOF) waits, without consuming
    it; False when the window passes with nothing."""
    got = queue_mod.Queue()

    def echo_later(conn):
        header, _ = conn.recv()
        got.put(header)
        time.sleep(0.2)
        conn.reply_ok(seen=header["op"])

    server = _server(echo_later)
    try:
        conn = _open(server)
        assert conn.spin_until_readable(0.01) is False  # nothing sent yet
        conn.send({"op": "ping"})
        assert got.get(timeout=5) == {"op": "ping"}
        assert conn.spin_until_readable(5.0) is True  # the reply, after ~0.2 s
        assert conn.recv_reply(Deadline(5), "ping")["seen"] == "ping"  # still there to read
        server.close()
        assert conn.spin_until_readable(5.0) is True  # EOF counts: the caller's recv reports it
        conn.close()
    finally:
        server.close()


def test_public_ops_route_only_short_id_lists_to_inline_launches():
    """Python lists of up to 448 ids for a GPU copy travel in the launch; tensors, CPU copies
    and longer lists go through device memory. The ids' types are checked either way."""
    from vllm_ext import _lib, ops

    gpu = torch.device("cuda", 0)  # the routing is decided before anything touches a GPU
    assert ops._inline_ids(torch.tensor([1, 2]), "ids", 10, gpu, unique=False) is None
    assert ops._inline_ids([1, 2], "ids", 10, torch.device("cpu"), unique=False) is None
    long = list(range(_lib.MAX_INLINE_IDS + 1))
    assert ops._inline_ids(long, "ids", len(long), gpu, unique=True) is None
    with pytest.raises(TypeError, match="ids: True is not an int"):
        ops._inline_ids(long[:-1] + [True], "ids", len(long), gpu, unique=True)
