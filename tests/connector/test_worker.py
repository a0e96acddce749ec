"""The worker half (worker.py) on a producer: its endpoint serves only live leases' blocks and
no lease message, and the digests of vLLM's per-layer views as it wraps them. An MLA model's
latent cache (layout `mla`, replicated on every TP rank: it moves whole between any TP sizes),
the fingerprint that tells it from a dense cache, and what the worker refuses: caches of several
geometries, state caches, several KV cache groups."""

import time

import pytest
import torch

from tests.connector.halves import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SECRET,
    STATIC,
    Instance,
    assert_every_rank_received_once,
    finish_prefill,
    lease_client,
    make_request,
    make_scheduler,
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


# ---- MLA and KV cache groups (issue 35) ---------------------------------------------------------
MLA_WIDTH = 72  # the latent's width (DeepSeek's is 576: kv_lora_rank 512 + rope 64)
MLA_STATIC = {**STATIC, "attn_backend": ["CPU_MLA"], "mla": True, "num_kv_heads": 1, "head_size": MLA_WIDTH}
DENSE_STATIC = {**STATIC, "mla": False}
DEADLINE_S = 30.0  # generous: a stated bound, never a speed assertion


def mla_layers(seed, layers=2, release_032=True):
    """An MLA model's per-layer caches as vLLM makes them: 0.32+ a [B, 1, N, C] view of one
    allocation per layer (LBHNC, H = 1), earlier releases a [B, N, C] tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    backing = torch.randn(layers * NUM_BLOCKS * BLOCK_SIZE * MLA_WIDTH, generator=g)
    per_layer = NUM_BLOCKS * BLOCK_SIZE * MLA_WIDTH
    if release_032:
        return {f"model.layers.{i}.self_attn.attn": backing.as_strided(
            (NUM_BLOCKS, 1, BLOCK_SIZE, MLA_WIDTH), (BLOCK_SIZE * MLA_WIDTH, 0, MLA_WIDTH, 1), i * per_layer)
            for i in range(layers)}
    return {f"model.layers.{i}.self_attn.attn": backing[i * per_layer:(i + 1) * per_layer].view(
        NUM_BLOCKS, BLOCK_SIZE, MLA_WIDTH) for i in range(layers)}


def mla_worker(kv_caches, producer, static=MLA_STATIC, allowed=(), tp_rank=0, tp_size=1, mla=True):
    from vllm_ext.connector.worker import WorkerHalf

    allowed = ["{}:{}".format(*a.lease_address) for a in allowed]
    w = WorkerHalf(is_producer=producer, is_consumer=not producer, backend="gloo", endpoint_host="127.0.0.1",
                   endpoint_options={}, secret=SECRET, pull_timeout_s=10.0, static_fields=dict(static),
                   connect_to=[], allowed_producers=allowed, tp_rank=tp_rank, tp_size=tp_size, mla=mla)
    w.register_kv_caches(kv_caches)
    return w


@pytest.mark.parametrize("release_032", [True, False], ids=["view-0.32", "tensor-0.26"])
def test_an_mla_models_cache_is_wrapped_as_mla_without_a_copy(release_032):
    """vLLM's MLA caches (0.32+: [B, 1, N, C] views; 0.26: [B, N, C] tensors) wrap as layout
    `mla` over the same memory: one latent per token, no KV heads to split, digests by the
    header's definition (fresh random latents)."""
    from tests.helpers.reference import ref_block_digests
    from vllm_ext.connector.worker import wrap_kv_caches

    kv = mla_layers(seed=int(time.time()), release_032=release_032)
    cache, names = wrap_kv_caches(kv, mla=True)
    assert cache.layout == "mla" and names == list(kv)
    assert (cache.num_kv_heads, cache.block_size, cache.head_size) == (1, BLOCK_SIZE, MLA_WIDTH)
    assert [t.data_ptr() for t in cache.layers] == [t.data_ptr() for t in kv.values()]
    with pytest.raises(ValueError, match="'mla' cache; it holds one latent per token"):
        cache.head_part((0, 1))
    ids = list(range(NUM_BLOCKS))[::-3]
    assert ops.block_digests(cache, ids) == ref_block_digests(cache, ids)


def test_caches_the_connector_cannot_move_are_refused_naming_the_layer():
    from vllm_ext.connector.worker import wrap_kv_caches

    with pytest.raises(ValueError, match=r"kv_caches\['model.layers.0.self_attn.attn'\]: expected a \[num_blocks, H, "):
        wrap_kv_caches(mla_layers(seed=1, release_032=False))  # a 3-dim cache of a model vLLM calls non-MLA
    with pytest.raises(ValueError, match=r"expected a \[num_blocks, block_size, C\] \(MLA\) tensor"):
        wrap_kv_caches(vllm_layers(heads=2), mla=True)  # heads in an MLA model's cache
    mixed = {**vllm_layers(heads=2, c=16), "model.layers.2.self_attn.attn": vllm_layers(heads=2, c=32)[
        "model.layers.0.self_attn.attn"]}
    with pytest.raises(ValueError, match=r"kv_caches\['model.layers.2.self_attn.attn'\]: shape \[64, 2, 16, 32\] "
                                         r"differs from kv_caches\['model.layers.0.self_attn.attn'\]'s"):
        wrap_kv_caches(mixed)
    with pytest.raises(ValueError, match="Mamba or other state caches are not supported"):
        wrap_kv_caches({"model.layers.0.mixer": (torch.zeros(4, 8), torch.zeros(4, 8))})


