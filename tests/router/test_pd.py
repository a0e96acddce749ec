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
def run_with_backends(prefill_handler, decode_handler, client_calls, settings=None, health=None, models=None):
    """Starts a fake prefill and decode server and the proxy on free ports of 127.0.0.1, runs
    `client_calls(session, proxy_url)`, stops everything; returns its result. A handler may be
    a list (one server each, in that order); `health`, `models`: the servers' GET handlers."""
    import asyncio

    import aiohttp
    from aiohttp import web

    async def main():
        runners = []
        try:
            urls = {"prefill": [], "decode": []}
            for stage, handlers in (("prefill", prefill_handler), ("decode", decode_handler)):
                for handler in handlers if isinstance(handlers, list) else [handlers]:
                    app = web.Application()
                    app.router.add_post("/v1/completions", handler)
                    app.router.add_post("/v1/chat/completions", handler)
                    if health is not None:
                        app.router.add_get("/health", health)
                    if models is not None:
                        app.router.add_get("/v1/models", models)
                    runner = web.AppRunner(app, shutdown_timeout=1)
                    await runner.setup()
                    runners.append(runner)
                    site = web.TCPSite(runner, "127.0.0.1", 0)
                    await site.start()
                    urls[stage].append(f"http://127.0.0.1:{runner.addresses[0][1]}")
            runner = web.AppRunner(build_app(urls["prefill"], urls["decode"], timeout_s=30, settings=settings),
                                   shutdown_timeout=1)
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
        body = {"model": "m", "prompt": "hi", "n": 1, "max_tokens": 5,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_endpoint": {"lease_host": "10.0.0.1"}}}
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": "Bearer k", "X-Request-Id": "rid-7"}) as r:
            return r.status, await r.json()

    status, answer = run_with_backends(prefill, decode, calls)
    assert status == 200 and answer["choices"][0]["text"] == "hello"
    p_body, p_headers = seen["prefill"]
    d_body, d_headers = seen["decode"]
    assert p_body["n"] == 1 and p_body["max_tokens"] == 1 and p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert d_body["kv_transfer_params"] == PARAMS and d_body["max_tokens"] == 5  # the prefill leg's, not the client's
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


# ---- hostile clients and failing decode legs ---------------------------------------------------
SECRET = "proxy-unit-test-deployment-secret"
LEASE = "cd" * 16


class ReleasingProducer:
    """A prefill server's lease channel (a real LeaseServer) recording the leases released, and
    its prefill answer naming a lease on it."""

    def __init__(self):
        from vllm_ext.lease import messages
        from vllm_ext.lease.channel import LeaseServer

        self.released, self.asked, self.refused = [], 0, 0
        self.unanswered = 0  # releases to leave unanswered first (a stopped server), each for stall_s
        self.stall_s = 0.0

        def handler(request):
            import time

            assert isinstance(request, messages.LeaseRelease)
            if request.lease in self.released:  # as an instance answers a lease it ended
                self.refused += 1
                raise ValueError(f"lease {request.lease[:8]}: unknown, released or expired")
            if self.unanswered:
                self.unanswered -= 1
                time.sleep(self.stall_s)  # past the proxy's deadline: it has given this one up
                return messages.LeaseReleaseReply(True), b""
            self.released.append(request.lease)
            return messages.LeaseReleaseReply(True), b""
        self.server = LeaseServer(SECRET.encode(), handler)
        self.params = {"do_remote_prefill": True, "remote_lease": LEASE, "remote_prefill_cached_tokens": 3,
                       "remote_endpoint": {"lease_host": "127.0.0.1", "lease_port": self.server.port}}

    async def answer(self, request):
        from aiohttp import web

        self.asked += 1
        await request.json()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": self.params})

    def wait_released(self, n=1, within_s=10.0):
        import time

        deadline = time.monotonic() + within_s
        while len(self.released) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.released)


@pytest.fixture
def producer(monkeypatch):
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", SECRET)
    p = ReleasingProducer()
    yield p
    p.server.close()


async def never(request):
    import asyncio

    await asyncio.Event().wait()


