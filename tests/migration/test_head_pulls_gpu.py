"""Head-range pulls of CUDA caches: gloo (staged through the GPU, both endpoints here), ipc (the
source in a spawned process, its cache mapped) and nccl (the source in a spawned process on a
second GPU, its library pull server gathering the range); every byte of the destination equals
ops.copy_blocks between CPU copies of the same caches. Marked `gpu`, nccl `multi_gpu`."""

import multiprocessing as mp
import random

import pytest
import torch

from tests.helpers.reference import assert_cache_bytes_equal, cache_bytes, random_head_cache
from vllm_ext import KVCache, ops
from vllm_ext.migration import MigrationEndpoint

GEOMETRY = {"num_layers": 2, "num_blocks": 16, "block_size": 16, "head_size": 64}
SPAWN = mp.get_context("spawn")


def cuda_copy(cpu: KVCache, kind: str, device="cuda:0") -> KVCache:
    if kind == "blocks_nhd":
        layers = [t.transpose(1, 2).contiguous().to(device).transpose(1, 2) for t in cpu.layers]
    else:
        layers = [t.to(device) for t in cpu.layers]
    return KVCache.from_layers(layers, layout=cpu.layout)


IPC_GEOMETRY = dict(GEOMETRY, num_blocks=600)  # room for a pull of more ids than a launch carries (448)


def _source(conn, kind, heads, seed, backend, device, options):
    """A source process: its cache (from the seed) served until told to stop."""
    torch.cuda.set_device(device)
    cpu = random_head_cache(dict(IPC_GEOMETRY, num_kv_heads=heads), torch.bfloat16, kind, seed=seed)
    ep = MigrationEndpoint(cuda_copy(cpu, kind, device), backend=backend, **options)
    conn.send(ep.descriptor())
    conn.recv()
    ep.close()


# (backend, the source's GPU, options): NCCL refuses two ranks on one GPU.
REMOTE = [pytest.param("ipc", "cuda:0", {}, marks=pytest.mark.gpu, id="ipc"),
          pytest.param("nccl", "cuda:1", {"chunk_bytes": 256 << 10}, marks=pytest.mark.multi_gpu, id="nccl")]


@pytest.mark.parametrize("backend,source_device,options", REMOTE)
@pytest.mark.parametrize("kind", ["flash", "blocks_nhd"])
def test_pulls_heads_from_a_source_of_other_head_count(kind, backend, source_device, options):
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_source, args=(child, kind, 8, 5, backend, source_device, options))
    proc.start()
    try:
        assert parent.poll(120), "the source process did not start"
        desc = parent.recv()
        src_cpu = random_head_cache(dict(IPC_GEOMETRY, num_kv_heads=8), torch.bfloat16, kind, seed=5)
        dst_cpu = random_head_cache(dict(IPC_GEOMETRY, num_kv_heads=2), torch.bfloat16, kind, seed=6)
        dst = cuda_copy(dst_cpu, kind)
        ep = MigrationEndpoint(dst, backend=backend, **options)
        try:
            rng = random.Random(kind)
            for n in (3, 500):  # inline ids, and ids through device memory (500 > 448)
                src = [rng.randrange(600) for _ in range(n)]
                dst_ids = rng.sample(range(600), n)
                stats = ep.pull(desc, src, dst_ids, timeout=60, src_heads=(4, 2))
                assert stats.nbytes == len(src) * dst.buffer_row_nbytes((0, 2))
                ops.copy_blocks(src_cpu, src, dst_cpu, dst_ids, src_heads=(4, 2))
                assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
        finally:
            ep.close()
    finally:
        parent.send("stop")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        assert proc.exitcode == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flash", "blocks_hnd"])
def test_gloo_pulls_heads_between_cuda_caches(kind):
    """gloo stages a CUDA cache's head rows through device and host slots, both ways."""
    src_cpu = random_head_cache(dict(GEOMETRY, num_kv_heads=2), torch.float16, kind, seed=7)
    dst_cpu = random_head_cache(dict(GEOMETRY, num_kv_heads=4), torch.float16, kind, seed=8)
    a = MigrationEndpoint(cuda_copy(src_cpu, kind), backend="gloo", stripes=2, chunk_bytes=64 << 10)
    b = MigrationEndpoint(cuda_copy(dst_cpu, kind), backend="gloo", stripes=2, chunk_bytes=64 << 10)
    try:
        src, dst = [1, 1, 9, 15, 0, 4, 7], [2, 3, 4, 5, 6, 7, 8]
        stats = b.pull(a.descriptor(), src, dst, timeout=60, dst_heads=(2, 2))
        assert stats.chunks > 1
        ops.copy_blocks(src_cpu, src, dst_cpu, dst, dst_heads=(2, 2))
        assert_cache_bytes_equal(b.cache, cache_bytes(dst_cpu))
        a.pull(b.descriptor(), [5, 2], [0, 1], timeout=60, src_heads=(1, 2))
        ops.copy_blocks(dst_cpu, [5, 2], src_cpu, [0, 1], src_heads=(1, 2))
        assert_cache_bytes_equal(a.cache, cache_bytes(src_cpu))
    finally:
        a.close()
        b.close()


