"""The router over HTTP with fake vLLM servers (no vLLM; its real behaviour is
tests/e2e/test_live.py's): its arguments and settings, the admin API's guard, answers with no
instance up, a request sent again or continued elsewhere, the client's Authorization on every
leg, a client that leaves, requests that cannot move."""

import asyncio
import json
import time

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vllm_ext.router.app import ENV_TOKEN, build_app  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402

from .fakes import backend, dead_url, empty, events_of, serving  # noqa: E402


@pytest.mark.parametrize("urls,leases,settings,match", [
    ([], None, Settings(), "--instance: at least one URL"),
    (["a:1"], None, Settings(), "is not an http"),
    (["http://a", "http://b"], ["h:1"], Settings(), "--lease: 1 addresses for 2 instances"),
])
def test_bad_arguments_are_refused(urls, leases, settings, match):
    with pytest.raises(ValueError, match=match):
        build_app(urls, leases, settings)


@pytest.mark.parametrize("knobs,match", [
    ({"policy": "random"}, "policy: 'random'"),
    ({"timeout_s": 0}, "timeout_s: expected a positive"),
    ({"balance_interval_s": 0.0}, "balance_interval_s: expected a positive"),
    ({"health_interval_s": -1.0}, "health_interval_s: expected a positive"),
    ({"health_timeout_s": 0.0}, "health_timeout_s: expected a positive"),
    ({"silent_s": float("nan")}, "silent_s: expected a positive"),
    ({"balance_threshold": 0}, "balance_threshold: expected at least 1"),
    ({"max_stages": 17}, r"max_stages: expected an integer in \[0, 16\]"),
    ({"min_remaining_tokens": -1}, "min_remaining_tokens: expected 0 or more"),
    ({"max_destination_kv_usage": 0.0}, r"max_destination_kv_usage: expected a fraction in \(0, 1\]"),
    ({"max_destination_kv_usage": 1.5}, "max_destination_kv_usage: expected a fraction"),
])
def test_bad_settings_are_refused(knobs, match):
    with pytest.raises(ValueError, match=match):
        Settings(**knobs)


def test_the_command_line_refuses_a_bad_setting(capsys):
    from vllm_ext.router import cli
    with pytest.raises(SystemExit):
        cli.main(["--instance", "http://a", "--balance-interval-s", "0"])
    assert "balance_interval_s: expected a positive number of seconds, got 0.0" in capsys.readouterr().err