@pytest.mark.parametrize("body,match", [
    ({"stream": False, "stream_options": {"include_usage": True}}, "Stream options can only be defined when"),
    ({"n": 2}, "one choice per request"),
    ({"best_of": 3}, "one choice per request"),
    ({"max_tokens": -1}, "max_tokens must be at least 1, got -1"),
    ({"max_tokens": "5"}, "max_tokens: expected an integer, got '5'"),
    ({"max_tokens": 4, "min_tokens": 9}, "min_tokens must be less than or equal to max_tokens=4, got 9"),
])
def test_what_the_decode_server_would_refuse_is_refused_before_the_prefill_server(producer, body, match):
    """Fields the prefill leg does not carry (it asks one token, one choice, not streamed): a
    request the decode server would refuse over them gets vLLM's 400 from the proxy, and no
    prefill server is asked (no lease is made for it)."""
    async def decode(request):
        raise AssertionError("the decode server must not be asked")

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json=dict({"model": "m", "prompt": "hi"}, **body)) as r:
            return r.status, await r.json()

    status, answer = run_with_backends(producer.answer, decode, calls)
    assert status == 400 and match in answer["error"]["message"] and answer["error"]["type"] == "BadRequestError"
    assert producer.asked == 0


def _decode_fails(producer, decode, body=None, settings=None, health=None, client_timeout=20.0, release_s=10.0):
    import asyncio

    import aiohttp

    async def calls(session, url):
        request = dict({"model": "m", "prompt": "hi", "max_tokens": 4}, **(body or {}))
        try:
            async with session.post(url + "/v1/completions", json=request,
                                    timeout=aiohttp.ClientTimeout(total=client_timeout)) as r:
                return r.status, await r.read()
        except asyncio.TimeoutError:
            return "left", b""
    result = run_with_backends(producer.answer, decode, calls, settings=settings, health=health)
    return result, producer.wait_released(within_s=release_s)


def test_a_decode_server_that_refuses_frees_the_prefill_lease_at_once(producer):
    """The finding: D refused (vLLM's rejection hook does not run there) and P kept the blocks
    leased until they expired. The proxy releases the lease over P's lease channel at once."""
    from aiohttp import web

    async def refuses(request):
        return web.json_response({"error": {"message": "no", "type": "BadRequestError", "code": 400}}, status=400)

    (status, _), released = _decode_fails(producer, refuses)
    assert status == 400 and released == [LEASE]


def test_a_decode_server_that_dies_frees_the_prefill_lease(producer):
    async def dies(request):  # its connection drops before any answer
        await request.read()
        request.transport.close()

    (status, body), released = _decode_fails(producer, dies)
    assert status == 503 and b"no decode server is reachable" in body and released == [LEASE]


def test_a_stalled_decode_server_gives_504_and_frees_the_prefill_lease(producer):
    """A decode server that begins no answer within first_byte_s and answers no /health (a
    SIGSTOPped one) is given up: 504 when no other is left, and P's lease is released."""
    from vllm_ext.router.settings import ProxySettings

    (status, body), released = _decode_fails(producer, never, settings=ProxySettings(first_byte_s=0.3,
                                                                                     health_timeout_s=0.3),
                                             health=never)
    assert status == 504 and b"no decode server answered within 0.3 s" in body and released == [LEASE]


def test_a_client_that_leaves_frees_the_prefill_lease(producer):
    async def slow(request):  # answers /health: alive, only slow
        await never(request)

    async def alive(request):
        from aiohttp import web
        return web.Response(text="")

    from vllm_ext.router.settings import ProxySettings

    (status, _), released = _decode_fails(producer, slow, settings=ProxySettings(first_byte_s=0.2),
                                          health=alive, client_timeout=1.0)
    assert status == "left" and released == [LEASE]


