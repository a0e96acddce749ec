"""The control plane as an attacker meets it: a raw-socket client against a serving endpoint
(gloo, CPU, loopback). Nothing is served before authentication, nothing is disclosed but the
protocol version, every resource a peer can make the source allocate is bounded, and every wait
has a deadline. Also: the secret rules (deployment secret, descriptor capability)."""

import os
import resource
import secrets
import socket
import struct
import threading
import time

import pytest
import torch

from vllm_ext import KVCache, ops
from vllm_ext.migration import ClosedError, MigrationEndpoint, MigrationError, control, protocol
from vllm_ext.migration.auth import ENV_SECRET, ENV_SECRET_FILE

SECRET = b"test-deployment-secret-0123456789"
GLOO = {"stripes": 1, "chunk_bytes": 64 << 10}


def make_cache(seed=0, num_blocks=32):
    cache = KVCache.allocate(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_size=16,
                             dtype=torch.float16, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return cache


@pytest.fixture
def source(monkeypatch):
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    ep = MigrationEndpoint(make_cache(1), "gloo", **GLOO)
    yield ep
    ep.close()


class RawClient:
    """A peer that speaks the frames of protocol.py by hand."""

    def __init__(self, desc, timeout=5.0):
        self.sock = socket.create_connection((desc.host, desc.port), timeout=timeout)
        self.desc = desc

    def send(self, header, payload=b""):
        self.sock.sendall(protocol.encode_frame(header, payload))

    def recv(self):
        """The next message, or None when the server closed the connection."""
        head = self._exact(protocol.FRAME.size)
        if head is None:
            return None
        header_len, payload_len = protocol.FRAME.unpack(head)
        body = self._exact(header_len + payload_len)
        return None if body is None else protocol.decode_header(body[:header_len])

    def closed(self, within=3.0):
        """True when the server closes the connection within `within` seconds (what it sent
        before is skipped)."""
        self.sock.settimeout(within)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except socket.timeout:
            return False
        except OSError:
            return True

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            try:
                data = self.sock.recv(n - len(buf))
            except (ConnectionResetError, socket.timeout):
                return None
            if not data:
                return None
            buf += data
        return buf

    def authenticate(self, secret, client_id="c" * 32):
        nonce = secrets.token_bytes(protocol.NONCE_BYTES)
        self.send(protocol.AuthHello(protocol.PROTOCOL, client_id, self.desc.endpoint_id, nonce.hex()).header())
        challenge = self.recv()
        assert challenge["ok"] is True, challenge
        proof = protocol.auth_proof(secret, "client", client_id, self.desc.endpoint_id, nonce,
                                    bytes.fromhex(challenge["nonce"]))
        self.send(protocol.AuthProof(proof.hex()).header())
        return nonce, challenge, proof

    def close(self):
        self.sock.close()


def assert_discloses_nothing(reply, desc):
    text = repr(reply)
    for secret_thing in (desc.endpoint_id, desc.endpoint_id[:8], "gloo", "num_blocks", "geometry",
                         str(desc.num_blocks), "head_size"):
        assert secret_thing not in text, (secret_thing, text)


def pull_works(source, timeout=10.0):
    """A legitimate destination still pulls from `source`, byte for byte."""
    dst = make_cache(2)
    with MigrationEndpoint(dst, "gloo", **GLOO) as ep:
        ep.pull(source.descriptor(), [3, 4, 5], [0, 1, 2], timeout=timeout)
    assert torch.equal(ops.gather_blocks(dst, [0, 1, 2]), ops.gather_blocks(source.cache, [3, 4, 5]))
    return True


@pytest.mark.parametrize("first", [
    {"op": "hello", "protocol": protocol.PROTOCOL, "backend": "gloo", "geometry": {}, "hostname": "x", "pid": 1},
    {"op": "gloo.connect", "store_port": 1, "gen": "g", "stripes": 1, "chunk_blocks": 1, "timeout": 1.0},
    {"op": "gloo.pull", "n": 1, "timeout": 1.0},
    {"op": "ipc.export"},
    {"op": "ping"},
], ids=["hello", "connect", "pull", "export", "ping"])
def test_unauthenticated_requests_are_refused_and_reveal_nothing(source, first):
    client = RawClient(source.descriptor())
    try:
        client.send(first, protocol.encode_ids([0]) if first["op"] == "gloo.pull" else b"")
        reply = client.recv()
        assert reply is None or reply["ok"] is False
        assert_discloses_nothing(reply, source.descriptor())
        assert client.closed()
    finally:
        client.close()
    assert pull_works(source)


def test_a_wrong_hello_address_or_version_reveals_only_the_version(source):
    desc = source.descriptor()
    client = RawClient(desc)
    client.send(protocol.AuthHello(protocol.PROTOCOL, "c" * 32, "f" * 32, "00" * protocol.NONCE_BYTES).header())
    reply = client.recv()
    assert reply["ok"] is False and client.closed()
    assert_discloses_nothing(reply, desc)
    client = RawClient(desc)
    client.send(protocol.AuthHello(protocol.PROTOCOL - 1, "c" * 32, desc.endpoint_id,
                                   "00" * protocol.NONCE_BYTES).header())
    reply = client.recv()
    versions = f"protocol {protocol.PROTOCOL - 1} there, {protocol.PROTOCOL} here"
    assert reply["ok"] is False and versions in reply["error"]
    assert_discloses_nothing(reply, desc)
    assert client.closed()


def test_a_wrong_secret_fails_both_ways(source, monkeypatch, caplog):
    monkeypatch.setenv(ENV_SECRET, "another-secret-of-sufficient-size")
    with MigrationEndpoint(make_cache(2), "gloo", **GLOO) as dst:
        with pytest.raises(MigrationError, match="did not prove it holds the secret"):
            dst.pull(source.descriptor(), [0], [0], timeout=5)
    # The server's side: a raw client that knows the descriptor but not the secret.
    client = RawClient(source.descriptor())
    client.authenticate(b"x" * 32)
    reply = client.recv()
    assert reply["ok"] is False and reply["error"] == "authentication failed"
    assert client.closed()
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


def test_a_replayed_handshake_fails(source):
    desc = source.descriptor()
    first = RawClient(desc)
    nonce, _, proof = first.authenticate(SECRET)
    assert first.recv()["ok"] is True  # the genuine exchange succeeds
    first.close()
    replay = RawClient(desc)  # the same hello and proof again: the server's nonce is new
    replay.send(protocol.AuthHello(protocol.PROTOCOL, "c" * 32, desc.endpoint_id, nonce.hex()).header())
    assert replay.recv()["ok"] is True
    replay.send(protocol.AuthProof(proof.hex()).header())
    assert replay.recv() == protocol.error_reply("MigrationError", "authentication failed")
    assert replay.closed()


@pytest.mark.parametrize("garbage", [b"\x00" * 3, os.urandom(4096), struct.pack("!II", 5, 0) + b"nojs!",
                                     struct.pack("!II", 2, 0) + b"[]"], ids=["short", "random", "not-json", "array"])
def test_garbage_closes_the_connection_and_serving_goes_on(source, garbage, monkeypatch):
    monkeypatch.setattr(control, "_AUTH_S", 1.0)
    client = RawClient(source.descriptor())
    client.sock.sendall(garbage)
    assert client.closed(within=5.0)
    assert pull_works(source)


def _rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("sizes", [(1 << 30, 0), (10, 1 << 30), (protocol.MAX_HEADER_BYTES + 1, 0)],
                         ids=["header", "payload", "header-limit"])
def test_a_huge_length_prefix_allocates_nothing(source, sizes):
    before = _rss_kib()
    clients = [RawClient(source.descriptor()) for _ in range(4)]
    for c in clients:
        c.sock.sendall(struct.pack("!II", *sizes))
    for c in clients:
        assert c.closed()
        c.close()
    assert _rss_kib() - before < 64 << 10  # far below one 1 GiB body
    assert pull_works(source)


def test_half_a_frame_then_silence_is_dropped(source, monkeypatch):
    monkeypatch.setattr(control, "_AUTH_S", 0.5)
    monkeypatch.setattr(control, "_FRAME_S", 0.5)
    client = RawClient(source.descriptor())
    frame = protocol.encode_frame(protocol.AuthHello(protocol.PROTOCOL, "c", "s", "00" * 32).header())
    client.sock.sendall(frame[:len(frame) // 2])
    assert client.closed(within=5.0)
    # After authentication too: a frame started and never finished.
    client = RawClient(source.descriptor())
    client.authenticate(SECRET)
    assert client.recv()["ok"] is True
    client.sock.sendall(protocol.FRAME.pack(50, 0) + b"{")
    assert client.closed(within=5.0)


def test_a_connection_flood_is_bounded(source, monkeypatch):
    monkeypatch.setattr(control, "_AUTH_S", 2.0)
    threads_before = threading.active_count()
    flood = [RawClient(source.descriptor()) for _ in range(3 * control._MAX_UNAUTHENTICATED)]
    try:
        time.sleep(0.5)
        served, authenticating = source._server.connection_count()
        assert authenticating <= control._MAX_UNAUTHENTICATED and served <= control._MAX_UNAUTHENTICATED
        assert threading.active_count() - threads_before <= control._MAX_UNAUTHENTICATED + 2
        refused = sum(c.closed(within=0.2) for c in flood)
        assert refused >= 2 * control._MAX_UNAUTHENTICATED - 2  # closed at once
    finally:
        for c in flood:
            c.close()
    deadline = time.monotonic() + 10
    while source._server.connection_count()[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pull_works(source)


def test_the_source_never_dials_an_address_a_request_names(source):
    third = socket.create_server(("127.0.0.2", 0))  # where an attacker would send the source
    third.settimeout(0.5)
    port = third.getsockname()[1]
    client = RawClient(source.descriptor())
    try:
        client.authenticate(SECRET)
        assert client.recv()["ok"] is True
        geometry = source.cache.geometry()
        client.send(protocol.Hello("gloo", geometry, "x", 1).header())
        assert client.recv()["ok"] is True
        named = dict(protocol.GlooConnect(port, "g", 1, 1, 1.0).header(), store_host="127.0.0.2")
        client.send(named)
        reply = client.recv()
        assert reply["ok"] is False and "unexpected store_host" in reply["error"]
        client.send(protocol.GlooConnect(port, "g", 1, 1, 1.0).header())  # the port, on our own address
        assert client.recv()["ok"] is True
        with pytest.raises(socket.timeout):
            third.accept()  # the source dialled 127.0.0.1 (this client's address), not 127.0.0.2
    finally:
        client.close()
        third.close()


@pytest.mark.parametrize("request_header, message", [
    (protocol.GlooConnect(1, "g", protocol.MAX_STRIPES + 1, 1, 1.0).header(), "stripes"),
    (protocol.GlooConnect(1, "g", 1, 1 << 30, 1.0).header(), "chunk_blocks"),
    ({"op": "gloo.connect", "store_port": 1, "gen": "g", "stripes": 1, "timeout": 1.0}, "missing chunk_blocks"),
    (dict(protocol.GlooPull(1, 1.0).header(), n=1 << 40), "n: expected an integer"),
    (protocol.GlooPull(1, float("inf")).header(), "timeout"),
    ({"op": "teleport"}, "unknown request"),
], ids=["stripes", "slot", "missing", "ids", "timeout", "unknown"])
def test_bounds_and_malformed_requests_are_refused_by_name(source, request_header, message):
    client = RawClient(source.descriptor())
    try:
        client.authenticate(SECRET)
        assert client.recv()["ok"] is True
        client.send(protocol.Hello("gloo", source.cache.geometry(), "x", 1).header())
        assert client.recv()["ok"] is True
        client.send(request_header)
        reply = client.recv()
        assert reply["ok"] is False and message in reply["error"], reply
    finally:
        client.close()


@pytest.mark.skipif(os.geteuid() != 0 or not control.LOCAL_SOCKETS,
                    reason="needs root (to become another user) and abstract Unix sockets")
def test_the_local_socket_refuses_another_user(source):
    desc = source.descriptor()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, then knock
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect("\0" + desc.local)
            try:
                sock.sendall(protocol.encode_frame(protocol.AuthHello(protocol.PROTOCOL, "c", desc.endpoint_id,
                                                                      "00" * 32).header()))
                got = sock.recv(1 << 16)
            except (BrokenPipeError, ConnectionResetError):  # closed before it read a byte
                got = b""
            os.write(write, b"closed" if got == b"" else b"answered")
        except BaseException as e:  # noqa: BLE001
            os.write(write, f"error {e}".encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    outcome = os.read(read, 200).decode()
    os.close(read)
    assert outcome == "closed", outcome
    assert pull_works(source)


def test_without_a_deployment_secret_the_descriptor_is_the_capability(monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    src = MigrationEndpoint(make_cache(1), "gloo", **GLOO)
    dst = MigrationEndpoint(make_cache(2), "gloo", **GLOO)
    try:
        desc = src.descriptor()
        assert len(desc.secret) == 64 and desc.secret not in repr(desc)
        dst.pull(desc, [1], [1], timeout=10)  # the holder of the descriptor may pull
        with pytest.raises(ValueError, match="carries no secret"):
            dst.pull(desc.without_secret(), [1], [1], timeout=10)
        forged = desc.without_secret().__class__(**dict(vars(desc), secret=secrets.token_hex(32)))
        dst.disconnect(desc)
        with pytest.raises(MigrationError, match="did not prove"):
            dst.pull(forged, [1], [1], timeout=10)
    finally:
        src.close()
        dst.close()


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    monkeypatch.setenv(ENV_SECRET_FILE, str(path))
    src = MigrationEndpoint(make_cache(1), "gloo", **GLOO)
    try:
        assert src.descriptor().secret == ""  # a deployment secret never travels
        monkeypatch.delenv(ENV_SECRET_FILE)
        with MigrationEndpoint(make_cache(2), "gloo", secret=SECRET, **GLOO) as dst:
            dst.pull(src.descriptor(), [2], [2], timeout=10)
        monkeypatch.setenv(ENV_SECRET, "short")
        with pytest.raises(ValueError, match=f"{ENV_SECRET}: a secret of 5 bytes") as info:
            MigrationEndpoint(make_cache(2), "gloo")
        assert "short" not in str(info.value)
    finally:
        src.close()


def test_a_closed_endpoint_raises_a_state_error(source):
    dst = MigrationEndpoint(make_cache(2), "gloo", **GLOO)
    dst.close()
    with pytest.raises(ClosedError):
        dst.pull(source.descriptor(), [0], [0])
    with pytest.raises(ClosedError):
        dst.connect(source.descriptor())


def test_refused_connections_leave_no_descriptors_behind(source):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        RawClient(source.descriptor()).close()
    time.sleep(0.5)
    assert len(os.listdir("/proc/self/fd")) <= fds + 4 < soft


# ---- TLS on TCP control connections -------------------------------------------------------------
def _certificates(folder):
    """A CA and two certificates it signs (one more from another CA), made with openssl."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    for ca in ("ca", "rogue"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    for name, ca in (("a", "ca"), ("b", "ca"), ("mallory", "rogue")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "1", "-out", f"{name}.pem")
    return lambda name, ca="ca": control.TlsOptions(str(folder / f"{name}.pem"), str(folder / f"{name}.key"),
                                                   str(folder / f"{ca}.pem"))


def test_tls_control_connections(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    tls = _certificates(tmp_path)
    # TCP only: the local socket is for peers of one user and stays plain.
    monkeypatch.setattr(control, "LOCAL_SOCKETS", False)
    src = MigrationEndpoint(make_cache(1), "gloo", tls=tls("a"), **GLOO)
    try:
        dst_cache = make_cache(2)
        with MigrationEndpoint(dst_cache, "gloo", tls=tls("b"), **GLOO) as dst:
            dst.pull(src.descriptor(), [4, 5], [6, 7], timeout=20)
            conn = next(iter(dst._destination._links.values())).conn
            assert conn.sock.version() is not None  # the connection is TLS
        assert torch.equal(ops.gather_blocks(dst_cache, [6, 7]), ops.gather_blocks(src.cache, [4, 5]))
        with MigrationEndpoint(make_cache(3), "gloo", **GLOO) as plain:  # no TLS: refused
            with pytest.raises(MigrationError):
                plain.pull(src.descriptor(), [1], [1], timeout=5)
        with MigrationEndpoint(make_cache(3), "gloo", tls=tls("mallory", "rogue"), **GLOO) as rogue:
            with pytest.raises(MigrationError, match="TLS"):
                rogue.pull(src.descriptor(), [1], [1], timeout=5)
    finally:
        src.close()


def test_tls_is_refused_where_the_backend_cannot_carry_it(tmp_path):
    tls = _certificates(tmp_path)
    with pytest.raises(ValueError, match="tls: not supported by the nccl backend"):
        MigrationEndpoint(make_cache(1), "nccl", tls=tls("a"))


# ---- serve="granted": a source serves only the blocks it granted ------------------------------
def test_a_source_serves_only_granted_blocks(monkeypatch):
    monkeypatch.setenv(ENV_SECRET, SECRET.decode())
    src = MigrationEndpoint(make_cache(1), "gloo", serve="granted", **GLOO)
    dst_cache = make_cache(2)
    dst = MigrationEndpoint(dst_cache, "gloo", **GLOO)
    try:
        desc = src.descriptor()
        with pytest.raises(MigrationError, match="block 3 is not granted by the source") as info:
            dst.pull(desc, [3], [0], timeout=10)
        assert info.value.remote_type == "ValueError"
        src.grant([3, 4, 4])
        dst.pull(desc, [4, 3], [0, 1], timeout=10)
        assert torch.equal(ops.gather_blocks(dst_cache, [0, 1]), ops.gather_blocks(src.cache, [4, 3]))
        src.revoke([3, 4])  # block 4 was granted twice: still served once more
        dst.pull(desc, [4], [2], timeout=10)
        with pytest.raises(MigrationError, match="block 3 is not granted"):
            dst.pull(desc, [3], [2], timeout=10)
        with pytest.raises(ValueError, match="block 3 revoked more often than granted"):
            src.revoke([4, 3])
        src.revoke([4])  # the failed revoke changed nothing: 4 is still granted once
        with pytest.raises(ValueError, match="block_ids: id 99 out of range"):
            src.grant([99])
        with pytest.raises(ValueError, match="serves every block"):
            dst.grant([0])
        with pytest.raises(ValueError, match="serve: 'all' or 'granted'"):
            MigrationEndpoint(make_cache(3), "gloo", serve="some")
        with pytest.raises(ValueError, match="not possible with the ipc backend"):
            MigrationEndpoint(make_cache(3), "ipc", serve="granted")
    finally:
        src.close()
        dst.close()