def test_a_lease_channel_needs_the_deployment_secret(monkeypatch):
    monkeypatch.delenv("VLLM_EXT_AUTH_SECRET", raising=False)
    monkeypatch.delenv("VLLM_EXT_AUTH_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="deployment secret"):
        build_app(["http://a"], ["127.0.0.1:9"])


def run(calls, token=None, monkeypatch=None):
    if token is None:
        monkeypatch.delenv(ENV_TOKEN, raising=False)
    else:
        monkeypatch.setenv(ENV_TOKEN, token)

    async def main():
        app = build_app([dead_url()], None, Settings(health_interval_s=0.1))
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession() as session:
                return await calls(session, url)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_the_admin_api_is_off_without_a_token_and_needs_it_with_one(monkeypatch):
    async def calls(session, url):
        async with session.get(url + "/instances") as r:
            return r.status, await r.json()
    status, body = run(calls, monkeypatch=monkeypatch)
    assert status == 403 and ENV_TOKEN in body["error"]["message"]

    async def with_token(session, url):
        out = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret"}):
            async with session.get(url + "/instances", headers=headers) as r:
                out.append((r.status, await r.json()))
        async with session.post(url + "/migrate", json={"request_id": "nope"},
                                headers={"Authorization": "Bearer s3cret"}) as r:
            out.append((r.status, await r.json()))
        async with session.post(url + "/drain", json={}, headers={"Authorization": "Bearer s3cret"}) as r:
            out.append((r.status, await r.json()))
        instance = out[2][1][0]["url"]
        for timeout_s in ("soon", -1, None):
            async with session.post(url + "/drain", json={"instance": instance, "timeout_s": timeout_s},
                                    headers={"Authorization": "Bearer s3cret"}) as r:
                out.append((r.status, await r.json()))
        async with session.get(url + "/instances", headers={"Authorization": "Bearer s3cret"}) as r:
            out.append((r.status, await r.json()))
        return out
    (s1, _), (s2, _), (s3, instances), (s4, missing), (s5, bad), *timeouts, (s6, after) = run(
        with_token, "s3cret", monkeypatch)
    for (status, body), value in zip(timeouts, ("'soon'", "-1", "None")):
        assert status == 400 and f"timeout_s: expected a number of seconds in [0, 86400], got {value}" in \
            body["error"]["message"], body
    assert s6 == 200 and not any(i["draining"] for i in after), after  # refused: nothing changed
    assert (s1, s2, s3) == (401, 401, 200) and instances[0]["load"] == 0
    assert s4 == 404 and "no running request 'nope'" in missing["error"]["message"]
    assert s5 == 400 and "instance" in bad["error"]["message"]


def test_with_no_instance_up_requests_get_503_and_bad_bodies_400(monkeypatch):
    async def calls(session, url):
        out = []
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2]}) as r:
            out.append((r.status, await r.json()))
        async with session.post(url + "/v1/completions", data=b"{nope",
                                headers={"Content-Type": "application/json"}) as r:
            out.append((r.status, await r.json()))
        async with session.get(url + "/nowhere") as r:
            out.append((r.status, await r.json()))
        await asyncio.sleep(0.3)  # the health poll finds nothing listening
        async with session.get(url + "/health") as r:
            out.append((r.status, await r.json()))
        return out
    (s1, b1), (s2, _), (s3, b3), (s4, _) = run(calls, monkeypatch=monkeypatch)
    assert s1 == 503 and b1["error"]["type"] == "ServiceUnavailableError"
    assert s2 == 400 and s3 == 404 and b3 == {"detail": "Not Found"} and s4 == 503


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_instance_dies_before_its_first_token_is_sent_again(stream):
    """Nothing reached the client yet: the router sends the request, as it came, to another
    instance (no resume: there is nothing to continue from)."""
    got = []

    async def dies(request):  # accepts the request, then its connection drops
        got.append(("A", await request.json()))
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        request.transport.close()
        return r

    async def answers(request):
        got.append(("B", await request.json()))
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        chunk = {"id": "x", "choices": [{"index": 0, "text": " hi", "token_ids": [7], "prompt_token_ids": [1, 2],
                                         "finish_reason": "length"}]}
        await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return r

    async def go():
        (ra, a), (rb, b) = await backend(dies), await backend(answers)
        runner, url = await serving(build_app([a, b], None, Settings(policy="round_robin", health_interval_s=60)))
        url += "/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json={"model": "m", "prompt": [1, 2], "max_tokens": 1, "stream": stream,
                                             "return_token_ids": True}) as r:
                    return r.status, await r.text()
        finally:
            for x in (runner, ra, rb):
                await x.cleanup()

    status, text = asyncio.run(go())
    assert status == 200 and [who for who, _ in got] == ["A", "B"], (status, text, got)
    assert got[1][1]["prompt"] == [1, 2] == got[0][1]["prompt"] and got[1][1]["max_tokens"] == 1
    assert got[1][1]["kv_transfer_params"]["migration_id"] != got[0][1]["kv_transfer_params"]["migration_id"]
    if stream:
        assert '"token_ids": [7]' in text and text.endswith("data: [DONE]\n\n")
    else:
        assert json.loads(text)["choices"][0]["token_ids"] == [7]