@pytest.mark.parametrize("decode_releases", [True, False], ids=["decode-released", "decode-died-first"])
def test_a_served_requests_lease_is_released_after_its_answer(producer, decode_releases):
    """A decode server releases the lease it pulled (or chose not to pull) itself; one killed
    before its release went out (the soak: B killed just after an answer whose prompt its own
    prefix cache held) left P's blocks leased until the lease expired. Nothing else may use the
    lease once its request is answered, so the proxy releases it served_release_s after the
    answer (refused, and not logged, when D did). The answer reaches the client without the
    backend's kv_transfer_params (a producer's tell how much of the prompt its cache holds)."""
    import asyncio
    import time

    from aiohttp import web

    from vllm_ext.lease.channel import LeaseClient
    from vllm_ext.router.settings import ProxySettings

    async def decode(request):
        assert (await request.json())["kv_transfer_params"] == producer.params
        if decode_releases:  # as a real decode server does, over P's lease channel
            client = LeaseClient(SECRET.encode(), "127.0.0.1", producer.server.port)
            await asyncio.get_running_loop().run_in_executor(None, client.release, LEASE, 5.0)
            client.close()
        return web.json_response({"choices": [{"text": "hello"}], "kv_transfer_params": producer.params})

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}) as r:
            answer = r.status, await r.json()
        at_answer = list(producer.released)
        # the proxy's release, or (D released it) its refusal: a second release would show
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and len(producer.released) + producer.refused < 1 + decode_releases:
            await asyncio.sleep(0.05)
        return answer, at_answer, list(producer.released)

    answer, at_answer, released = run_with_backends(producer.answer, decode, calls,
                                                    settings=ProxySettings(served_release_s=0.5))
    assert answer == (200, {"choices": [{"text": "hello"}]})
    assert at_answer == ([LEASE] if decode_releases else [])  # the proxy waits served_release_s
    assert released == [LEASE]  # once: by D, else by the proxy after the answer
    assert producer.refused == (1 if decode_releases else 0)  # the proxy's, after D's


def test_a_stalled_prefill_server_is_skipped():
    """The first prefill server begins no answer and answers no /health: the next one serves."""
    import aiohttp
    from aiohttp import web

    from vllm_ext.router.settings import ProxySettings

    health = {"stalled": False}

    async def stalls(request):
        health["stalled"] = True
        await never(request)

    async def ready(request):
        if health["stalled"]:
            await never(request)  # every fake shares the handler: the first asked is the stalled one
        return web.Response(text="")

    async def decode(request):
        return web.json_response({"choices": [{"text": "hello"}]})

    async def calls(session, url):  # bounded: without the deadline the proxy waits on the stalled one
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                                timeout=aiohttp.ClientTimeout(total=20)) as r:
            return r.status, await r.json()

    status, body = run_with_backends([stalls, prefill_answer], decode, calls,
                                     settings=ProxySettings(first_byte_s=0.3, health_timeout_s=0.3), health=ready)
    assert status == 200 and body["choices"][0]["text"] == "hello"


def test_health_and_models_tell_no_address_or_path():
    """/health says each server's state in command-line order, not its URL; /v1/models gives
    each model's id where vLLM puts its path (root)."""
    from aiohttp import web

    async def ok(request):
        return web.Response(text="")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "root": "/srv/models/tiny-7b",
                                                              "parent": None, "max_model_len": 2048}]})

    async def calls(session, url):
        async with session.get(url + "/health") as r:
            health = r.status, await r.json()
        async with session.get(url + "/v1/models") as r:
            return health, (r.status, await r.text())

    (hs, health), (ms, text) = run_with_backends(prefill_answer, prefill_answer, calls, health=ok, models=models)
    assert hs == 200 and health == {"prefill": [True], "decode": [True]}
    assert ms == 200 and "/srv/models" not in text and '"root": "tiny"' in text and '"max_model_len": 2048' in text


def test_a_body_too_large_gets_413_and_requests_over_the_limit_503_with_retry_after():
    import asyncio

    import aiohttp

    from vllm_ext.router.settings import ProxySettings

    started = asyncio.Event()

    async def decode(request):
        started.set()
        await never(request)

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "x" * 5000}) as r:
            large = r.status, await r.json()
        held = asyncio.ensure_future(session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}))
        await asyncio.wait_for(started.wait(), 30)
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                                timeout=aiohttp.ClientTimeout(total=20)) as r:  # bounded: without the limit it waits
            busy = r.status, r.headers.get("Retry-After"), await r.json()
        held.cancel()
        return large, busy

    (s1, b1), (s2, retry, b2) = run_with_backends(
        prefill_answer, decode, calls, settings=ProxySettings(max_requests=1, max_body_bytes=4096))
    assert s1 == 413 and "larger than 4096 bytes" in b1["error"]["message"]
    assert s2 == 503 and retry == "1" and "limit of 1 requests at once" in b2["error"]["message"]


