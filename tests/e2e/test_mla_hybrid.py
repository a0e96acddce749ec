"""MLA and sliding-window models end to end: instances A and B (kv_both, kv_load_failure_policy
"recompute") behind the P/D proxy (A prefills, B decodes) and the router (live migration), on
  - `mla`: a seeded random DeepSeek-V2 (MLA attention: one 576-wide latent per token, the
    connector's layout `mla`); on CPU vLLM 0.32 serves it with its CPU_MLA backend (blocks of 16,
    no prefix caching and no chunked prefill: vLLM turns both off for MLA on a CPU);
  - `sliding`: a seeded random Gemma 3 (sliding-window layers of 48 tokens beside full-attention
    ones, prompts longer than the window) under vLLM's hybrid KV cache manager: two KV cache
    groups, the window's table holding null blocks once the window passed them; P/D moves each
    group's blocks that D holds (connector/groups.py), and a moved request is recomputed on its
    destination (its source leases no running request's blocks, saying why);
  - `sliding-one-group`: the same with --disable-hybrid-kv-cache-manager (one group, every layer
    keeping every block): P/D and live migration move them all.
On one GPU (marked gpu, ipc) the same with config-only models of DeepSeek-V2-Lite's and
Gemma-3-1B's geometries and dummy weights (fleet.models; token-id prompts).

P/D and moved requests' greedy outputs (token ids and text) equal a single instance's (MLA on a
CPU: the moved KV checked block by block instead, see comparable()); the transfers show in the
metrics, none failed its digest check; at the end no block stays leased on either instance.

Deadlines (generous on purpose, never assertions on speed): start-up 420 s per server, each
request 120 s, KV usage back to zero within LEASE_S + 15 s of the last request.
"""

import random
import time

import pytest

from tests.e2e import live_cluster
from tests.e2e.live_cluster import Stream, finish, migrate_async, require_vllm, start_pair
from vllm_ext import fleet
from vllm_ext.fleet import models

require_vllm()

LEASE_S = 15.0
MAX_TOKENS = 12
# long enough to be running when the move ends (it starts within the client's first 20 tokens; on a
# loaded host the engine runs hundreds of tokens ahead of what the client has read)
LIVE_MAX_TOKENS = 1000
IDLE_TIMEOUT_S = LEASE_S + 15.0

# kind -> (CPU: writer of a seeded random checkpoint, the servers' extra arguments; GPU: a
# config.json for dummy weights, the servers' extra arguments after the device's). CPU_MLA, not
# AMX_MLA (which vLLM prefers on CPUs with AMX): AMX_MLA takes bf16 weights only, the tests serve
# float32. On a GPU Gemma 3 runs in bfloat16: vLLM refuses float16 (the cuda device's) for it.
GEMMA_GPU = ("--dtype", "bfloat16")
KINDS = {
    "mla": ((models.write_random_mla, ("--block-size", "16", "--attention-backend", "CPU_MLA")),
            (models.DEEPSEEK_V2_LITE, ("--gpu-memory-utilization", "0.45"))),  # 16B parameters (31 GB) each
    "sliding": ((models.write_random_sliding, ()), (models.GEMMA3_1B, GEMMA_GPU)),
    "sliding-one-group": ((models.write_random_sliding, ("--disable-hybrid-kv-cache-manager",)),
                          (models.GEMMA3_1B, (*GEMMA_GPU, "--disable-hybrid-kv-cache-manager"))),
}



@pytest.fixture(scope="module", params=[
    pytest.param(("cpu", "mla"), id="cpu-mla"), pytest.param(("cpu", "sliding"), id="cpu-sliding"),
    pytest.param(("cpu", "sliding-one-group"), id="cpu-sliding-one-group"),
    pytest.param(("cuda", "mla"), id="cuda-mla", marks=pytest.mark.gpu),
    pytest.param(("cuda", "sliding"), id="cuda-sliding", marks=pytest.mark.gpu),
    pytest.param(("cuda", "sliding-one-group"), id="cuda-sliding-one-group", marks=pytest.mark.gpu)])
def cluster(request, tmp_path_factory):
    device_name, kind = request.param
    device = fleet.DEVICES[device_name]
    work = tmp_path_factory.mktemp(f"{kind}-{device_name}")
    (write, cpu_args), (gpu_config, gpu_args) = KINDS[kind]
    if device.name == "cpu":
        model, extra_args = write(work / "model"), cpu_args
    else:  # the geometry at full size, a vocabulary the word-level tokenizer covers (its special ids too)
        model = models.write_config(work / "model", dict(gpu_config, vocab_size=models.VOCAB_SIZE, bos_token_id=1,
                                                         eos_token_id=2))
        extra_args = ("--load-format", "dummy", *gpu_args)
    models.write_word_tokenizer(model)
    for cluster in start_pair(work, model, lease_s=LEASE_S, extra_args=extra_args, proxy=True, device=device):
        yield dict(cluster, kind=kind)


def prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(3, models.VOCAB_SIZE) for _ in range(n)] for n in lengths]


def complete(url, prompt, max_tokens=MAX_TOKENS):
    return live_cluster.complete(url, prompt, max_tokens)


