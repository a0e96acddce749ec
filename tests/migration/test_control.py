"""The control channel: frames in order, TCP and the local socket, deadlines and EOF, sends to a
peer that stopped reading, the accept loop, liveness checks, server failures."""

import os
import queue as queue_mod
import random
import socket
import threading
import time

import pytest

from vllm_ext.migration import (
    MigrationError,
    control,
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




def test_a_connection_to_itself_is_refused_and_frees_the_port():
    """A client retrying a local port nobody listens on can connect to itself (TCP's simultaneous
    open) and hold the port its server is about to bind: refused and closed at once."""
    from vllm_ext.migration import control

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.connect(("127.0.0.1", port))  # nothing listens: Linux connects the socket to itself
    assert sock.getsockname() == sock.getpeername()
    with pytest.raises(ConnectionRefusedError, match="connected to itself"):
        control._refuse_self_connection(sock)
    assert sock.fileno() == -1
    server = socket.create_server(("127.0.0.1", port))  # the port is free again
    try:
        client = socket.create_connection(("127.0.0.1", port))
        control._refuse_self_connection(client)  # an ordinary connection passes
        client.close()
    finally:
        server.close()