# ---- what a decode server can make the proxy relay or hold -------------------------------------
def overrunning(tokens, extra_event=None, per_chunk=1):
    """A decode server that streams `tokens` `per_chunk` to a chunk (with vLLM's continuous usage
    when asked), whatever max_tokens says, then `extra_event`, usage and [DONE]; the bodies it got."""
    import json

    from aiohttp import web

    bodies = []

    async def decode(request):
        body = await request.json()
        bodies.append(body)
        usage = (body.get("stream_options") or {}).get("continuous_usage_stats")
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for n in range(per_chunk, len(tokens) + per_chunk, per_chunk):
            some = tokens[n - per_chunk:n]
            n = min(n, len(tokens))
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "text": "".join(f"t{t} " for t in some), "token_ids": some,
                                  "finish_reason": None}]}
            if usage:
                chunk["usage"] = {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if extra_event is not None:
            await out.write(extra_event)
        await out.write(b'data: {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": '
                        + str(len(tokens)).encode() + b"}}\n\ndata: [DONE]\n\n")
        return out

    return decode, bodies


def _stream(proxy_body):
    async def calls(session, url):
        async with session.post(url + "/v1/completions", json=proxy_body) as r:
            return r.status, (await r.read()).decode()
    return calls


def _events(text):
    import json

    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_ends_at_the_clients_max_tokens_whatever_the_decode_server_sends(usage):
    """The decode server sends 12 tokens for max_tokens 5: the client gets the first 5, the fifth
    finishing "length", then [DONE] (and usage saying 5, when it asked for usage), nothing more."""
    decode, bodies = overrunning(list(range(100, 112)))
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    status, text = run_with_backends(prefill_answer, decode, _stream(body))
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]", text
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in range(100, 105)], text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks), text  # the continuous usage the proxy asked for is not told
    usage_events = [e for e in events[:-1] if not e.get("choices")]
    assert [e["usage"]["completion_tokens"] for e in usage_events] == ([5] if usage else []), text
    asked = bodies[0]["stream_options"]
    assert asked["include_usage"] and asked["continuous_usage_stats"] and bodies[0]["max_tokens"] == 5


def test_a_crossing_chunk_whose_text_cannot_be_cut_ends_the_stream_with_an_error():
    """The decode server sends 12 tokens two to a chunk, without logprobs, for max_tokens 5: the
    client gets the first two chunks (4 tokens and their text), then an error event that says
    why; never the third chunk, whose text holds a sixth token."""
    decode, _ = overrunning(list(range(100, 112)), per_chunk=2)
    status, text = run_with_backends(prefill_answer, decode,
                                     _stream({"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}))
    events = _events(text)
    assert status == 200 and [e["choices"][0]["token_ids"] for e in events[:-1]] == [[100, 101], [102, 103]], text
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "t100 t101 t102 t103 ", text
    error = events[-1]["error"]
    assert error["type"] == "BadGatewayError" and "past the client's max_tokens (5)" in error["message"] \
        and "cannot cut" in error["message"], text


def test_a_whole_answer_past_max_tokens_is_cut_or_refused():
    """A whole answer of 9 tokens for max_tokens 3: cut where its logprobs' tokens spell its text
    (usage says 3), a 502 when its text cannot be cut there (no logprobs)."""
    import json

    from aiohttp import web

    tokens = [f" w{i}" for i in range(9)]

    async def decode(request):
        with_logprobs = (await request.json()).get("logprobs") is not None
        logprobs = {"tokens": tokens, "token_logprobs": [0.0] * 9, "text_offset": [3 * i for i in range(9)]}
        choice = {"index": 0, "text": "".join(tokens), "token_ids": list(range(9)), "finish_reason": "length",
                  "logprobs": logprobs if with_logprobs else None}
        return web.json_response({"choices": [choice], "usage": {"prompt_tokens": 2, "completion_tokens": 9}})

    async def calls(session, url):
        got = []
        for extra in ({"logprobs": 0}, {}):
            body = dict({"model": "m", "prompt": "hi", "max_tokens": 3, "return_token_ids": True}, **extra)
            async with session.post(url + "/v1/completions", json=body) as r:
                got.append((r.status, json.loads(await r.read())))
        return got

    (status, answer), (status2, refused) = run_with_backends(prefill_answer, decode, calls)
    assert status == 200 and answer["choices"][0]["text"] == " w0 w1 w2" and answer["choices"][0]["token_ids"] == \
        [0, 1, 2] and answer["usage"]["completion_tokens"] == 3, answer
    assert status2 == 502 and "past the client's max_tokens" in refused["error"]["message"], refused


def test_an_event_larger_than_the_proxy_holds_ends_the_stream_with_an_error():
    """One event of the decode server over max_event_bytes: the stream ends with an error event
    after what came before it; the proxy never holds it."""
    from vllm_ext.router.settings import ProxySettings

    decode, _ = overrunning([1, 2], extra_event=b"data: " + b"x" * (64 << 10) + b"\n\n")
    status, text = run_with_backends(prefill_answer, decode, _stream({"model": "m", "prompt": "hi", "stream": True}),
                                     settings=ProxySettings(max_event_bytes=16 << 10))
    events = _events(text)
    assert status == 200 and [e["choices"][0]["token_ids"] for e in events[:2]] == [[1], [2]], text
    assert events[-1]["error"]["type"] == "BadGatewayError" and "larger than the proxy holds" in text, text


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_load_is_asked_again_once_without_the_remote_kv(producer, stream):
    """A decode server answers vLLM's internal error of a failed KV load (policy "fail"): the
    proxy asks again, once, without kv_transfer_params, and releases the prefill lease; the
    client gets the second answer."""
    import json

    from aiohttp import web

    bodies = []

    async def decode(request):
        body = await request.json()
        bodies.append(body)
        failed = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}
        if "kv_transfer_params" in body:
            if not body.get("stream"):
                return web.json_response(failed, status=500)
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: " + json.dumps(failed).encode() + b"\n\ndata: [DONE]\n\n")
            return out
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "computed"}]})
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"index": 0, "text": "computed", "finish_reason": "length"}]}\n\n'
                        b"data: [DONE]\n\n")
        return out

    (status, raw), released = _decode_fails(producer, decode, body={"stream": stream})
    assert status == 200 and b"computed" in raw and b"error" not in raw, raw
    assert [("kv_transfer_params" in b) for b in bodies] == [True, False]
    assert released == [LEASE]


