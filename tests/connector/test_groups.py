"""Several KV cache groups (vLLM's hybrid KV cache manager, connector/groups.py): what the
connector accepts and refuses by name, the interleaved block tables, and a P/D load between the
connector's halves over caches whose tensors two groups share, as vLLM lays them out: a full-
attention group and a sliding-window group whose tables hold the null block where the window has
passed. Every byte the consumer holds is checked; blocks it does not hold are never written."""

import random

import pytest
import torch

from tests.connector.halves import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SECRET,
    STATIC,
    make_request,
    make_worker,
    receive,
    released,
    step,
)
from vllm_ext.connector import groups as kv_groups
from vllm_ext.connector.groups import NULL_BLOCK, Groups
from vllm_ext.connector.scheduler import SchedulerHalf

WINDOW = 2 * BLOCK_SIZE
TWO = Groups((("FullAttentionSpec", 0), ("SlidingWindowSpec", WINDOW)))


def spec(kind, block_size=BLOCK_SIZE):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if kind == "full":
        return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32)
    if kind == "window":
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32,
                                 sliding_window=WINDOW)
    return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float32,))


def config(*group_specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"g{i}.l{j}" for j in range(2)], s) for i, s in enumerate(group_specs)])


def test_the_groups_of_a_config_and_what_is_refused_by_name():
    assert kv_groups.of_config(None, BLOCK_SIZE).plain  # releases that give no config: one group
    one = kv_groups.of_config(config(spec("full")), BLOCK_SIZE)
    assert one.plain and one.fingerprint_fields() == {} and one.live_migration_refusal() is None
    two = kv_groups.of_config(config(spec("full"), spec("window")), BLOCK_SIZE)
    assert two == TWO and two.windowed and two.count == 2
    assert two.fingerprint_fields() == {"kv_cache_groups": [["FullAttentionSpec", 0], ["SlidingWindowSpec", WINDOW]]}
    assert "--disable-hybrid-kv-cache-manager" in two.live_migration_refusal()
    alone = kv_groups.of_config(config(spec("window")), BLOCK_SIZE)  # a model of sliding windows only
    assert alone.count == 1 and alone.windowed and alone.live_migration_refusal() is not None
    with pytest.raises(ValueError, match=r"KV cache group 1 is a MambaSpec \(2 layers\).*state caches"):
        kv_groups.of_config(config(spec("full"), spec("mamba")), BLOCK_SIZE)


def test_groups_of_another_block_size_are_refused():
    with pytest.raises(ValueError, match=r"block sizes \[32\] differ from the engine's 16"):
        kv_groups.of_config(config(spec("full", 32), spec("window", 32)), BLOCK_SIZE)


def test_tables_interleave_by_position_and_a_load_takes_only_the_blocks_held_here():
    assert kv_groups.interleave([[5, 6, 7]]) == [5, 6, 7]
    assert kv_groups.interleave([[5, 6, 7], [0, 8, 9]]) == [5, 0, 6, 8, 7, 9]
    assert kv_groups.interleave([[5, 6, 7], [8]]) == [5, 8, 6, 0, 7, 0]  # a shorter table: nulls
    assert kv_groups.pairs([1, 2], [3, 4], 6, windowed=False) == ([1, 2], [3, 4], None)
    # here: position 0's window block is null (not needed); the producer's nulls where this
    # instance holds nothing are fine
    assert kv_groups.pairs([5, 0, 6, 8], [10, 0, 11, 12], 4, windowed=True) == ([5, 6, 8], [10, 11, 12], [4, 6, 7])
    with pytest.raises(ValueError, match=r"no longer holds 1 block\(s\) this instance's sliding window needs "
                                         r"\(lease blocks \[5\]\)"):
        kv_groups.pairs([5, 0, 6, 8], [10, 13, 11, 12], 4, windowed=True)


def shared_layers(seed):
    """Two layer slots whose tensors a full-attention layer and a sliding-window layer share (as
    vLLM's hybrid manager allocates them): four names, two distinct tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 16, generator=g) for _ in range(2)]
    return {f"model.layers.{2 * i + k}.self_attn.attn": t for i, t in enumerate(tensors) for k in range(2)}


def scheduler(producer, groups):
    return SchedulerHalf(is_producer=producer, is_consumer=not producer, block_size=BLOCK_SIZE, lease_s=30.0,
                         lease_host="127.0.0.1", lease_port=0, secret=SECRET, failure_policy="recompute",
                         groups=groups)


def tables(rng, n_blocks, skipped, taken):
    """A request's tables: full attention's blocks, and the window's with `skipped` nulls first."""
    free = [b for b in range(1, NUM_BLOCKS) if b not in taken]
    rng.shuffle(free)
    full, window = free[:n_blocks], free[n_blocks:2 * n_blocks - skipped]
    taken.update(full + window)
    return full, [NULL_BLOCK] * skipped + window