def test_instances_with_an_api_key_get_the_clients_on_every_leg(monkeypatch):
    """Servers started with --api-key: the client's Authorization goes with each leg of its
    request (the first, the one that continues it elsewhere), with a request relayed as is and
    with /v1/models; the router's own /v1/models poll sends vLLM's VLLM_API_KEY. A client
    without the key gets the servers' 401."""
    monkeypatch.setenv("VLLM_API_KEY", "k")
    seen = []

    def keyed(handler):
        async def check(request):
            seen.append((request.path, request.headers.get("Authorization")))
            if request.headers.get("Authorization") != "Bearer k":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)
        return check

    async def dies(request):  # the first leg: one token, then its stream ends unfinished
        await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        chunk = {"id": "x", "choices": [{"index": 0, "text": " a", "token_ids": [7], "prompt_token_ids": [1, 2]}]}
        await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        return r

    async def answers(request):
        body = await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        chunk = {"id": "x", "choices": [{"index": 0, "text": " b", "token_ids": [8], "finish_reason": "length",
                                         "prompt_token_ids": body["prompt"]}]}
        await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return r

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})

    async def keyed_backend(handler):
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, keyed(handler))
        app.router.add_get("/v1/models", keyed(models))
        app.router.add_get("/metrics", empty)
        app.router.add_get("/health", empty)
        return await serving(app)

    async def go():
        (ra, a), (rb, b) = await keyed_backend(dies), await keyed_backend(answers)
        app = build_app([a, b], None, Settings(policy="round_robin", health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        runner, url = await serving(app)
        try:
            while not all(i.models for i in router.instances):  # the router's own poll
                await asyncio.sleep(0.01)
            async with aiohttp.ClientSession() as s:
                auth = {"Authorization": "Bearer k"}
                body = {"model": "m", "prompt": [1, 2], "max_tokens": 2, "stream": True, "return_token_ids": True}
                async with s.post(url + "/v1/completions", json=body, headers=auth) as r:
                    moved = r.status, await r.text()
                async with s.post(url + "/v1/completions", json=dict(body, n=2), headers=auth) as r:
                    relayed = r.status
                async with s.get(url + "/v1/models", headers=auth) as r:
                    listed = r.status
                async with s.get(url + "/v1/models") as r:
                    refused = r.status
            return moved, relayed, listed, refused
        finally:
            for x in (runner, ra, rb):
                await x.cleanup()

    (status, text), relayed, listed, refused = asyncio.run(go())
    assert status == 200 and '"token_ids": [7]' in text and '"token_ids": [8]' in text, text
    assert relayed == 200 and listed == 200 and refused == 401  # n=2: relayed as is
    legs = [key for path, key in seen if path == "/v1/completions"]
    assert len(legs) >= 3 and all(key == "Bearer k" for key in legs), seen  # first leg, resume, relay
    assert [key for path, key in seen if path == "/v1/models"][:2] == ["Bearer k", "Bearer k"], seen  # polls


@pytest.mark.parametrize("movable", [True, False])
def test_a_client_that_leaves_before_its_whole_answer_has_its_request_aborted(movable):
    """Nothing is written to a client that did not stream until its answer is whole: once its
    connection closes, the router closes the request's leg (a relayed one's too), and the
    instance, which would otherwise generate on for nobody, aborts it as for its own client."""
    closed = asyncio.Event()

    async def endless(request):  # streams until its reader goes
        await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        chunk = {"id": "x", "choices": [{"index": 0, "text": " a", "token_ids": [7], "prompt_token_ids": [1]}]}
        try:
            for _ in range(1200):  # at most 60 s
                await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.05)
        except (ConnectionError, RuntimeError):
            closed.set()
        return r

    async def go():
        rb, b = await backend(endless)
        runner, url = await serving(build_app([b], None, Settings(health_interval_s=60)))
        try:
            body = {"model": "m", "prompt": [1], "max_tokens": 5000}
            if not movable:
                body["n"] = 2
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
                with pytest.raises(asyncio.TimeoutError):  # the client gives up and closes its connection
                    async with s.post(url + "/v1/completions", json=body) as r:
                        await r.read()
            await asyncio.wait_for(closed.wait(), 30)
            return closed.is_set()
        finally:
            for x in (runner, rb):
                await x.cleanup()

    assert asyncio.run(go())


def test_a_request_that_cannot_move_is_listed_with_its_reason_while_it_runs(monkeypatch):
    """n > 1 is relayed as is; GET /requests lists it, unmovable and why, until it ends."""
    monkeypatch.setenv(ENV_TOKEN, "s3cret")
    admin = {"Authorization": "Bearer s3cret"}
    release = asyncio.Event()
    got = []

    async def slow(request):
        got.append(await request.json())
        await release.wait()
        return web.json_response({"id": "x", "choices": [{"index": i, "text": "a"} for i in range(2)]})

    async def go():
        rb, b = await backend(slow)
        runner, url = await serving(build_app([b], None, Settings(health_interval_s=60)))
        try:
            async with aiohttp.ClientSession() as s:
                call = asyncio.ensure_future(s.post(url + "/v1/completions",
                                                    json={"model": "m", "prompt": "hi", "n": 2, "max_tokens": 1}))
                while not got:
                    await asyncio.sleep(0.01)
                async with s.get(url + "/requests", headers=admin) as r:
                    during = await r.json()
                async with s.get(url + "/instances", headers=admin) as r:
                    load = (await r.json())[0]["load"]
                release.set()
                async with await call as r:
                    answer = r.status, await r.json()
                async with s.get(url + "/requests", headers=admin) as r:
                    after = await r.json()
                return during, load, answer, after
        finally:
            for x in (runner, rb):
                await x.cleanup()

    during, load, (status, body), after = asyncio.run(go())
    (listed,) = during["running"]
    assert listed["migratable"] is False and listed["why_not"] == "n > 1", listed
    assert listed["request_id"] and "id" not in listed, listed  # the key /migrate takes
    assert load == 1 and status == 200 and len(body["choices"]) == 2 and "kv_transfer_params" not in got[0]
    assert after["running"] == [], after


def test_a_chat_stream_whose_instance_parses_reasoning_relays_it_and_stays_there(monkeypatch):
    """Its reasoning reaches the client apart from the content; from its first reasoning delta
    the request is listed as unmovable, with why, and /migrate refuses it by that reason."""
    from vllm_ext.router.relay import REASONING_PINS

    monkeypatch.setenv(ENV_TOKEN, "s3cret")
    admin = {"Authorization": "Bearer s3cret"}
    release = asyncio.Event()

    async def thinks(request):
        await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)

        async def send(choice, **extra):
            chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [dict(index=0, **choice)], **extra}
            await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await send({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[1, 2])
        await send({"delta": {"reasoning": "two and two"}, "token_ids": [5]})
        await release.wait()
        await send({"delta": {"content": "4"}, "token_ids": [6], "finish_reason": "stop"})
        await r.write(b"data: [DONE]\n\n")
        return r

    async def go():
        (ra, a), (rb, b) = await backend(thinks), await backend(thinks)
        runner, url = await serving(build_app([a, b], None, Settings(health_interval_s=60)))
        try:
            async with aiohttp.ClientSession() as s:
                call = asyncio.ensure_future(s.post(url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "2+2?"}], "stream": True}))
                during, deadline = {"running": []}, time.monotonic() + 30
                while (not during["running"] or during["running"][0]["migratable"]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                    async with s.get(url + "/requests", headers=admin) as r:
                        during = await r.json()
                (listed,) = during["running"]
                to = b if listed["instance"] == a else a
                move = {"request_id": listed["request_id"], "to": to}  # the key /requests lists it by
                async with s.post(url + "/migrate", headers=admin, json=move) as r:
                    refused = r.status, await r.json()
                release.set()
                async with await call as r:
                    text = await r.text()
                return listed, refused, text
        finally:
            for x in (runner, ra, rb):
                await x.cleanup()

    listed, (status, refusal), text = asyncio.run(go())
    assert listed["why_not"] == REASONING_PINS, listed
    assert status == 409 and REASONING_PINS in refusal["error"]["message"], refusal
    deltas = [e["choices"][0]["delta"] for e in events_of(text) if e.get("choices")]
    assert {"content": "", "reasoning": "two and two"} in deltas and {"content": "4"} in deltas, deltas


# ---- hostile clients, hostile backends, a saturated host ---------------------------------------
def _router_for(handlers, settings, calls, models=None):
    """The router (in this process) over fake instances serving `handlers`; `calls(session, url,
    router)`'s result."""
    async def go():
        servers = []
        for handler in handlers:
            app = web.Application()
            for path in ("/v1/completions", "/v1/chat/completions"):
                app.router.add_post(path, handler)
            app.router.add_get("/metrics", empty)
            app.router.add_get("/health", empty)
            if models is not None:
                app.router.add_get("/v1/models", models)
            servers.append(await serving(app))
        app = build_app([u for _, u in servers], None, settings)
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession() as s:
                return await calls(s, url, router)
        finally:
            for x in (runner, *(r for r, _ in servers)):
                await x.cleanup()
    return asyncio.run(go())


def _stream_of(chunks):
    async def handler(request):
        await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for chunk in chunks:
            await r.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")
        return r
    return handler


def _token(i, prompt=None, finish=None):
    choice = {"index": 0, "text": f" t{i}", "token_ids": [i], "finish_reason": finish}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return {"id": "x", "choices": [choice]}


@pytest.mark.parametrize("stream", [True, False])
def test_a_backend_that_sends_past_max_tokens_is_cut_there(stream):
    """The finding: the router relayed tokens past the client's max_tokens. It ends the answer
    at the client's limit, "length", whatever the backend sends on."""
    chunks = [_token(10, prompt=[1, 2])] + [_token(i) for i in range(11, 16)] + [_token(16, finish="length")]

    async def calls(s, url, router):
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": stream, "return_token_ids": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.text()

    status, text = _router_for([_stream_of(chunks)], Settings(health_interval_s=60), calls)
    assert status == 200, text
    if stream:
        events = [e for e in events_of(text) if e.get("choices")]
        ids = [t for e in events for t in e["choices"][0].get("token_ids") or []]
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
        assert ids == [10, 11, 12] and finish == ["length"], text
    else:
        choice = json.loads(text)["choices"][0]
        assert choice["token_ids"] == [10, 11, 12] and choice["finish_reason"] == "length"
        assert choice["text"] == " t10 t11 t12"


@pytest.mark.parametrize("stream", [True, False])
def test_a_crossing_event_whose_text_cannot_be_cut_is_computed_elsewhere(stream):
    """A backend sends, for max_tokens 3, a first token and then three in one event without
    logprobs: the event's text cannot be cut at the limit, so nothing of it reaches the client;
    the leg is broken and the other instance computes the rest from the tokens the client got."""
    bodies = []
    overrun = _stream_of([_token(10, prompt=[1, 2]), {"id": "x", "choices": [
        {"index": 0, "text": " t11 t12 t13", "token_ids": [11, 12, 13], "finish_reason": None}]}])

    async def rest(request):
        bodies.append(await request.json())
        return await _stream_of([_token(21, prompt=bodies[-1]["prompt"]), _token(22, finish="length")])(request)

    async def calls(s, url, router):
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": stream, "return_token_ids": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.text()

    status, text = _router_for([overrun, rest], Settings(health_interval_s=60, policy="round_robin"), calls)
    assert status == 200, text
    if stream:
        events = [e for e in events_of(text) if e.get("choices")]
        ids = [t for e in events for t in e["choices"][0].get("token_ids") or []]
        got = "".join(e["choices"][0].get("text") or "" for e in events)
    else:
        choice = json.loads(text)["choices"][0]
        ids, got = choice["token_ids"], choice["text"]
    assert ids == [10, 21, 22] and got == " t10 t21 t22", text
    assert len(bodies) == 1 and bodies[0]["prompt"] == [1, 2, 10] and bodies[0]["max_tokens"] == 2, bodies


def test_a_backend_event_past_max_event_bytes_breaks_only_that_leg():
    """The finding: the router buffered one 64 MiB event of a backend. An event larger than
    max_event_bytes breaks its leg (the request goes on elsewhere); the instance is not marked
    down for it."""
    huge = _stream_of([dict(_token(10, prompt=[1, 2]), pad="x" * 8192)])
    fine = _stream_of([_token(20, prompt=[1, 2], finish="length")])

    async def calls(s, url, router):
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 1, "return_token_ids": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json(), [i.healthy for i in router.instances]

    status, body, healthy = _router_for([huge, fine], Settings(policy="round_robin", health_interval_s=60,
                                                               max_event_bytes=4096), calls)
    assert status == 200 and body["choices"][0]["token_ids"] == [20] and healthy == [True, True], body


def test_a_request_relayed_as_is_gets_no_backend_params():
    """A producer's kv_transfer_params (remote_prefill_cached_tokens: how much of the prompt its
    cache holds) never reach a client, also of a request relayed as is."""
    async def answers(request):
        await request.json()
        return web.json_response({"id": "x", "choices": [{"index": i, "text": "a"} for i in range(2)],
                                  "kv_transfer_params": {"remote_prefill_cached_tokens": 64}})

    async def calls(s, url, router):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "n": 2}) as r:
            return r.status, await r.json()

    status, body = _router_for([answers], Settings(health_interval_s=60), calls)
    assert status == 200 and len(body["choices"]) == 2 and "kv_transfer_params" not in body, body