NOT_A_FAILED_LOAD = [  # vLLM's other 5xx answers: an overload, an internal error of its own
    (503, {"message": "Request failed; please retry", "type": "ServiceUnavailableError", "code": 503}),
    (503, {"message": "Internal server error", "type": "InternalServerError", "code": 503}),
    (500, {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
           "type": "InternalServerError", "code": 500}),
    (500, {"message": "Internal server error", "type": "NotImplementedError", "code": 500}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code,error", NOT_A_FAILED_LOAD)
def test_an_overload_or_another_internal_error_is_relayed_not_recomputed(producer, stream, code, error):
    """Only vLLM's error of a failed KV load (its GenerationError: 500, "Internal server error")
    is asked again without the remote KV: a 503 (overload) or another 5xx is relayed to the
    client as it is and the decode server is asked once (a refusal also releases the prefill lease)."""
    import json

    from aiohttp import web

    bodies = []
    error = dict(error, param=None)

    async def decode(request):
        bodies.append(await request.json())
        if not bodies[-1].get("stream"):
            return web.json_response({"error": error}, status=code)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
        return out

    (status, raw), released = _decode_fails(producer, decode, body={"stream": stream}, release_s=0 if stream else 10)
    assert status == (200 if stream else code) and error["message"].encode() in raw, (status, raw)
    assert [("kv_transfer_params" in b) for b in bodies] == [True], bodies
    assert stream or released == [LEASE]  # a relayed stream is the decode server's (its lease too)


def test_a_release_the_prefill_server_does_not_answer_is_asked_again(producer, monkeypatch):
    """The prefill server answers no release at first (SIGSTOPped in the soak: the lease then held
    its blocks until it expired): the proxy asks again, and the lease is released."""
    import asyncio
    import time

    from aiohttp import web

    from vllm_ext.router import pd
    from vllm_ext.router.settings import ProxySettings

    monkeypatch.setattr(pd, "RELEASE_BACKOFF_S", 0.05, raising=False)
    producer.unanswered, producer.stall_s = 2, 1.0

    async def refuses(request):
        return web.json_response({"error": {"message": "no", "type": "BadRequestError", "code": 400}}, status=400)

    async def calls(session, url):
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
            status = r.status
        deadline = time.monotonic() + 15
        while not producer.released and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return status

    status = run_with_backends(producer.answer, refuses, calls, settings=ProxySettings(release_timeout_s=0.3))
    assert status == 400 and producer.released == [LEASE] and producer.unanswered == 0