def wait_idle(cluster):
    """Every instance's KV usage back to zero (leases released or expired) within the deadline."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    for name in "AB":
        while (usage := fleet.metrics(cluster[name].url)["vllm:kv_cache_usage_perc"]) != 0.0:
            assert time.monotonic() < deadline, f"{name}: KV usage {usage} after the requests ended"
            time.sleep(0.2)


def comparable(cluster) -> bool:
    """Whether outputs can be compared with a single instance's token for token. Not for MLA on a
    CPU: a consumer computes the prompt's last token (P/D) or a resumed request's last tokens as a
    decode or a prefill over loaded context, a single instance in its prefill or decode; vLLM
    0.32's CPU MLA kernels part between those paths within a few tokens of this random model (a
    single instance asked for its prompt plus its own first k tokens, all prefilled, parts from
    its own decode the same way, no connector involved). There the moved KV is checked block by
    block instead (the consumer's digest check against the producer's digests, never failed)."""
    return not (cluster["kind"] == "mla" and cluster["device"].name == "cpu")


def transfer_counts(cluster):
    """Every instance's (transfers, failed transfers, digest mismatches) of the connector."""
    out = {}
    for name in "AB":
        m = fleet.metrics(cluster[name].url)
        out[name] = tuple(m.get(f"vllm:vllm_ext_{k}_total", 0) for k in ("transfers", "failed_transfers",
                                                                          "digest_mismatches"))
    return out


def test_pd_outputs_equal_a_single_instance(cluster):
    """Prompts of several blocks (past the sliding window): B decodes on the KV it pulled from
    A (each block checked against A's digests), and its greedy tokens and text are A's own
    (comparable())."""
    cases = prompts(int(time.time()), (70, 150))
    before = transfer_counts(cluster)["B"]
    for prompt in cases:
        got_ids, got_text = complete(cluster["proxy"].url, prompt)
        assert len(got_ids) == MAX_TOKENS
        if comparable(cluster):
            assert (got_ids, got_text) == complete(cluster["A"].url, prompt)
    after = transfer_counts(cluster)["B"]
    assert [a - b for a, b in zip(after, before)] == [len(cases), 0, 0]  # transfers, failed, mismatches
    # the hybrid manager on (two groups) for `sliding` only, as its servers said at start-up
    for name in "AB":
        assert hybrid_groups(cluster, name) == (cluster["kind"] == "sliding"), (name, cluster[name].log_tail())
    wait_idle(cluster)


def hybrid_groups(cluster, name) -> bool:
    """Whether instance `name` said at start-up that it moves a full-attention group and a
    sliding-window one (connector/worker.py's line)."""
    log = cluster[name].log_path.read_text(errors="replace")
    size = (models.TINY_SLIDING if cluster["device"].name == "cpu" else models.GEMMA3_1B)["sliding_window"]
    line = next((x for x in log.splitlines() if "; KV cache groups [" in x), "")
    return "['FullAttentionSpec', 0]" in line and f"['SlidingWindowSpec', {size}]" in line


def stream_and_move(cluster, rng, prompt):
    """A greedy stream of `prompt` through the router, asked to move after 2 to 19 of its tokens
    (again on a 409 while it runs): (the stream, the move's status and record), once both ended."""
    results = []
    s = Stream(cluster["router"].url, {"model": "tiny", "prompt": prompt, "max_tokens": LIVE_MAX_TOKENS,
                                       "temperature": 0, "return_token_ids": True})
    s.at(rng.randrange(2, 20), migrate_async(cluster, results=results, again_while=s))
    s.start()
    (status, record), = finish([s], results)
    return s, status, record


def test_a_moved_request_equals_an_unmoved_one(cluster):
    """A request moved during its decode (pre-copy, then the switch) gives the tokens and text
    of one that stayed where it ran (comparable()); every load of the moves passed its check.
    Under the hybrid manager (`sliding`) the source leases no blocks, saying why, and the router
    recomputes the request on the destination: the same tokens and text."""
    rng = random.Random(int(time.time()))
    if cluster["kind"] == "sliding":
        refused = []
        for prompt in prompts(rng.randrange(1 << 30), (90, 110, 130)):  # until a move reaches a running request
            s, status, record = stream_and_move(cluster, rng, prompt)
            assert s.error is None and len(s.ids) == LIVE_MAX_TOKENS, s.error
            assert (s.ids, s.text) == complete(cluster["A"].url, prompt, LIVE_MAX_TOKENS)
            if not (status == 404 and "no running request" in str(record) or status == 409):  # it ran on till moved
                assert record["outcome"] == "recomputed" and "--disable-hybrid-kv-cache-manager" in str(
                    record["reason"]), (status, record)
                refused.append(record)
                break
        assert refused
        wait_idle(cluster)
        return
    before = transfer_counts(cluster)
    moved = 0
    for prompt in prompts(rng.randrange(1 << 30), (90, 130)):
        s, status, record = stream_and_move(cluster, rng, prompt)
        # on a busy host a request may end before its move reaches the router (404: no running
        # request) or before the destination takes one (409 until the request ended)
        if (status == 404 and "no running request" in str(record) or status == 409) and len(s.ids) == LIVE_MAX_TOKENS:
            record = {"outcome": "finished"}
        assert s.error is None, s.error
        assert record.get("outcome") in ("moved", "finished"), (status, record)
        assert len(s.ids) == LIVE_MAX_TOKENS
        moved += record["outcome"] == "moved"
        # MLA on a CPU: a destination that computed one token (a decode over the moved KV) as well
        if comparable(cluster) or record.get("recomputed_tokens") == 1:
            assert (s.ids, s.text) == complete(record.get("source") or cluster["A"].url, prompt, LIVE_MAX_TOKENS)
    assert moved >= 1
    after = transfer_counts(cluster)
    assert sum(after[n][0] - before[n][0] for n in "AB") >= moved
    assert all(after[n][1:] == before[n][1:] for n in "AB"), (before, after)  # no failed load, no mismatch
    wait_idle(cluster)
