"""The library's pull server (the source side of nccl pulls) through its socket protocol, on
any host: a CUDA build of the library runs it without a GPU, so what it refuses, how it ends
and what it answers are tested here, and so is how the destination reads each answer; the GPU
suite moves data through it (test_migration_gpu.py)."""

import ctypes
import os
import socket
import struct
import time
from pathlib import Path

import pytest
import torch

from vllm_ext import _lib
from vllm_ext.migration import protocol

REQUEST, REPLY = protocol.PULL_REQUEST, protocol.PULL_REPLY  # the frames, from their one home
NUM_BLOCKS = 10

_TRANSFER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
                             ctypes.c_void_p, ctypes.c_void_p)
_NEVER_CALLED = _TRANSFER(lambda *args: 1)


def _side():
    """A placeholder cache side (no request here reaches it)."""
    return _lib.Side(layer_ptrs=0x1000, base=0, layer_stride=0, block_stride=64, component_stride=0,
                     num_blocks=NUM_BLOCKS, block_ids=None)


def lanes(count=2, **changes):
    """Placeholder SEND lanes (never enqueued here)."""
    fields = dict(direction=_lib.STAGE_SEND, max_ctas=0, slots=(ctypes.c_uint64 * 2)(0x2000, 0x3000),
                  slot_blocks=4, transfer=ctypes.cast(_NEVER_CALLED, ctypes.c_void_p).value, peer=0, datatype=0)
    return (_lib.Staging * count)(*[_lib.Staging(**dict(fields, **(changes if i else {}))) for i in range(count)])


def _serve(given_lanes, grants=None, heads=None):
    """(the destination's socket, the PullServer, its stall array) over a socket pair."""
    if not _lib.built_with_cuda():
        pytest.skip("the pull server is part of a CUDA build of the library")
    ours, theirs = socket.socketpair()
    stall = (ctypes.c_int64 * 2)(-1, 0)
    srv = _lib.PullServer(theirs.detach(), _side(), given_lanes, 1, 1, 64, 16, 0, 0x4000, grants, heads)
    srv.test_stall(stall)
    ours.settimeout(10)
    return ours, srv, stall


def _end(ours, srv):
    srv.stop()
    srv.destroy()
    ours.close()


@pytest.fixture
def server():
    """A pull server with placeholder sides and events: no request here reaches the GPU."""
    ours, srv, stall = _serve(lanes())
    yield ours, srv, stall
    _end(ours, srv)


def request(sock, ids, timeout=5.0, magic=protocol.PULL_REQUEST_MAGIC, heads=(0, 0)):
    sock.sendall(REQUEST.pack(magic, len(ids), timeout, *heads) + struct.pack(f"<{len(ids)}q", *ids))


def reply(sock):
    head = b""
    while len(head) < REPLY.size:
        chunk = sock.recv(REPLY.size - len(head))
        assert chunk, "the server closed the connection instead of replying"
        head += chunk
    magic, kind, length, _ = REPLY.unpack(head)
    assert magic == protocol.PULL_REPLY_MAGIC
    message = b""
    while len(message) < length:
        chunk = sock.recv(length - len(message))
        assert chunk, "the server closed the connection inside a reply"
        message += chunk
    return kind, message.decode()


