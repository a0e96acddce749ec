"""Seeded random streams across a move (vllm_ext/connector/sampling.py): a fresh generator that
skips n sampled tokens' draws then draws exactly what the source's generator would draw next;
on CPU by replaying the draws, on CUDA by moving the Philox offset. Then the same through vLLM's
own sampler, found on the call stack as the connector finds it, and the scheduler's choice of
which requests skip how many draws."""

import os
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_ext.connector import compat, sampling
from vllm_ext.connector.sampling import SeededStreams

VOCAB = 1000


def need_vllm():
    if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
        import vllm
        return vllm
    return pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")


def plain_draw(generator):
    """One token's draws as vLLM V1's native sampler makes them: exponential noise over a row."""
    torch.empty(1, VOCAB, device=generator.device)[0].exponential_(generator=generator)


def sample(generator, logits):
    """What a token's draw decides: the Gumbel-max choice over `logits`."""
    q = torch.empty_like(logits).exponential_(generator=generator)
    return int((logits.softmax(-1) / q).argmax())


def streams_of(generators, kind="generator:test"):
    return SeededStreams(kind, generators.get, plain_draw)


def check_skip_continues_the_stream(device):
    rng = random.Random()
    seed, n, k = rng.randrange(1 << 62), rng.randrange(1, 300), 20
    logits = torch.randn(VOCAB, device=device)
    source = torch.Generator(device=device)
    source.manual_seed(seed)
    for _ in range(n):
        plain_draw(source)
    want = [sample(source, logits) for _ in range(k)]

    moved = torch.Generator(device=device)
    moved.manual_seed(seed)
    streams = streams_of({"r": moved})
    assert streams.skip("r", n)
    assert [sample(moved, logits) for _ in range(k)] == want
    assert streams.one_int_per_draw is (False if device == "cpu" else None)  # CPU: replayed, draw by draw

    restarted = torch.Generator(device=device)  # what a destination without the skip would draw
    restarted.manual_seed(seed)
    assert [sample(restarted, logits) for _ in range(k)] != want


def test_a_skipped_cpu_generator_draws_what_the_source_would_draw_next():
    check_skip_continues_the_stream("cpu")


@pytest.mark.gpu
def test_a_skipped_cuda_generator_draws_what_the_source_would_draw_next():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_skip_continues_the_stream("cuda")


def test_what_cannot_be_skipped_says_so():
    g = torch.Generator()
    g.manual_seed(1)
    state = g.get_state()
    assert not SeededStreams("").skip("r", 5)  # an instance that does not know how it samples
    assert not streams_of({}).skip("r", 5)  # no generator for the request in the runner
    assert SeededStreams("position:cuda:0.26").skip("r", 5)  # keyed by position: nothing to skip
    assert torch.equal(g.get_state(), state)


# ---- through vLLM's own sampler -----------------------------------------------------------------
class FakeRunner:
    """What the connector needs of vLLM's V1 model runner: its sampler and its requests."""

    def __init__(self, topk_topp, generators):
        self.sampler = SimpleNamespace(topk_topp_sampler=topk_topp)
        self.requests = {r: SimpleNamespace(generator=g) for r, g in generators.items()}

    def execute_model(self):
        raise AssertionError("not called")

    def initialize_kv_cache(self, vllm_config):  # registers the caches: the connector looks from here
        return sampling.find(vllm_config)


def cpu_config(v2=False):
    return SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"), use_v2_model_runner=v2,
                           model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB))


def test_vllms_sampler_continues_a_skipped_stream_token_for_token():
    import importlib

    vllm = need_vllm()
    if compat.release() >= (0, 34):
        pytest.skip(f"vLLM {vllm.__version__} has no model runner V1: seeded requests draw by position, no generator")
    importlib.import_module("vllm._custom_ops")  # loads the kernels the CPU sampler calls (a server has them)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    topk_topp = TopKTopPSampler()
    rng = random.Random()
    seed, n, k = rng.randrange(1 << 31), rng.randrange(1, 2000), 30
    logits = torch.randn(1, VOCAB) * 3

    def tokens(generator, count):
        return [int(topk_topp(logits.clone(), {0: generator}, None, None)[0][0]) for _ in range(count)]

    source = torch.Generator().manual_seed(seed)
    want = tokens(source, n + k)[n:]
    moved = torch.Generator().manual_seed(seed)
    found = FakeRunner(topk_topp, {"r": moved}).initialize_kv_cache(cpu_config())
    release = ".".join(vllm.__version__.split(".")[:2])
    assert found.kind == f"generator:cpu:{release}"
    assert found.skip("r", n) and tokens(moved, k) == want
    assert found.one_int_per_draw  # vLLM 0.32's CPU sampler: n tokens skipped by n integers in one call
    assert tokens(torch.Generator().manual_seed(seed), k) != want  # without the skip: another stream


def test_the_kind_names_the_sampler_and_an_unknown_runner_is_said_so():
    vllm = need_vllm()
    release = ".".join(vllm.__version__.split(".")[:2])
    assert FakeRunner(None, {}).initialize_kv_cache(cpu_config(v2=True)).kind == f"position:cpu:{release}"
    assert sampling.find(cpu_config()).kind == ""  # no runner on the call stack


# ---- which requests skip how many draws (the scheduler half) ------------------------------------
def test_the_scheduler_tells_the_worker_which_new_requests_skip_how_many_draws():
    need_vllm()
    from vllm import SamplingParams

    from vllm_ext.connector.scheduler import SchedulerHalf

    sched = SchedulerHalf(is_producer=False, is_consumer=True, block_size=16, lease_s=30.0, lease_host="127.0.0.1",
                          lease_port=0, secret=b"unit-test-deployment-secret-0123", failure_policy="recompute")

    def new(req_id, prompt_len, params, **sampling_args):
        sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}, **sampling_args)
        return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)), sampling_params=sp)

    mid = {"migration_id": "ab" * 16}
    out = SimpleNamespace(scheduled_new_reqs=[
        new("seeded", 40, dict(mid, sampled_tokens=12), seed=7, temperature=0.9),
        new("greedy", 40, dict(mid, sampled_tokens=12), seed=7, temperature=0.0),
        new("unseeded", 40, dict(mid, sampled_tokens=12), temperature=0.9),
        new("fresh", 40, dict(mid), seed=7, temperature=0.9),
        new("too-many", 40, dict(mid, sampled_tokens=40), seed=7, temperature=0.9),
        new("not-an-int", 40, dict(mid, sampled_tokens="12"), seed=7, temperature=0.9),
    ])
    assert sched.build_connector_meta(out).skip_draws == {"seeded": 12}
    assert sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).skip_draws == {}