def test_health_models_and_errors_tell_no_instance_address_or_model_path():
    async def fails(request):
        await request.json()
        return web.json_response({"error": "boom"}, status=500)

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "root": "/srv/models/m-7b", "parent": None,
                                                              "max_model_len": 64}]})

    async def calls(s, url, router):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": [1]}) as r:
            failed = r.status, await r.text()
        async with s.get(url + "/health") as r:
            health = r.status, await r.json()
        async with s.get(url + "/v1/models") as r:
            listed = r.status, await r.text()
        return failed, health, listed, [i.url for i in router.instances]

    (fs, failed), (hs, health), (ls, listed), urls = _router_for([fails], Settings(health_interval_s=60), calls,
                                                                 models=models)
    assert fs == 503 and "no instance is reachable" in failed and hs == 200 and health == {"instances": [True]}
    assert ls == 200 and '"root": "m"' in listed and "/srv/models" not in listed and '"max_model_len": 64' in listed
    for url in urls:
        assert url not in failed and url.split("//")[1] not in failed, failed


def test_a_body_too_large_gets_413_and_requests_over_the_limit_503_with_retry_after():
    started, release = asyncio.Event(), asyncio.Event()

    async def holds(request):
        await request.json()
        started.set()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b"data: " + json.dumps(_token(10, prompt=[1])).encode() + b"\n\n")
        await release.wait()
        return r

    async def calls(s, url, router):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x" * 5000}) as r:
            large = r.status, await r.json()
        held = asyncio.ensure_future(s.post(url + "/v1/completions", json={"model": "m", "prompt": [1],
                                                                           "stream": True}))
        await asyncio.wait_for(started.wait(), 30)
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": [1]},
                          timeout=aiohttp.ClientTimeout(total=20)) as r:  # bounded: without the limit it waits
            busy = r.status, r.headers.get("Retry-After"), await r.json()
        async with s.get(url + "/health") as r:
            health = r.status  # not counted: a saturated router still says it is up
        (await held).close()
        release.set()
        return large, busy, health

    (s1, b1), (s2, retry, b2), health = _router_for(
        [holds], Settings(health_interval_s=60, max_requests=1, max_body_bytes=4096), calls)
    assert s1 == 413 and "larger than 4096 bytes" in b1["error"]["message"]
    assert s2 == 503 and retry == "1" and "limit of 1 requests at once" in b2["error"]["message"] and health == 200