def ended(srv, within=10.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        out = srv.wait(0.1)
        if out is not None:
            return out
    raise AssertionError("the pull server did not end")


def test_refuses_bad_requests_and_keeps_serving(server):
    sock, srv, _ = server
    for ids, timeout, expected in (([3, NUM_BLOCKS], 5.0, f"src_block_ids: id {NUM_BLOCKS} out of range for a "
                                    f"cache of {NUM_BLOCKS} blocks"),
                                   ([-1], 5.0, "src_block_ids: id -1 out of range"),
                                   ([1], 0.0, "timeout: must be a positive number"),
                                   ([1], float("nan"), "timeout: must be a positive number"),
                                   # slots of 4 blocks: 4 * 256 blocks make more than 256 chunks
                                   ([2] * (4 * _lib.PULL_MAX_CHUNKS), 5.0,
                                    f"{4 * _lib.PULL_MAX_CHUNKS} blocks make 258 chunks; a request holds at most "
                                    f"{_lib.PULL_MAX_CHUNKS} chunks")):
        request(sock, ids, timeout)
        kind, message = reply(sock)
        assert kind == protocol.PULL_REFUSED
        assert expected in message
    assert srv.wait(0.05) is None  # still serving
    sock.shutdown(socket.SHUT_WR)  # the destination leaves
    assert ended(srv) == (_lib.SERVER_PEER_CLOSED, "")


def test_a_server_with_grants_refuses_blocks_not_granted():
    grants = (ctypes.c_int32 * NUM_BLOCKS)()
    grants[3] = 1
    sock, srv, _ = _serve(lanes(), grants)
    try:
        request(sock, [3, 4])
        assert reply(sock) == (protocol.PULL_REFUSED, "src_block_ids: block 4 is not granted by the source")
        grants[3] = 0  # revoked: read at the next request
        request(sock, [3])
        assert reply(sock) == (protocol.PULL_REFUSED, "src_block_ids: block 3 is not granted by the source")
        assert srv.wait(0.05) is None  # refusals leave it serving
    finally:
        _end(sock, srv)


def test_a_malformed_request_ends_the_server(server):
    sock, srv, _ = server
    request(sock, [1], magic=0x12345678)
    kind, message = reply(sock)
    assert kind == protocol.PULL_FAILED and "malformed" in message
    reason, why = ended(srv)
    assert reason == _lib.SERVER_FAILED and "malformed" in why
    assert sock.recv(1) == b""  # and it closed the connection


def test_too_many_ids_is_malformed(server):
    sock, srv, _ = server
    sock.sendall(REQUEST.pack(protocol.PULL_REQUEST_MAGIC, protocol.PULL_MAX_IDS + 1, 5.0, 0, 0))
    assert reply(sock)[0] == protocol.PULL_FAILED
    assert ended(srv)[0] == _lib.SERVER_FAILED


def test_stop_ends_an_idle_server_and_the_peer_sees_it(server):
    sock, srv, _ = server
    assert srv.wait(0.05) is None
    srv.stop()
    assert ended(srv)[0] == _lib.SERVER_STOPPED
    assert sock.recv(1) == b""
    srv.stop()  # again: harmless


def test_a_frame_cut_short_ends_the_server(server):
    sock, srv, _ = server
    sock.sendall(REQUEST.pack(protocol.PULL_REQUEST_MAGIC, 3, 5.0, 0, 0) + struct.pack("<q", 1))
    sock.shutdown(socket.SHUT_WR)
    reason, why = ended(srv)
    assert reason == _lib.SERVER_PEER_CLOSED and "inside a request" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="a valid request would reach the GPU")
def test_a_valid_request_without_a_gpu_fails_cleanly(server):
    sock, srv, stall = server
    stall[0], stall[1] = 0, 1000  # the pause comes after the device check: not reached
    request(sock, [1, 2, 3])
    kind, message = reply(sock)
    assert kind == protocol.PULL_FAILED and "cudaSetDevice" in message
    reason, why = ended(srv)
    assert reason == _lib.SERVER_FAILED and "cudaSetDevice" in why


def test_refuses_a_request_of_more_ids_than_its_launches_may_carry():
    """Slots of 2^20 blocks: few chunks, but more ids than PULL_MAX_CHUNKS launches carry."""
    big = lanes(count=1)
    big[0].slot_blocks = 1 << 20
    ours, srv, _ = _serve(big)
    try:
        n = _lib.PULL_MAX_REQUEST_IDS + 1
        request(ours, [1] * n)
        kind, message = reply(ours)
        assert kind == protocol.PULL_REFUSED
        assert f"{n} blocks make 17 chunks; a request holds at most {_lib.PULL_MAX_CHUNKS} chunks and " \
               f"{_lib.PULL_MAX_REQUEST_IDS} ids" in message
        assert srv.wait(0.05) is None  # still serving
    finally:
        _end(ours, srv)