class _Conn:
    """What _Lanes.serve takes of a control connection: its socket and a name."""

    def __init__(self, sock):
        self.sock, self.peer = sock, "test"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["flash", "blocks_nhd", "blocks_hnd"])
def test_the_nccl_path_moves_a_head_range_on_one_gpu(kind):
    """The nccl backend's two halves on one GPU, NCCL replaced by a recorded copy (NCCL refuses
    two ranks on one GPU): the source's library pull server gathers heads [1, 3) of 4 into its
    slots on a head-range request (and refuses whole blocks for a destination of 2 heads); the
    destination's staged receive scatters them into heads [0, 2) of its cache. Two chunks of at
    most two blocks: no slot is reused, so each recorded send stays readable."""
    import ctypes
    import socket
    import threading

    cupy = pytest.importorskip("cupy")
    from vllm_ext import _lib
    from vllm_ext.migration import nccl, protocol

    src_cpu = random_head_cache(dict(GEOMETRY, num_kv_heads=4), torch.float16, kind, seed=70)
    dst_cpu = random_head_cache(dict(GEOMETRY, num_kv_heads=2), torch.float16, kind, seed=71)
    src, dst = cuda_copy(src_cpu, kind), cuda_copy(dst_cpu, kind)
    send = nccl._Lanes([0], src, 2, 0, _lib.STAGE_SEND)
    recv = nccl._Lanes([0], dst, 2, 0, _lib.STAGE_RECV)
    sent, received = [], []
    transfer = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
                                ctypes.c_void_p, ctypes.c_void_p)

    def on_send(buf, count, datatype, peer, comm, stream):
        sent.append((buf, count))
        return 0

    def on_recv(buf, count, datatype, peer, comm, stream):
        from_buf, n = sent[len(received)]
        received.append(count)
        if n != count:
            return 1
        cupy.cuda.runtime.memcpyAsync(buf, from_buf, count, cupy.cuda.runtime.memcpyDeviceToDevice, stream or 0)
        return 0

    callbacks = (transfer(on_send), transfer(on_recv))
    send.lanes[0].transfer = ctypes.cast(callbacks[0], ctypes.c_void_p).value
    recv.lanes[0].transfer = ctypes.cast(callbacks[1], ctypes.c_void_p).value
    ours, theirs = socket.socketpair()
    heads = _lib.PullHeads(num_kv_heads=4, whole_blocks=0, head_stride=src.head_stride)
    server = threading.Thread(target=send.serve, args=(_Conn(theirs), None, None, heads))
    server.start()
    try:
        ours.settimeout(30)

        def answer():
            kind_, length = protocol.parse_pull_reply(ours.recv(protocol.PULL_REPLY.size, socket.MSG_WAITALL))
            return kind_, ours.recv(length, socket.MSG_WAITALL).decode() if length else ""

        ours.sendall(protocol.pull_request([0, 1], 30.0))
        assert answer() == (protocol.PULL_REFUSED, "whole blocks of 4 KV heads for a destination of another "
                                                   "head count; name a head range")
        src_ids, dst_ids = [7, 3, 7], [0, 5, 2]
        ours.sendall(protocol.pull_request(src_ids, 30.0, (1, 2)))
        assert answer() == (protocol.PULL_ACCEPTED, "")
        torch.cuda.synchronize()
        sp, dp = ops._pair_parts(src, (1, 2), dst, (0, 2))
        row = dst.buffer_row_nbytes((0, 2))
        assert [count for _, count in sent] == [row, 2 * row]
        assert recv.enqueue(dst_ids, dp) == 2
        torch.cuda.synchronize()
        assert received == [row, 2 * row]
        ops.copy_blocks(src_cpu, src_ids, dst_cpu, dst_ids, src_heads=(1, 2), dst_heads=(0, 2))
        assert_cache_bytes_equal(dst, cache_bytes(dst_cpu))
        assert_cache_bytes_equal(src, cache_bytes(src_cpu))
    finally:
        ours.close()
        server.join(30)
        assert not server.is_alive()