@pytest.mark.parametrize("seed", range(3))
def test_a_pd_load_moves_each_groups_blocks_and_only_those_held_here(seed):
    """P's window table has passed its first block (null); D, which computes the last tokens
    itself, holds its window's last blocks only. Every block D holds gets P's bytes for it in
    every layer; D's null block and the blocks it does not hold stay as they were."""
    rng = random.Random(seed)
    static = dict(STATIC, **TWO.fingerprint_fields())
    p_caches, d_caches = shared_layers(seed), shared_layers(100 + seed)
    p_worker, d_worker = make_worker(p_caches, True, static=static), None
    p_sched, d_sched = scheduler(True, TWO), scheduler(False, TWO)
    try:
        p_sched.set_handshake({0: p_worker.handshake()})
        d_worker = make_worker(d_caches, False, static=static, allowed=[p_sched])
        d_sched.set_handshake({0: d_worker.handshake()})
        n = 4 * BLOCK_SIZE + 5
        prompt = [rng.randrange(3, 1000) for _ in range(n)]
        nb = -(-n // BLOCK_SIZE)
        p_full, p_window = tables(rng, nb, 1, set())
        req = make_request(prompt, {"do_remote_decode": True}, req_id="p-0", max_tokens=1)
        from vllm.v1.request import RequestStatus

        req.num_computed_tokens, req.status = n, RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p_sched.request_finished(req, kv_groups.interleave([p_full, p_window]))
        assert delay and len(params["remote_block_ids"]) == 2 * nb
        step(p_sched, p_worker)  # the worker serves the lease's blocks

        d_full, d_window = tables(rng, nb, 2, {NULL_BLOCK})  # D's window starts later: 2 nulls
        before = {k: t.clone() for k, t in d_caches.items()}
        d_req = make_request(prompt, params, req_id="d-0")
        matched, _ = d_sched.get_num_new_matched_tokens(d_req, 0)
        d_sched.update_state_after_alloc(d_req, kv_groups.interleave([d_full, d_window]), matched)
        (job,) = d_sched.build_connector_meta().recvs
        assert job.error is None and NULL_BLOCK not in job.dst_block_ids + job.src_block_ids
        done, failed = receive(d_worker, [job])
        assert done == {"d-0"} and not failed
        loaded = -(-matched // BLOCK_SIZE)
        moved = {d: p for d, p in zip(d_full[:loaded], p_full)}
        moved.update({d: p for d, p in zip(d_window[:loaded], p_window) if d != NULL_BLOCK})
        assert sorted(moved) == sorted(job.dst_block_ids)
        for name, t in d_caches.items():
            for b in range(NUM_BLOCKS):
                want = p_caches[name][moved[b]] if b in moved else before[name][b]
                assert torch.equal(t[b], want), (name, b)
        assert released(p_sched, p_worker) == ["p-0"]
    finally:
        for half in (p_sched, d_sched, p_worker, d_worker):
            if half is not None:
                half.shutdown()


def test_a_load_the_producer_cannot_serve_fails_that_request_and_releases_the_lease():
    """D's window needs a block P's table no longer holds: the receive fails at once (vLLM then
    computes the prompt by its policy) and P's lease is released, nothing pulled."""
    from vllm_ext.lease.kv_params import PROTOCOL, prompt_hash

    d_sched = scheduler(False, TWO)
    try:
        n = 3 * BLOCK_SIZE
        prompt = list(range(3, 3 + n))
        params = {"do_remote_prefill": True, "do_remote_decode": False, "vllm_ext": PROTOCOL,
                  "remote_lease": "ab" * 16, "remote_block_ids": [4, 0, 5, 0, 6, 7], "remote_num_tokens": n,
                  "remote_prompt_hash": prompt_hash(prompt), "remote_fingerprint": "cd" * 16,
                  "remote_endpoint": {"lease_host": "127.0.0.1", "lease_port": 9, "endpoint_id": "ef" * 16,
                                      "backend": "gloo"}, "remote_lease_s": 30.0}
        req = make_request(prompt, params, req_id="d-0")
        matched, _ = d_sched.get_num_new_matched_tokens(req, 0)
        d_sched.update_state_after_alloc(req, [10, 0, 11, 13, 12, 14], matched)
        meta = d_sched.build_connector_meta()
        (job,) = meta.recvs
        assert "sliding window needs" in job.error and NULL_BLOCK not in job.dst_block_ids
        assert [r.lease for r in meta.releases] == ["ab" * 16]
        # a table of the wrong length for two groups is refused by name
        bad = dict(params, remote_block_ids=[4, 5, 6])
        with pytest.raises(Exception, match=r"need 6 blocks of 16 in each of 2 KV cache groups"):
            from vllm_ext.lease.kv_params import parse_remote_params

            parse_remote_params(bad, BLOCK_SIZE, 2)
    finally:
        d_sched.shutdown()


def test_an_instance_of_several_groups_leases_no_running_request():
    """A live migration's lease of a windowed model's running request is refused on the lease
    channel, saying why (vLLM frees a window's blocks while the request runs), and such a
    request is never tracked."""
    from vllm_ext.connector.scheduler.migration_source import MigrationSource

    source = MigrationSource(block_size=BLOCK_SIZE, refusal=TWO.live_migration_refusal())
    req = make_request(list(range(3, 40)), {"migration_id": "ab" * 16})
    source.track(req, [4, 5, 6, 7])
    assert not source.is_tracked(req.request_id)
    with pytest.raises(ValueError, match=r"migration abababab: this instance's KV cache groups \(FullAttentionSpec, "
                                         r"SlidingWindowSpec \(32 tokens\)\): a running request's KV is leased only"):
        source.ask("ab" * 16)