@pytest.mark.parametrize("bad", ["no lanes", "too many lanes", "a RECV lane", "unequal slots"])
def test_start_refuses_bad_lanes(bad):
    if not _lib.built_with_cuda():
        pytest.skip("the pull server is part of a CUDA build of the library")
    given = {"no lanes": lanes(0), "too many lanes": lanes(_lib.MAX_LANES + 1),
             "a RECV lane": lanes(direction=_lib.STAGE_RECV), "unequal slots": lanes(slot_blocks=2)}[bad]
    ours, theirs = socket.socketpair()
    fd = theirs.detach()
    with pytest.raises(_lib.VllmExtError, match="lane") as info:
        _lib.PullServer(fd, _side(), given, 1, 1, 64, 16, 0, 0x4000)
    assert info.value.status == _lib.ERR_INVALID_ARGUMENT
    with pytest.raises(OSError):  # the refused server's fd was closed
        os.fstat(fd)
    ours.close()


def test_the_wire_constants_match_the_header():
    path = Path(__file__).resolve().parents[2] / "csrc" / "vllm_ext.h"
    if not path.exists():
        pytest.skip("no csrc/ here (the tests of an installed wheel)")
    header = path.read_text().lower()
    assert f"vllm_ext_pull_request_magic 0x{protocol.PULL_REQUEST_MAGIC:08x}u" in header
    assert f"vllm_ext_pull_reply_magic 0x{protocol.PULL_REPLY_MAGIC:08x}u" in header
    assert "vllm_ext_pull_max_ids (1u << 24)" in header and protocol.PULL_MAX_IDS == 1 << 24
    assert f"vllm_ext_pull_max_chunks {protocol.PULL_MAX_CHUNKS} " in header
    assert protocol.PULL_MAX_CHUNKS == _lib.PULL_MAX_CHUNKS
    assert "vllm_ext_pull_max_request_ids (vllm_ext_pull_max_chunks * vllm_ext_max_inline_ids)" in header


# ---- the destination's side of the protocol (no GPU: `done` is a flag) ------------------------
def _destination():
    from vllm_ext.migration.control import Connection

    ours, theirs = socket.socketpair()
    return Connection(ours, "test peer"), theirs


def _server_reply(sock, kind, message=""):
    body = message.encode()
    sock.sendall(REPLY.pack(protocol.PULL_REPLY_MAGIC, kind, len(body), 0) + body)


@pytest.mark.parametrize("case", ["accepted", "refused", "failed", "closed", "malformed", "silent",
                                  "not done"])
def test_the_destination_reads_every_outcome(case):
    from vllm_ext.migration import MigrationError
    from vllm_ext.migration.nccl import _wait_for_pull
    from vllm_ext.migration.timing import Deadline

    conn, server = _destination()
    done = case != "not done"
    if case in ("accepted", "not done"):
        _server_reply(server, protocol.PULL_ACCEPTED)
    elif case == "refused":
        _server_reply(server, protocol.PULL_REFUSED, "src_block_ids: id 9 out of range")
    elif case == "failed":
        _server_reply(server, protocol.PULL_FAILED, "nccl send: not complete at the deadline of 1 s")
    elif case == "closed":
        server.close()
    elif case == "malformed":
        server.sendall(b"\0" * REPLY.size)
    start = time.monotonic()
    try:
        if case == "accepted":
            _wait_for_pull(conn, lambda: done, Deadline(5))
            return
        with pytest.raises(MigrationError) as info:
            _wait_for_pull(conn, lambda: done, Deadline(0.5))
        message, remote = str(info.value), info.value.remote_type
        expected = {"refused": ("refused: ValueError: src_block_ids: id 9 out of range", "ValueError"),
                    "failed": ("failed: nccl send: not complete at the deadline", "MigrationError"),
                    "closed": ("connection closed by the peer", None),
                    "malformed": ("malformed reply", None),
                    "silent": ("not complete at the deadline", None),
                    "not done": ("not complete at the deadline", None)}[case]
        assert expected[0] in message and remote == expected[1]
        assert time.monotonic() - start < 4
    finally:
        conn.close()
        server.close()


