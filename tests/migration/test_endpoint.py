"""MigrationEndpoint in one process: every rejection before contact, peers that disagree, the
local socket, the reaper of idle links, link hand-overs, and close()."""

import dataclasses
import socket
import threading
import time

import pytest
import torch

from tests.helpers.migration_harness import StallFaults, expected_blocks, make_cache
from tests.helpers.specs import SMALL_SPEC
from vllm_ext.migration import (
    ClosedError,
    MigrationEndpoint,
    MigrationError,
    PeerDescriptor,
    get_backend_class,
    protocol,
)
from vllm_ext.migration.control import LOCAL_SOCKETS, Connection
from vllm_ext.migration.timing import Deadline

SPEC = SMALL_SPEC  # in one process: rejections never reach a transfer


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
    from tests.helpers.migration_harness import block_rows

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
        # A descriptor that lies about the geometry is refused by the source itself: at hello,
        # or, for a head count alone (caches that pair for head ranges), at the whole-block pull.
        forged = dataclasses.replace(b.descriptor(), geometry=a.cache.geometry())
        refusal = ("gloo pull: whole blocks of 4 KV heads for a cache of 2; name a head range"
                   if key == "num_kv_heads" else "hello: cache geometry differs")
        with pytest.raises(MigrationError, match=refusal) as info:
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




def test_a_bug_inside_a_backend_keeps_its_type_and_drops_the_link(local_pair):
    """A failure of the transfer is a MigrationError; a bug (here a KeyError) is not dressed up
    as one, and still leaves nothing behind."""
    a, b = local_pair
    desc = b.descriptor()
    a.pull(desc, [1], [1], timeout=30)
    link = a._destination._links[desc.endpoint_id]

    def broken(src, dst, deadline):
        raise KeyError("a bug")

    link.pair.pull = broken
    with pytest.raises(KeyError, match="a bug"):
        a.pull(desc, [2], [2], timeout=30)
    assert desc.endpoint_id not in a._destination._links
    a.pull(desc, [3], [3], timeout=30)  # a new link, a new pair
    assert torch.equal(expected_blocks_of(a, [3]), expected_blocks(dict(SPEC, seed=2, num_blocks=8), [3]))