def test_a_local_limit_marks_no_instance_down():
    """The router's own limit (EMFILE: 'Too many open files') says nothing of an instance: the
    request gets 503 with Retry-After and every instance stays up."""
    import errno

    from vllm_ext.router.app import Router

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())

        def post(*args, **kwargs):
            raise aiohttp.ClientConnectorError(aiohttp.client_reqrep.ConnectionKey(
                "127.0.0.1", 9, False, True, None, None, None), OSError(errno.EMFILE, "Too many open files"))

        class Session:
            pass
        router.fleet.session = Session()
        router.fleet.session.post = post
        app = web.Application()
        app.router.add_post("/v1/completions", router.completions)
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"model": "m", "prompt": [1]}) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json(), [i.healthy for i in router.instances]
        finally:
            await runner.cleanup()

    status, retry, body, healthy = asyncio.run(go())
    assert status == 503 and retry == "1" and "Too many open files" in body["error"]["message"], body
    assert healthy == [True, True]


def test_under_a_low_file_limit_the_excess_gets_503_and_no_instance_is_marked_down(tmp_path):
    """The finding: under `ulimit -n 400`, 600 streams marked both healthy instances down and
    their clients got 503. A router under a file limit of 400 (its default max_requests follows
    it) and 250 streams at once (each would hold two files): each gets its answer or a 503 with
    Retry-After, and both instances stay up."""
    import os
    import resource
    import subprocess
    import sys

    from vllm_ext.fleet import free_port

    async def slow(request):
        await request.json()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for i in range(10):
            await r.write(b"data: " + json.dumps(_token(10 + i, prompt=[1] if i == 0 else None,
                                                        finish="length" if i == 9 else None)).encode() + b"\n\n")
            await asyncio.sleep(0.1)
        await r.write(b"data: [DONE]\n\n")
        return r

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))

    async def go():
        servers = [await backend(slow) for _ in range(2)]
        port = free_port()
        env = dict(os.environ, VLLM_EXT_ROUTER_TOKEN="t")
        log = open(tmp_path / "router.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "vllm_ext.router", "--instance", *(u for _, u in servers),
                                 "--port", str(port), "--health-interval-s", "0.2"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=limit)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=120)) as s:
                for _ in range(300):
                    try:
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)

                async def one():
                    body = {"model": "m", "prompt": [1], "max_tokens": 10, "stream": True, "return_token_ids": True}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        return r.status, r.headers.get("Retry-After"), await r.text()
                results = await asyncio.gather(*(one() for _ in range(250)))
                async with s.get(url + "/instances", headers={"Authorization": "Bearer t"}) as r:
                    instances = await r.json()
            return results, instances
        finally:
            proc.terminate()
            proc.wait(20)
            log.close()
            for runner, _ in servers:
                await runner.cleanup()

    results, instances = asyncio.run(go())
    log = (tmp_path / "router.log").read_text(errors="replace")
    served = [text for status, _, text in results if status == 200]
    refused = [retry for status, retry, _ in results if status == 503]
    assert len(served) + len(refused) == 250, ([s for s, _, _ in results], log[-3000:])
    assert all(retry == "1" for retry in refused) and served, log[-3000:]
    assert all('"token_ids": [19]' in text and text.endswith("data: [DONE]\n\n") for text in served)
    assert all(i["healthy"] for i in instances) and "is down" not in log, log[-3000:]