def test_a_failed_connect_reaches_the_destination_in_the_binary_format():
    from vllm_ext.migration import MigrationError
    from vllm_ext.migration.control import Connection
    from vllm_ext.migration.nccl import _send_failed, _wait_for_pull
    from vllm_ext.migration.timing import Deadline

    conn, server = _destination()
    source = Connection(server, "test destination")
    try:
        _send_failed(source, "nccl connect: CUDA out of memory")
        with pytest.raises(MigrationError, match="failed: nccl connect: CUDA out of memory"):
            _wait_for_pull(conn, lambda: True, Deadline(5))
        source.close()
        _send_failed(source, "to nobody")  # the peer or the socket is gone: nothing raised
    finally:
        conn.close()


def test_the_test_stall_setter_is_separate_from_start():
    """The fault hook of tests has its own entry point: vllm_ext_pull_server_start takes none."""
    assert len(_lib._FUNCTIONS["vllm_ext_pull_server_start"][1]) == 13  # 13: the head range (heads)
    path = Path(__file__).resolve().parents[2] / "csrc" / "vllm_ext.h"
    if path.exists():
        start = path.read_text().split("vllm_ext_pull_server_start(")[1].split(";")[0]
        assert "stall" not in start


# ---- head ranges (tensor parallelism of unequal sizes) --------------------------------------------
# The placeholder cache's slices are 64 bytes: 4 KV heads of 16 bytes, in one run.
def _heads(whole_blocks=0, num_kv_heads=4, head_stride=16):
    return _lib.PullHeads(num_kv_heads=num_kv_heads, whole_blocks=whole_blocks, head_stride=head_stride)


def test_a_server_refuses_head_ranges_outside_its_heads_and_whole_blocks_for_other_head_counts():
    ours, srv, _ = _serve(lanes(), heads=_heads(whole_blocks=0))
    try:
        for heads, why in [((3, 2), "heads: heads [3, 5) are outside the source's 4 KV heads"),
                           ((-1, 2), "heads: heads [-1, 1) are outside the source's 4 KV heads"),
                           ((0, -3), "heads: heads [0, -3) are outside the source's 4 KV heads"),
                           ((0, 0), "whole blocks of 4 KV heads for a destination of another head count; "
                                    "name a head range")]:
            request(ours, [1, 2], heads=heads)
            kind, message = reply(ours)
            assert (kind, message) == (protocol.PULL_REFUSED, why)
        assert srv.wait(0.05) is None  # refusals move nothing and keep the pair
    finally:
        _end(ours, srv)


def test_a_server_without_heads_serves_whole_blocks_only(server):
    sock, srv, _ = server
    request(sock, [1], heads=(0, 2))
    assert reply(sock) == (protocol.PULL_REFUSED, "heads: this source serves whole blocks only")
    assert srv.wait(0.05) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a valid request would reach the GPU")
def test_a_valid_head_range_request_without_a_gpu_fails_cleanly():
    ours, srv, _ = _serve(lanes(), heads=_heads(whole_blocks=1))
    try:
        request(ours, [1, 2, 3], heads=(1, 2))
        kind, message = reply(ours)
        assert kind == protocol.PULL_FAILED and "cudaSetDevice" in message
    finally:
        _end(ours, srv)


def test_start_refuses_heads_that_do_not_tile_a_slice():
    if not _lib.built_with_cuda():
        pytest.skip("the pull server is part of a CUDA build of the library")
    for heads in (_heads(num_kv_heads=3), _heads(head_stride=0), _heads(num_kv_heads=0)):
        ours, theirs = socket.socketpair()
        fd = theirs.detach()
        with pytest.raises(_lib.VllmExtError, match="do not tile a slice of 64"):
            _lib.PullServer(fd, _side(), lanes(), 1, 1, 64, 16, 0, 0x4000, None, heads)
        ours.close()
