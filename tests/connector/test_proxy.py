"""The proxy's backend choice and argument checks (no servers)."""

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (a vLLM dependency)")

from vllm_ext.proxy import Pool, build_app  # noqa: E402


def test_round_robin_starts_at_the_next_server_each_time():
    pool = Pool("decode", ["http://a", "http://b", "http://c"], "round_robin")
    firsts = [pool.candidates()[0].url for _ in range(6)]
    assert firsts == ["http://a", "http://b", "http://c"] * 2
    assert [b.url for b in pool.candidates()] == ["http://a", "http://b", "http://c"]


def test_least_loaded_prefers_the_idle_server():
    pool = Pool("decode", ["http://a", "http://b"], "least_loaded")
    pool.backends[0].in_flight = 3
    assert [pool.candidates()[0].url for _ in range(4)] == ["http://b"] * 4
    pool.backends[1].in_flight = 5
    assert pool.candidates()[0].url == "http://a"


@pytest.mark.parametrize("prefill,decode,policy,match", [
    ([], ["http://d"], "round_robin", "--prefill: at least one URL"),
    (["http://p"], ["d:8000"], "round_robin", "--decode: 'd:8000' is not an http"),
    (["http://p"], ["http://d"], "random", "policy: 'random'"),
])
def test_bad_arguments_are_refused(prefill, decode, policy, match):
    with pytest.raises(ValueError, match=match):
        build_app(prefill, decode, policy)