def test_the_fingerprint_tells_an_mla_cache_from_a_dense_one_by_name():
    """An MLA producer and a dense consumer (and the reverse) differ in named fields, whatever
    their shapes: the consumer's describe refuses the producer with them."""
    from vllm_ext.lease.kv_params import fingerprint_mismatch, instance_fields

    mla = mla_worker(mla_layers(seed=2), producer=True)
    dense = mla_worker(vllm_layers(heads=1, c=MLA_WIDTH), producer=False, static=DENSE_STATIC, mla=False)
    try:
        assert mla.fingerprint_fields["kv_layout"] == "mla" and dense.fingerprint_fields["kv_layout"] == "blocks"
        diff = fingerprint_mismatch(instance_fields(dense.fingerprint_fields), instance_fields(mla.fingerprint_fields))
        assert "kv_layout 'blocks' here vs 'mla' at the producer" in diff
        assert "mla False here vs True at the producer" in diff
        assert mla.fingerprint != dense.fingerprint
    finally:
        mla.shutdown()
        dense.shutdown()


def mla_instance(producer, tp, seed, allowed=()):
    """An instance of `tp` ranks over an MLA model (every rank holds the same latent: replicated)."""
    return Instance.of([mla_worker(mla_layers(seed), producer, allowed=allowed, tp_rank=r, tp_size=tp)
                        for r in range(tp)], producer)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_mla_latents_move_whole_between_any_tp_sizes(p_tp, d_tp):
    """An MLA model's latent is whole on every rank: each D rank pulls every block whole from one
    P rank (its own number at equal sizes, kv_params.source_ranks' first at unequal ones; no head
    ranges), checked against that rank's digests; the lease ends once every D rank released it."""
    p = mla_instance(True, p_tp, seed=int(time.time()) % 1000)
    d = mla_instance(False, d_tp, seed=5000, allowed=[p.sched])
    try:
        prompt = list(range(75))  # 5 blocks, the last partial
        _, params = finish_prefill(p.sched, prompt)
        p.step()  # every rank grants the lease
        local = [20, 21, 22, 23, 24]
        untouched = [t[25].clone() for w in d.workers for t in w.cache.layers]
        req = make_request(prompt, params, req_id="d-0")
        matched, is_async = d.sched.get_num_new_matched_tokens(req, 0)
        assert is_async and matched > 0
        d.sched.update_state_after_alloc(req, local, matched)
        out = d.until(lambda o: o.finished_recving)
        assert out.finished_recving == {"d-0"} and not out.failed_recving
        src = p.workers[0].cache.layers
        for w in d.workers:
            for got, want in zip(w.cache.layers, src):
                assert torch.equal(got[local], want[params["remote_block_ids"]])
        assert all(torch.equal(t[25], u) for t, u in zip((t for w in d.workers for t in w.cache.layers), untouched))
        assert_every_rank_received_once(p, d)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_dense_consumer_refuses_an_mla_producer_naming_the_fields(caplog):
    """A dense D refuses an MLA P's params at admission (their fingerprints differ: the prompt is
    computed on D), and its handshake with P names the fields that differ."""
    from vllm_ext.connector.receiver import TransferFailed

    p = mla_instance(True, 1, seed=7)
    d_worker = mla_worker(vllm_layers(heads=1, c=MLA_WIDTH), producer=False, static=DENSE_STATIC, mla=False,
                          allowed=[p.sched])
    d_sched = make_scheduler(False, policy="recompute")
    d_sched.set_handshake({0: d_worker.handshake()})
    try:
        prompt = list(range(40))
        _, params = finish_prefill(p.sched, prompt)
        p.step()
        assert d_sched.get_num_new_matched_tokens(make_request(prompt, params, req_id="d-0"), 0)[0] == 0
        assert "remote_fingerprint" in caplog.text and "is not this instance's" in caplog.text
        host, port = p.sched.lease_address
        with pytest.raises(TransferFailed, match="incompatible KV cache: .*kv_layout 'blocks' here vs 'mla' at the "
                                                 "producer.*mla False here vs True at the producer"):
            d_worker.receiver.connect_producer(host, port, None, time.monotonic() + DEADLINE_S)
    finally:
        d_worker.shutdown()
        d_sched.shutdown()
        p.shutdown()


def test_an_mla_consumer_on_cpu_loads_every_token_but_the_last_unless_told():
    """vLLM 0.32's CPU MLA computes a prefill over loaded context wrong: an MLA model's consumer
    loads all but the last token (a decode computes it) unless load_whole_blocks is given."""
    from vllm_ext.connector.connector import load_whole_blocks
    from vllm_ext.connector.settings import ConnectorSettings

    for extra, mla, want in (({}, False, True), ({}, True, False), ({"load_whole_blocks": True}, True, True),
                             ({"load_whole_blocks": False}, False, False)):
        settings = ConnectorSettings.parse(extra, device_type="cpu")
        assert load_whole_blocks(settings, extra, mla) is want, (extra, mla)
