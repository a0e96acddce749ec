"""The lease channel's requests to a producer (scheduler/lease_requests.py) over the real channel:
acquire (held for the pull, waiting for the worker to serve the blocks), release, refusals of
duplicate, unknown and malformed requests, another secret and unauthenticated frames, and the
output limits lease.describe says."""

import re

import pytest

from tests.connector.halves import (
    BLOCK_SIZE,
    SECRET,
    Raw,
    expect,
    finish_prefill,
    lease_client,
    refusal,
    step,
)
from vllm_ext import ops
from vllm_ext.connector.scheduler import SchedulerHalf
from vllm_ext.lease import messages
from vllm_ext.lease.channel import ChannelError, LeaseClient


def test_acquire_extends_the_lease_for_the_pull_then_release_frees(producer):
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    step(sched, worker)
    client = lease_client(sched)
    sched.clock.now += 25.0
    block_ids, num_tokens, hash_, digests = client.acquire(params["remote_lease"], 20, 5, *expect(params))
    assert block_ids == params["remote_block_ids"] and num_tokens == 40 and hash_ == params["remote_prompt_hash"]
    # the worker digested the blocks it serves, as a consumer digests what it pulled
    assert digests == ops.block_digests(worker.cache, block_ids)
    sched.clock.now += 10.0  # past the 30 s lease, within the pull's hold
    assert sched.build_connector_meta().finished_sending == []
    client.release(params["remote_lease"], 5)
    assert sched.build_connector_meta().finished_sending == ["p-0"]
    client.close()


def test_duplicate_and_unknown_leases_are_refused(producer):
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    step(sched, worker)
    client = lease_client(sched)
    client.acquire(params["remote_lease"], 5, 5, *expect(params))
    with pytest.raises(ChannelError, match="already taken"):
        client.acquire(params["remote_lease"], 5, 5, *expect(params))
    with pytest.raises(ChannelError, match="unknown, released or expired"):
        client.acquire("0" * 32, 5, 5, 1, "0" * 64)
    with pytest.raises(ChannelError, match="hold_s"):
        _, other = finish_prefill(sched, list(range(20)), req_id="p-1")
        step(sched, worker)
        client.acquire(other["remote_lease"], 1e9, 5, *expect(other))
    from vllm_ext.migration import protocol

    # field checks of protocol.py
    assert re.search("lease.acquire: unexpected steal",
                     refusal(sched, Raw("lease.acquire", lease=other["remote_lease"], hold_s=5,
                                        num_tokens=other["remote_num_tokens"],
                                        prompt_hash=other["remote_prompt_hash"], rank=0, ranks=1, steal=1)))
    assert re.search("ranks: expected",
                     refusal(sched, Raw("lease.acquire", lease=other["remote_lease"], hold_s=5,
                                        num_tokens=other["remote_num_tokens"],
                                        prompt_hash=other["remote_prompt_hash"], rank=0, ranks=0)))
    assert re.search("unknown request 'steal'", refusal(sched, Raw("steal", lease=params["remote_lease"])))
    assert re.search("unknown request 'gloo.pull'", refusal(sched, protocol.GlooPull(1, 5.0)))  # an endpoint's
    client.close()


def test_lease_channel_refuses_another_secret(producer):
    sched, _ = producer
    host, port = sched.lease_address
    with pytest.raises(ChannelError, match="did not prove it holds the secret"):
        LeaseClient(b"some-other-deployment-secret!!", host, port).describe(5)


def test_lease_channel_bounds_frames_and_never_trusts_unauthenticated_input(producer):
    """Before authentication the lease server answers at most a refusal, then closes; it keeps
    serving authenticated clients."""
    import socket
    import struct

    from vllm_ext.migration import protocol

    sched, _ = producer
    host, port = sched.lease_address
    describe = protocol.encode_frame(messages.LeaseDescribe().header())
    for payload in (struct.pack("!II", protocol.MAX_HEADER_BYTES + 1, 0), struct.pack("!II", 5, 0) + b"\x80\x04N.\x00",
                    struct.pack("!II", 2, 0) + b"[]", describe):
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(payload)
            data = b""
            while True:  # until the server closes (a timeout fails the test)
                try:
                    chunk = s.recv(1 << 16)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
            assert b'"ok":true' not in data and b"descriptor" not in data, data
    assert lease_client(sched).describe(5).fingerprint  # and keeps serving


def test_the_lease_channel_describes_the_output_limits_it_was_given(producer):
    """lease.describe says the instance's generation-config output limits (the router keeps a
    moved request's limit by them); an instance given none says 0 for both."""
    sched, worker = producer
    reply = lease_client(sched).describe(5)
    assert (reply.default_max_tokens, reply.max_tokens_cap) == (0, 0)
    limited = SchedulerHalf(is_producer=True, is_consumer=False, block_size=BLOCK_SIZE, lease_s=30.0,
                            lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="fail",
                            max_tokens_limits=(300, 200))
    try:
        limited.set_handshake({0: worker.handshake()})
        reply = lease_client(limited).describe(5)
        assert (reply.default_max_tokens, reply.max_tokens_cap) == (300, 200)
        assert reply.fingerprint == lease_client(sched).describe(5).fingerprint
    finally:
        limited.shutdown()


def test_acquire_waits_for_the_worker_to_serve_the_lease(producer):
    """A lease made but not yet granted by the producer's worker is not handed out."""
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    client = lease_client(sched)
    try:
        with pytest.raises(ChannelError, match="not served yet"):
            client.acquire(params["remote_lease"], 5, 10, *expect(params))
        step(sched, worker)
        assert client.acquire(params["remote_lease"], 5, 10, *expect(params))[0] == params["remote_block_ids"]
    finally:
        client.close()


def test_a_release_of_a_rank_past_ranks_is_refused_as_an_acquire_is(producer):
    sched, worker = producer
    _, params = finish_prefill(sched, list(range(40)))
    step(sched, worker)
    client = lease_client(sched)
    with pytest.raises(ChannelError, match="rank: expected a tensor-parallel rank below ranks 2, got 2"):
        client.release(params["remote_lease"], 5, rank=2, ranks=2)
    with pytest.raises(ChannelError, match="rank: expected a tensor-parallel rank below ranks 2, got 2"):
        client.acquire(params["remote_lease"], 5, 5, *expect(params), rank=2, ranks=2)
    client.close()
