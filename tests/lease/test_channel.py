"""The lease channel on its own (no vLLM): a LeaseServer serving a handler to LeaseClients, its
protocol version apart from the endpoint's, the typed messages' checks, refusals, malformed
replies, and a settled trace asked on a connection of its own."""

import random
import socket
import threading
import time

import pytest

from vllm_ext.lease import (
    LEASE_PROTOCOL,
    ChannelError,
    ChannelRefused,
    LeaseClient,
    LeaseServer,
    RequestEnded,
    messages,
)
from vllm_ext.migration import MigrationError, control, protocol
from vllm_ext.migration.control import Connection, open_connection
from vllm_ext.migration.timing import Deadline

SECRET = b"secret-of-the-lease-channel-tests"


def _hex(rng, nbytes):
    return rng.randbytes(nbytes).hex()


@pytest.fixture
def served():
    """(start(handler) -> LeaseServer); every server started is closed after the test."""
    servers = []

    def start(handler):
        server = LeaseServer(SECRET, handler)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _client(server, secret=SECRET, timeout_s=5.0):
    return LeaseClient(secret, server.host, server.port, timeout_s)


def test_acquire_and_release_round_trip_the_blocks_and_digests(served):
    rng = random.Random()
    lease = _hex(rng, 16)
    blocks = rng.sample(range(1 << 20), rng.randint(1, 300))
    digests = [rng.randrange(-(1 << 63), 1 << 63) for _ in blocks]
    num_tokens, hash_ = 16 * len(blocks) - rng.randint(0, 15), _hex(rng, 32)
    seen = []

    def handler(request):
        seen.append(request)
        if isinstance(request, messages.LeaseAcquire):
            return (messages.LeaseAcquireReply(len(blocks), num_tokens, hash_, len(digests)),
                    protocol.encode_ids(blocks + digests))
        return messages.LeaseReleaseReply(intact=False), b""

    client = _client(served(handler))
    try:
        assert client.acquire(lease, 7.5, 5, num_tokens, hash_) == (blocks, num_tokens, hash_, digests)
        assert client.release(lease, 5) is False
    finally:
        client.close()
    assert seen == [messages.LeaseAcquire(lease, 7.5, num_tokens, hash_), messages.LeaseRelease(lease)]


def test_precopy_returns_a_typed_lease(served):
    rng = random.Random()
    blocks, tokens = rng.sample(range(5000), 5), [rng.randrange(50000) for _ in range(77)]
    reply = messages.MigrateLeaseReply(lease=_hex(rng, 16), n=5, num_tokens=77, n_tokens=77, num_prompt_tokens=40,
                                       block_size=16, prompt_hash=_hex(rng, 32), fingerprint=_hex(rng, 16),
                                       endpoint_id="e" * 32, backend="gloo", lease_s=30.0)
    mid = _hex(rng, 16)
    client = _client(served(lambda request: (reply, protocol.encode_ids(blocks + tokens))))
    try:
        got = client.precopy(mid)
    finally:
        client.close()
    assert (got.block_ids, got.token_ids, got.n, got.lease, got.num_prompt_tokens, got.block_size) == (
        blocks, tokens, 5, reply.lease, 40, 16)
    with pytest.raises(AttributeError):
        got.lease = "x"  # frozen


def test_a_malformed_reply_is_a_channel_error(served):
    rng = random.Random()
    reply = messages.MigrateLeaseReply(lease=_hex(rng, 16), n=3, num_tokens=40, n_tokens=40, num_prompt_tokens=40,
                                       block_size=16, prompt_hash=_hex(rng, 32), fingerprint=_hex(rng, 16),
                                       endpoint_id="e" * 32, backend="gloo", lease_s=30.0)
    client = _client(served(lambda request: (reply, protocol.encode_ids([1, 2, 3]))))  # the 40 token ids missing
    try:
        with pytest.raises(ChannelError, match="malformed reply: payload of 24 bytes for 3 \\+ 40 ids"):
            client.precopy(_hex(rng, 16))
    finally:
        client.close()


def test_a_refusal_carries_its_kind_and_the_channel_stays_usable(served):
    def handler(request):
        if isinstance(request, messages.MigratePrecopy):
            raise RequestEnded("the request ended here")
        return None, b""

    client = _client(served(handler))
    try:
        with pytest.raises(ChannelRefused, match="the request ended here") as refused:
            client.precopy("0" * 32)
        assert refused.value.kind == "RequestEnded"
        client.end("0" * 32)  # a plain ok, on the same connection
    finally:
        client.close()


def test_the_server_refuses_an_endpoints_requests_and_bad_fields_by_name(served):
    server = served(lambda request: (None, b""))
    conn = open_connection(server.host, server.port, "", Deadline(5), client_id="c" * 32,
                           server_id=messages.LEASE_SERVER_ID, secret=SECRET, version=LEASE_PROTOCOL)
    try:
        conn.send_message(protocol.GlooPull(1, 5.0), b"", Deadline(5))
        with pytest.raises(MigrationError, match="unknown request 'gloo.pull'"):
            conn.recv_reply(Deadline(5), "gloo.pull")
    finally:
        conn.close()
    client = _client(server)
    try:
        with pytest.raises(ChannelRefused, match="hold_s: expected a number in \\(0, 3600\\]"):
            client.acquire("0" * 32, 1e9, 5, 1, "0" * 64)
        with pytest.raises(ChannelRefused, match="migration_id: expected 16 bytes as hex"):
            client.end("zz")
    finally:
        client.close()


