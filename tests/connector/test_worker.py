"""The worker half (worker.py) on a producer: its endpoint serves only live leases' blocks and
no lease message, and the digests of vLLM's per-layer views as it wraps them."""

import time

import pytest

from tests.connector.halves import (
    NUM_BLOCKS,
    SECRET,
    finish_prefill,
    lease_client,
    step,
    vllm_layers,
)
from vllm_ext import ops
from vllm_ext.lease import messages


def test_an_endpoint_serves_no_lease_message(producer):
    """The producer's MigrationEndpoint refuses the lease messages (they have a registry of their
    own), also from an authenticated peer."""
    from vllm_ext.migration import MigrationError, PeerDescriptor
    from vllm_ext.migration.control import open_connection
    from vllm_ext.migration.timing import Deadline

    _, worker = producer
    peer = PeerDescriptor(**worker.handshake().descriptor)
    conn = open_connection(peer.host, peer.port, "", Deadline(10), client_id="c" * 32, server_id=peer.endpoint_id,
                           secret=SECRET)
    try:
        conn.send_message(messages.LeaseDescribe(), b"", Deadline(10))
        with pytest.raises(MigrationError, match="unknown request 'lease.describe'"):
            conn.recv_reply(Deadline(10), "describe")
    finally:
        conn.close()


def test_an_authenticated_peer_cannot_pull_blocks_outside_live_leases(producer):
    """The producer's endpoint (gloo, serve="granted") refuses blocks of no lease, serves a live
    lease's blocks, and refuses them again once the lease was released."""
    from vllm_ext import KVCache
    from vllm_ext.migration import MigrationEndpoint, MigrationError, PeerDescriptor

    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))  # blocks 3, 4, 5
    step(sched, worker)
    peer = PeerDescriptor(**worker.handshake().descriptor)
    thief = MigrationEndpoint(KVCache.from_layers([t.clone() for t in vllm_layers(seed=9).values()],
                                                  layout="blocks"), "gloo", secret=SECRET)
    try:
        with pytest.raises(MigrationError, match="block 40 is not granted"):
            thief.pull(peer, [40], [0], timeout=10)
        thief.pull(peer, params["remote_block_ids"], [0, 1, 2], timeout=10)  # a live lease's blocks
        client = lease_client(sched)
        client.release(params["remote_lease"], 5)
        client.close()
        assert step(sched, worker).finished_sending == ["p-0"]
        with pytest.raises(MigrationError, match="block 3 is not granted"):
            thief.pull(peer, params["remote_block_ids"], [0, 1, 2], timeout=10)
    finally:
        thief.close()


def test_block_digests_of_vllms_layers_follow_the_definition():
    """vLLM's own per-layer tensors (layout `blocks`) as the worker wraps them: the digests
    equal the header's definition over each block's row (fresh random KV)."""
    from tests.helpers.reference import ref_block_digests
    from vllm_ext.connector.worker import wrap_kv_caches

    cache, _ = wrap_kv_caches(vllm_layers(seed=int(time.time())))
    ids = list(range(NUM_BLOCKS))[::-1][:70] + [3, 3]
    assert ops.block_digests(cache, ids) == ref_block_digests(cache, ids)
