"""The P/D proxy: its backend choice (the router's order, placement.Turns) and argument checks,
then the proxy against fake backends."""

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (a vLLM dependency)")

from vllm_ext.router.pd import Pool, build_app  # noqa: E402


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


def test_python_m_vllm_ext_proxy_is_the_p_d_proxy():
    """vllm_ext/proxy.py, which `python -m vllm_ext.proxy` runs, is router/pd.py under its old name."""
    from vllm_ext import proxy
    from vllm_ext.router import pd

    assert proxy.main is pd.main and proxy.build_app is pd.build_app and proxy.Pool is pd.Pool


# ---- the proxy against fake backends (aiohttp servers in this process) ------------------------
def run_with_backends(prefill_handler, decode_handler, client_calls):
    """Starts a fake prefill and decode server and the proxy on free ports of 127.0.0.1, runs
    `client_calls(session, proxy_url)`, stops everything; returns its result."""
    import asyncio

    import aiohttp
    from aiohttp import web

    async def main():
        runners = []
        try:
            urls = []
            for handler in (prefill_handler, decode_handler):
                app = web.Application()
                app.router.add_post("/v1/completions", handler)
                runner = web.AppRunner(app)
                await runner.setup()
                runners.append(runner)
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
            runner = web.AppRunner(build_app([urls[0]], [urls[1]], timeout_s=30))
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            proxy_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                return await client_calls(session, proxy_url)
        finally:
            for runner in reversed(runners):
                await runner.cleanup()

    return asyncio.run(main())


PARAMS = {"do_remote_prefill": True, "remote_lease": "ab" * 16}


async def prefill_answer(request):
    """A prefill server's answer: one token and the kv_transfer_params the decode leg gets."""
    from aiohttp import web

    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})


async def open_stream(request):
    """A decode server's streamed answer, prepared, its first chunk ("a") written."""
    from aiohttp import web

    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
    return out


def test_client_params_are_dropped_headers_forwarded_and_prefill_asks_one_choice():
    from aiohttp import web

    seen = {}

    async def prefill(request):
        seen["prefill"] = (await request.json(), {k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    async def decode(request):
        seen["decode"] = (await request.json(), {k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"choices": [{"text": "hello"}]})

    async def calls(session, url):
        body = {"model": "m", "prompt": "hi", "n": 3, "max_tokens": 5,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_endpoint": {"lease_host": "10.0.0.1"}}}
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": "Bearer k", "X-Request-Id": "rid-7"}) as r:
            return r.status, await r.json()

    status, answer = run_with_backends(prefill, decode, calls)
    assert status == 200 and answer["choices"][0]["text"] == "hello"
    p_body, p_headers = seen["prefill"]
    d_body, d_headers = seen["decode"]
    assert p_body["n"] == 1 and p_body["max_tokens"] == 1 and p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert d_body["kv_transfer_params"] == PARAMS and d_body["n"] == 3  # the prefill leg's, not the client's
    for headers in (p_headers, d_headers):
        assert headers["authorization"] == "Bearer k" and headers["x-request-id"] == "rid-7"


def test_client_params_never_reach_decode_when_prefill_returns_none():
    from aiohttp import web

    seen = {}

    async def prefill(request):
        return web.json_response({"choices": [{"text": "x"}]})

    async def decode(request):
        seen["decode"] = await request.json()
        return web.json_response({"choices": [{"text": "hello"}]})

    async def calls(session, url):
        body = {"model": "m", "prompt": "hi", "kv_transfer_params": PARAMS}
        async with session.post(url + "/v1/completions", json=body) as r:
            return r.status

    assert run_with_backends(prefill, decode, calls) == 200
    assert "kv_transfer_params" not in seen["decode"]


def test_a_prefill_answer_that_is_not_json_gives_502():
    from aiohttp import web

    async def prefill(request):
        return web.Response(status=200, text="<html>oops</html>")

    async def decode(request):
        raise AssertionError("the decode server must not be asked")

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
            return r.status, await r.json()

    status, body = run_with_backends(prefill, decode, calls)
    assert status == 502 and "not JSON" in body["error"]["message"]


def test_a_decode_failure_mid_stream_ends_the_stream_with_an_error_event():
    import json

    async def decode(request):
        out = await open_stream(request)
        request.transport.close()  # the decode server dies mid-stream
        return out

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
            return r.status, (await r.read()).decode()

    status, text = run_with_backends(prefill_answer, decode, calls)
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert status == 200 and events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["code"] == 502  # then EOF (read() returned)


def test_unknown_routes_get_a_json_404():
    async def calls(session, url):
        async with session.get(url + "/v1/nope") as r:
            return r.status, await r.json()

    async def unused(request):
        raise AssertionError("no backend is asked")

    assert run_with_backends(unused, unused, calls) == (404, {"detail": "Not Found"})