def test_the_lease_channel_speaks_its_own_version():
    """A peer speaking the endpoint's number where it differs, or any other, is refused with
    both named; the lease channel never shares a registry with an endpoint."""
    server = LeaseServer(SECRET, lambda request: (None, b""))
    try:
        with pytest.raises(MigrationError, match=f"lease channel protocol {LEASE_PROTOCOL + 1} there, "
                                                 f"{LEASE_PROTOCOL} here"):
            open_connection(server.host, server.port, "", Deadline(5), client_id="c" * 32,
                            server_id=messages.LEASE_SERVER_ID, secret=SECRET, version=LEASE_PROTOCOL + 1)
    finally:
        server.close()
    assert set(messages.LEASE_REQUESTS).isdisjoint(protocol.REQUESTS)


def test_a_wrong_secret_reaches_nothing(served):
    calls = []
    client = _client(served(lambda request: calls.append(request) or (None, b"")),
                     secret=b"another-secret-of-sixteen-bytes-or-more")
    try:
        with pytest.raises(ChannelError, match="did not prove it holds the secret"):
            client.describe()
    finally:
        client.close()
    assert calls == []


def test_a_settled_trace_waits_on_a_connection_of_its_own(served):
    """While a trace waits for the destination's step, the client's own connection serves
    other requests."""
    release, connections = threading.Event(), set()
    trace = messages.MigrateTraceReply(1.0, 2.0, 3.0, unsafe=False, settled=True, load_failed=False)

    def handler(request):
        connections.add(threading.current_thread().name)
        if isinstance(request, messages.MigrateTrace) and request.wait_s:
            assert release.wait(10)
            return trace, b""
        return None, b""

    client = _client(served(handler))
    got = []
    waiter = threading.Thread(target=lambda: got.append(client.settled_trace("a" * 32, 10.0)))
    try:
        waiter.start()
        client.end("a" * 32)  # answered while the trace waits
        release.set()
        waiter.join(15)
    finally:
        client.close()
    assert got == [trace]


def test_messages_refuse_missing_extra_and_mistyped_fields():
    good = messages.LeaseDescribeReply({}, "0" * 32, {}, "torch-2", 0, 1000).header()
    assert messages.LeaseDescribeReply.parse(dict(good)) == messages.LeaseDescribeReply({}, "0" * 32, {}, "torch-2",
                                                                                        0, 1000)
    for header, match in (({k: v for k, v in good.items() if k != "sampler"}, "missing sampler"),
                          (dict(good, spare=1), "unexpected spare"),
                          (dict(good, max_tokens_cap=-1), "max_tokens_cap: expected an integer"),
                          (dict(good, descriptor={"x": "y" * (messages.MAX_DESCRIBE_BYTES + 1)}), "descriptor")):
        with pytest.raises(protocol.ProtocolError, match=match):
            messages.LeaseDescribeReply.parse(header)


def test_an_unauthenticated_request_is_refused_and_never_reaches_the_handler(served):
    calls = []
    server = served(lambda request: calls.append(request) or (messages.LeaseDescribeReply(
        {"endpoint_id": "e" * 32}, "0" * 32, {}, "", 0, 0), b""))
    conn = Connection(socket.create_connection((server.host, server.port), timeout=5), "test")
    try:
        conn.send(messages.LeaseDescribe().header())
        with pytest.raises(MigrationError, match="refused: MigrationError: authentication failed$"):
            conn.recv_reply(Deadline(5), "describe")
    finally:
        conn.close()
    assert calls == []


def test_a_peer_with_the_secret_gets_in_during_a_flood_of_silent_connections(served):
    """Silent connections without the secret, reopened as the server drops them, must not
    keep an authenticated peer out: the server evicts the flood's oldest connections for
    newcomers, and a peer that authenticates at once gets in."""
    server = served(lambda request: (messages.LeaseDescribeReply({}, "0" * 32, {}, "", 0, 0), b""))
    stop, opened = threading.Event(), [0]

    def flood():
        while not stop.is_set():
            try:
                sock = socket.create_connection((server.host, server.port), timeout=5)
            except OSError:
                continue
            opened[0] += 1
            sock.settimeout(0.2)
            with sock:
                while not stop.is_set():  # silent until the server drops it, then again
                    try:
                        if not sock.recv(1):
                            break
                    except socket.timeout:
                        continue
                    except OSError:
                        break

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(3 * control._MAX_UNAUTHENTICATED)]
    for thread in flooders:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.connection_count()[1] < control._MAX_UNAUTHENTICATED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connection_count()[1] >= control._MAX_UNAUTHENTICATED  # the flood holds every slot
        got_in = 0
        for _ in range(20):
            client = _client(server, timeout_s=10)
            try:
                client.describe()
                got_in += 1
            except ChannelError:
                pass
            finally:
                client.close()
    finally:
        stop.set()
        for thread in flooders:
            thread.join(10)
    assert got_in == 20, f"{got_in} of 20 authenticated connects got in during a flood of {opened[0]} connections"
