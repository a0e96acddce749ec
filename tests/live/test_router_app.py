"""The router's arguments, admin API guard and answers with no instance up (no vLLM; its real
behaviour is tests/live/test_live_e2e.py's)."""

import asyncio
import json
import socket
import time

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vllm_ext.router.app import ENV_TOKEN, Router, build_app  # noqa: E402
from vllm_ext.router.relay import ClientGone, LegFailed  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402
from vllm_ext.router.state import Routed  # noqa: E402


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


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
        runner, url = await _serving(app)
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


# ---- the switch: the pump and the driver's stop, over a fake leg --------------------------------
class _Content:
    """A backend stream's body: events the test puts, and the wake-up a stop sets."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self._error = None

    async def readuntil(self, sep, **_):
        while self._error is None:
            try:
                return await asyncio.wait_for(self.events.get(), 0.01)
            except asyncio.TimeoutError:
                pass
        error, self._error = self._error, None
        raise error

    def set_exception(self, error):
        self._error = error

    def exception(self):
        return self._error


class _Response:
    """A backend's answer, as the pump reads it (aiohttp's ClientResponse)."""

    def __init__(self):
        self.content, self.closed, self.released = _Content(), False, False

    def close(self):
        self.closed = True

    def release(self):
        self.released = True


def _take(routed, inst, response=None):
    """`routed`'s leg is now one on `inst` (its response a fake one unless given); that response."""
    from vllm_ext.router.state import Leg

    response = response or _Response()
    routed.take(Leg(response, inst))
    return response


class _Out:
    def __init__(self):
        self.chunks = []

    async def write(self, data):
        self.chunks.append(data)


def _token_event(token_id, prompt=None, finish=None):
    choice = {"index": 0, "text": f" t{token_id}", "token_ids": [token_id], "logprobs": None, "finish_reason": finish}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return ("data: " + json.dumps({"id": "c", "choices": [choice]}) + "\n\n").encode()


def _switch(gap_s, tokens_after_stop):
    """A routed request with a leg; the driver's stop while the pump relays. Returns (what stop
    returned, the client's token ids, the leg, seconds the stop took)."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = _take(routed, router.instances[0])
        out = _Out()
        for t in (10, 11):  # two tokens: the client's last gap between tokens is known
            await leg.content.events.put(_token_event(t))
        pump = asyncio.ensure_future(router.relay.pump(routed, out))
        while len(client.token_ids) < 2:
            await asyncio.sleep(0.005)
        client.last_gap_s = gap_s
        driver = router.migrations.driver(routed)
        started = asyncio.get_running_loop().time()
        stop = asyncio.ensure_future(driver.stop())
        await asyncio.sleep(0.05)
        assert not stop.done() or not tokens_after_stop  # it waits for the source's next token
        for t in tokens_after_stop:
            await leg.content.events.put(_token_event(t))
        stopped = await stop
        took = asyncio.get_running_loop().time() - started
        assert await pump == "stopped" and routed.leg is None
        return stopped, list(client.token_ids), leg, took

    return asyncio.run(go())


def test_the_stop_comes_right_after_the_sources_next_token(monkeypatch):
    monkeypatch.setattr("vllm_ext.router.driver.STOP_WAIT_MAX_S", 60.0)  # a slow host does not make the token late
    stopped, ids, leg, _ = _switch(gap_s=30.0, tokens_after_stop=[12, 13, 14])
    # 12 reached the client, then the leg closed: 13 and 14 were never relayed
    assert stopped is True and ids == [10, 11, 12] and leg.closed


def test_a_late_token_does_not_hold_the_stop_past_twice_the_last_gap():
    stopped, ids, leg, took = _switch(gap_s=0.1, tokens_after_stop=[])
    assert stopped is True and ids == [10, 11] and leg.closed
    assert took >= 0.2  # it waited for the token that did not come, as long as it may


class _Buffered:
    """A backend stream whose events all arrived already: like aiohttp's reader, a read returns
    without yielding to the loop (b"" at the end)."""

    def __init__(self, events):
        self.events = list(events)

    async def readuntil(self, sep, **_):
        return self.events.pop(0) if self.events else b""


def test_a_stream_that_arrives_faster_than_it_is_relayed_does_not_hold_the_loop():
    """Other streams, migrations and the admin API run between a stream's events, also while
    the next event is already buffered (an aiohttp read then returns without yielding)."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        _take(routed, router.instances[0]).content = _Buffered([_token_event(t) for t in range(100, 300)])
        seen = []  # the client's token count each time the other task ran

        async def other():
            for _ in range(5):
                seen.append(len(client.token_ids))
                await asyncio.sleep(0)
        pump = asyncio.ensure_future(router.relay.pump(routed, _Out()))
        others = asyncio.ensure_future(other())
        assert await pump == "ended" and len(client.token_ids) == 200
        await others
        return seen

    seen = asyncio.run(go())
    assert len(set(seen)) == 5 and max(seen) < 200, seen


def _describing_lease_servers(secret: str, replies):
    """Real lease servers, one per (sampler, default_max_tokens, max_tokens_cap), answering
    lease.describe; `asked` lists the samplers of those asked."""
    from vllm_ext.lease import messages
    from vllm_ext.lease.channel import LeaseServer

    asked = []

    def serving(sampler, default, cap):
        def handler(request):
            asked.append(sampler)
            assert isinstance(request, messages.LeaseDescribe)
            return messages.LeaseDescribeReply({}, "0" * 32, {}, sampler, default, cap), b""
        return handler
    return [LeaseServer(secret.encode(), serving(*reply)) for reply in replies], asked


def test_a_seeded_request_moves_only_between_instances_that_sample_alike(monkeypatch):
    """The router asks each instance's lease channel (real lease servers here) how it samples:
    a seeded request may go only where its random stream goes on; others go anywhere."""
    from vllm_ext.router.openai import ClientStream

    secret = "router-unit-test-deployment-secret"
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", secret)
    samplers = {"A": "generator:cpu:0.32", "B": "generator:cpu:0.32", "C": "position:cuda:0.26", "D": ""}
    servers, asked = _describing_lease_servers(secret, [(k, 0, 0) for k in samplers.values()])
    try:
        urls = {n: f"http://{n.lower()}.invalid" for n in samplers}
        router = Router(list(urls.values()), [f"127.0.0.1:{s.port}" for s in servers], Settings())

        def refusal(body, to):
            routed = Routed("cmpl-1", body, False, ClientStream("cmpl-1", False, "m", False, want_usage=False))
            routed.instance = router.instances[0]
            return asyncio.run(router.migrations.driver(routed).refuse(urls[to]))

        seeded = {"prompt": [1, 2], "seed": 5, "temperature": 0.8}
        assert refusal(seeded, "B") is None
        for to in "CD":
            why = refusal(seeded, to)
            assert "random stream would not go on there" in why and repr(samplers["A"]) in why, why
        assert len(asked) == 4  # each instance asked once, then known (until it is marked down)
        asked.clear()
        for body in ({"prompt": [1, 2], "temperature": 0.8}, {"prompt": [1, 2], "seed": 5, "temperature": 0}):
            assert refusal(body, "D") is None
        assert asked == []  # nothing to ask for requests with no random stream of their own
    finally:
        for s in servers:
            s.close()
        for inst in router.instances:
            inst.control.close()


class _StuckOut:
    """A client that stopped reading: its third write never completes."""

    def __init__(self):
        self.writes = 0

    async def write(self, data):
        self.writes += 1
        if self.writes >= 3:
            await asyncio.Event().wait()


def test_a_client_that_stopped_reading_does_not_hold_a_migrations_stop():
    """The pump's write to the client has the timeout setting's deadline (the client is then
    gone), and the stop waits for the pump at most that long (plus STOP_WAIT_MAX_S)."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings(timeout_s=0.2))
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = _take(routed, router.instances[0])
        for t in (10, 11, 12):
            await leg.content.events.put(_token_event(t))
        pump = asyncio.ensure_future(router.relay.pump(routed, _StuckOut()))
        while len(client.token_ids) < 3:
            await asyncio.sleep(0.01)
        driver = router.migrations.driver(routed)
        stopped = await asyncio.wait_for(driver.stop(), 60)
        with pytest.raises(ClientGone, match="the client took nothing for 0.2 s"):
            await pump
        return stopped, driver.late_stop

    stopped, late = asyncio.run(go())
    assert stopped is False and late == "the stream did not stop within 1.2 s"


async def _empty(request):
    return web.Response(text="")


async def _serving(app):
    """`app` served on a free port of 127.0.0.1: (its runner, to clean up; its URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _backend(handler, metrics=_empty):
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", _empty)
    return await _serving(app)


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
        (ra, a), (rb, b) = await _backend(dies), await _backend(answers)
        runner, url = await _serving(build_app([a, b], None, Settings(policy="round_robin", health_interval_s=60)))
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

    async def backend(handler):
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, keyed(handler))
        app.router.add_get("/v1/models", keyed(models))
        app.router.add_get("/metrics", _empty)
        app.router.add_get("/health", _empty)
        return await _serving(app)

    async def go():
        (ra, a), (rb, b) = await backend(dies), await backend(answers)
        app = build_app([a, b], None, Settings(policy="round_robin", health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        runner, url = await _serving(app)
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
        rb, b = await _backend(endless)
        runner, url = await _serving(build_app([b], None, Settings(health_interval_s=60)))
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


def _routed_on(router, inst, tokens=(5, 6), rid="c"):
    from vllm_ext.router.openai import ClientStream

    client = ClientStream(rid, False, "m", want_ids=True, want_usage=False)
    client.prompt_token_ids = [1, 2]
    client.token_ids = list(tokens)
    routed = Routed(rid, {"model": "m", "prompt": [1, 2], "max_tokens": 9}, False, client)
    routed.instance = inst
    return routed


def test_only_a_resume_that_loads_kv_reads_the_migrations_salted_blocks():
    """The moved KV is cached under the migration's salt; a recompute resume has none, so it
    reads the destination's prefix cache like any request (a prefix it holds is not recomputed)."""

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append((inst, url, body, first_token))
            _take(routed, inst)
        router.relay.open = fake_open
        driver = router.migrations.driver(_routed_on(router, a))
        await driver.resume(b.url, {"migration_id": driver.next_mid})
        lease = {"migration_id": driver.next_mid, "remote_lease": "l", "do_remote_prefill": True}
        await driver.resume(b.url, lease)
        return driver, sent

    driver, sent = asyncio.run(go())
    (_, url, recompute, first), (_, _, loads, _) = sent
    assert url.endswith("/v1/completions") and first and recompute["prompt"] == [1, 2, 5, 6]
    assert "cache_salt" not in recompute and loads["cache_salt"] == driver.cache_salt
    assert recompute["max_tokens"] == 7 and recompute["kv_transfer_params"] == {"migration_id": driver.next_mid}


class _Control:
    """A destination's lease channel whose every trace is `reply` (None: it does not answer)."""

    def __init__(self, reply):
        self.reply = reply

    def settled_trace(self, mid, wait_s):
        return self.trace(mid)

    def close(self):
        pass

    def trace(self, mid):
        from vllm_ext.lease.channel import ChannelError

        if self.reply is None:
            raise ChannelError("lease channel 127.0.0.1:10: no answer within 5 s")
        return self.reply


@pytest.mark.parametrize("case", ["vouched", "unsafe", "unsettled", "silent", "no channel"])
def test_a_resume_that_loaded_kv_is_kept_only_when_the_destination_vouches_for_the_load(case):
    """Its first token is relayed only once the destination's trace says its load did not fail
    under a step in flight; unsafe or unknown (no settled answer), the leg is dropped and the
    request is the source's again: its recovery tries the source first (whose prefix cache
    holds the request's blocks)."""
    from vllm_ext.lease import messages

    def trace(unsafe=False, settled=True):
        return messages.MigrateTraceReply(1.0, 2.0, 3.0, unsafe=unsafe, settled=settled, load_failed=unsafe)

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        b.control = {"vouched": _Control(trace()), "unsafe": _Control(trace(unsafe=True)),
                     "unsettled": _Control(trace(settled=False)), "silent": _Control(None),
                     "no channel": None}[case]
        legs, tried = [], []

        async def fake_open(routed, inst, url, body, first_token=False):
            tried.append(inst)
            legs.append(_take(routed, inst))
        router.relay.open = fake_open
        routed = _routed_on(router, a)
        a.requests[routed.rid] = routed
        driver = router.migrations.driver(routed)
        lease = {"migration_id": driver.next_mid, "remote_lease": "l", "do_remote_prefill": True}
        try:
            kept = await driver.resume(b.url, lease)
            where = (routed.instance, sorted(a.requests), sorted(b.requests))
            if not kept:
                await router.relay.recover(routed, prefer_source=True)
        finally:
            router.migrations.checks.shutdown(wait=True)
        return kept, where, legs, [router.instances.index(i) for i in tried], (a, b)

    kept, (inst, on_a, on_b), legs, tried, (a, b) = asyncio.run(go())
    if case == "vouched":
        assert kept and inst is b and on_b == ["c"] and on_a == [] and not legs[0].closed and tried == [1]
    else:
        assert not kept and legs[0].closed and inst is a and on_a == ["c"] and on_b == []
        assert tried == [1, 0]  # the dropped resume on B, then the recovery on A


def test_a_recovery_after_a_failed_move_prefers_the_source_unless_it_drains():

    async def go(draining):
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        a.draining = draining
        tried = []

        async def fake_open(routed, inst, url, body, first_token=False):
            tried.append(inst)
            raise LegFailed("no")
        router.relay.open = fake_open
        with pytest.raises(LegFailed, match="no instance could continue it"):
            await router.relay.recover(_routed_on(router, a), prefer_source=True)
        return [router.instances.index(i) for i in tried]

    assert asyncio.run(go(False)) == [0, 1]
    assert asyncio.run(go(True)) == [1, 0]  # a draining source last: the move was to take it off there


def test_migrate_refuses_a_destination_that_is_down_draining_or_busy_and_undrain_ends_a_drain(monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, "t")
    auth = {"Authorization": "Bearer t"}

    polled = []

    async def go():
        async def metrics(request):
            polled.append(1)
            return web.Response(text="")
        rb, up = await _backend(_empty, metrics)  # B is up until the test marks it down
        app = build_app([dead_url(), up], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, b = router.instances
        routed = _routed_on(router, a)
        _take(routed, a)
        router.requests["c"] = routed
        runner, url = await _serving(app)
        out = []
        try:
            async with aiohttp.ClientSession(headers=auth) as s:
                while not polled:  # the router's first poll of B is over: the test marks it now
                    await asyncio.sleep(0.01)
                for mark in ("draining", "down", "in", "out"):  # "in": B has a migration in; "out": A one out
                    b.draining, b.healthy = mark == "draining", mark != "down"
                    b.migrating_in, a.migrating_out = int(mark == "in"), int(mark == "out")
                    async with s.post(url + "/migrate", json={"request_id": "c", "to": b.url}) as r:
                        out.append((r.status, (await r.json())["error"]["message"]))
                    async with s.post(url + "/migrate", json={"request_id": "c"}) as r:  # B: the only other one
                        out.append((r.status, (await r.json())["error"]["message"]))
                b.migrating_in = a.migrating_out = 0
                b.draining, b.healthy = False, False  # nowhere to go: the drain waits
                drain = asyncio.ensure_future(s.post(url + "/drain", json={"instance": a.url, "timeout_s": 60}))
                while not a.draining:
                    await asyncio.sleep(0.01)
                async with s.post(url + "/undrain", json={"instance": a.url}) as r:
                    assert r.status == 200
                r = await asyncio.wait_for(drain, 10)
                out.append((r.status, await r.json()))
                r.release()
        finally:
            await runner.cleanup()
            await rb.cleanup()
        return out

    *refused, (s3, drained) = asyncio.run(go())
    (draining, _), (down, _), (busy_in, busy_in_any), (busy_out, busy_out_any) = zip(refused[::2], refused[1::2])
    assert {s for s, _ in refused} == {409}, refused
    assert draining[1].endswith("is draining") and down[1].endswith("is down"), refused
    assert all("has a migration in already" in m for _, m in (busy_in, busy_in_any)), refused
    assert all(m.startswith("request c: its instance") and "has a migration out already" in m
               for _, m in (busy_out, busy_out_any)), refused
    assert s3 == 409 and drained["undrained"] is True and drained["left"] == ["c"]


def test_a_request_without_a_limit_resumes_up_to_the_destinations_model_length():
    """A chat request without max_tokens: its resumed leg (a /v1/completions request, whose
    default is 16 tokens) asks for the destination's max_model_len, from its /v1/models."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        b.models = {"object": "list", "data": [{"id": "other", "max_model_len": 64},
                                               {"id": "m", "max_model_len": 4096}]}
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append(body)
            _take(routed, inst)
        router.relay.open = fake_open
        client = ClientStream("c", True, "m", want_ids=False, want_usage=False)
        client.prompt_token_ids, client.token_ids = [1, 2, 3], [4]
        routed = Routed("c", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True,
                                   client)
        routed.instance = a
        await router.migrations.driver(routed).resume(b.url, None)
        await router.relay.recover(routed, prefer_source=True)  # where it is, B, first
        return sent

    resumed, recovered = asyncio.run(go())
    assert resumed["prompt"] == [1, 2, 3, 4] and resumed["max_tokens"] == 4096 - 4
    assert recovered["max_tokens"] == 4096 - 4


def test_a_moved_request_keeps_the_output_limit_its_first_instance_gave_it(monkeypatch):
    """Each instance's lease channel says the output limits its OpenAI server applies: a chat
    request without a limit, begun where the generation config's default is 300 tokens, resumes
    elsewhere with 300 less what it got (not up to the model's length), also when that instance
    described itself only after the request began; one whose limit its first instance caps at
    200 keeps the cap where there is none; one whose first instance was marked down before it
    described itself keeps the client's limit; and none moves to an instance that caps what it
    has left below it."""
    from vllm_ext.router.openai import ClientStream

    secret = "router-unit-test-deployment-secret"
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", secret)
    servers, _ = _describing_lease_servers(secret, [("", 300, 0), ("", 0, 0), ("", 0, 200)])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def go():
        router = Router(["http://a.invalid", "http://b.invalid", "http://c.invalid"],
                                   [f"127.0.0.1:{s.port}" for s in servers], Settings())
        a, b, c = router.instances
        b.models = {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append(body)
            _take(routed, inst)
        router.relay.open = fake_open

        def routed_on(first, body):
            client = ClientStream("c", True, "m", want_ids=False, want_usage=False)
            client.prompt_token_ids, client.token_ids = [1, 2, 3], [4, 5]
            routed = Routed("c", body, True, client)
            routed.instance = first
            routed.limit.began_on(first)  # its first leg began there
            return routed
        for first, body, down in ((a, chat, False), (c, dict(chat, max_tokens=1000), False), (b, chat, False),
                                  (a, dict(chat, max_tokens=1000), True)):
            first.described = None  # not described when the request's first leg began
            routed = routed_on(first, body)
            if down:
                router.fleet.mark_down(first, OSError("test"))
            assert await router.fleet.describe(first) is not None  # it describes itself now
            await router.migrations.driver(routed).resume(b.url, None)
        legs = [leg["max_tokens"] for leg in sent]
        # to C, which caps output at 200: only a request with at most 200 tokens left
        refusals = [await router.migrations.driver(routed_on(a, body)).refuse(c.url)
                    for body in (chat, dict(chat, max_tokens=202), dict(chat, max_tokens=203))]
        for inst in router.instances:
            inst.control.close()
        return legs, refusals

    try:
        legs, refusals = asyncio.run(go())
        assert legs == [298, 198, 4096 - 5, 998], legs  # the last: A went down before describing itself
        assert refusals[1] is None and "caps a request's output at 200" in refusals[2], refusals
        assert "caps" in refusals[0] and "no limit" not in refusals[0] and "298 tokens" in refusals[0], refusals
    finally:
        for s in servers:
            s.close()


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
        rb, b = await _backend(slow)
        runner, url = await _serving(build_app([b], None, Settings(health_interval_s=60)))
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
        (ra, a), (rb, b) = await _backend(thinks), await _backend(thinks)
        runner, url = await _serving(build_app([a, b], None, Settings(health_interval_s=60)))
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
                async with s.post(url + "/migrate", headers=admin, json={"request_id": listed["id"], "to": to}) as r:
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


def events_of(text):
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_a_drain_moves_each_request_to_the_least_loaded_instance_with_no_migration_coming_in(monkeypatch):
    """B is the least loaded but has a migration coming in: A's request goes to C."""
    from vllm_ext.router import live
    from vllm_ext.router.state import Relayed

    monkeypatch.setenv(ENV_TOKEN, "t")
    chosen = []

    async def go():
        backends = [await _backend(_empty) for _ in range(3)]  # up: the router's polls find them
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, b, c = router.instances
        b.migrating_in = 1
        c.requests.update({key: Relayed(key, c, "n > 1") for key in ("x", "y")})
        routed = _routed_on(router, a)
        _take(routed, a)
        router.requests["c"] = routed

        def start_migration(routed_, dst, stages=None, recompute=False):
            chosen.append(dst.url)
            a.requests.pop(routed_.rid)
            done = asyncio.get_running_loop().create_future()
            done.set_result(live.Record("ab" * 16, routed_.rid, a.url, dst.url, outcome=live.Outcome.MOVED))
            return done
        router.migrations.start = start_migration
        runner, url = await _serving(app)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 10}) as r:
                    return r.status, await r.json(), c.url
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    status, body, c_url = asyncio.run(go())
    assert status == 200 and body["left"] == [] and chosen == [c_url], (status, body, chosen)


def test_no_migration_goes_to_an_instance_whose_kv_cache_is_full_or_that_queues_requests(monkeypatch):
    """From each instance's /metrics: /migrate to one is refused by name, and /migrate's own
    choice and a drain skip it (the resume would wait there for blocks)."""
    monkeypatch.setenv(ENV_TOKEN, "t")

    def metrics(usage, waiting):
        async def answer(request):
            return web.Response(text=f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
                                     f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n')
        return answer

    async def go():
        backends = [await _backend(_empty, metrics(u, w)) for u, w in ((0.1, 0), (0.95, 0), (0.2, 3), (0.5, 0))]
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        runner, url = await _serving(app)
        a, full, queues, roomy = router.instances
        try:
            while not all(i.metrics for i in router.instances):  # the first poll
                await asyncio.sleep(0.01)
            a.control = _Control(None)  # a lease channel (never used: each move is refused or faked)
            routed = _routed_on(router, a)
            _take(routed, a)
            router.requests["c"] = routed
            reasons = {}
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                for dst in (full, queues):
                    async with s.post(url + "/migrate", json={"request_id": "c", "to": dst.url}) as r:
                        reasons[dst.url] = r.status, (await r.json())["error"]["message"]
                chosen = []

                def start_migration(routed_, dst, *args, **kwargs):
                    chosen.append(dst)
                    a.requests.pop(routed_.rid)
                    return _done(dst)
                router.migrations.start = start_migration
                async with s.post(url + "/migrate", json={"request_id": "c"}) as r:
                    assert r.status == 200, await r.text()
                a.requests["c"] = routed
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 10}) as r:
                    assert r.status == 200, await r.text()
            return reasons, chosen, (full.url, queues.url, roomy)
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    def _done(dst):
        from vllm_ext.router import live

        done = asyncio.get_running_loop().create_future()
        done.set_result(live.Record("ab" * 16, "c", "a", dst.url, outcome=live.Outcome.MOVED))
        return done

    reasons, chosen, (full, queues, roomy) = asyncio.run(go())
    assert reasons[full][0] == 409 and "KV cache is 95% used" in reasons[full][1] and "under 90%" in reasons[full][1]
    assert reasons[queues][0] == 409 and "queues 3 requests" in reasons[queues][1], reasons
    assert chosen == [roomy, roomy], chosen  # the least loaded with room (the three others run nothing)


def test_a_drain_waits_for_a_migration_already_leaving_the_instance(monkeypatch):
    """One migration out of an instance at a time: a drain begun while a /migrate moves one of
    its requests starts none of its own until that one ends."""
    monkeypatch.setenv(ENV_TOKEN, "t")
    started = []

    async def go():
        backends = [await _backend(_empty) for _ in range(2)]
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, _ = router.instances
        a.migrating_out = 1  # a /migrate of another of A's requests is under way
        routed = _routed_on(router, a)
        _take(routed, a)
        router.requests["c"] = routed
        router.migrations.start = lambda *args, **kwargs: started.append(args)
        runner, url = await _serving(app)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 0.5}) as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    status, body = asyncio.run(go())
    assert status == 504 and body["left"] == ["c"] and started == [], (status, body, started)


def test_a_broken_leg_is_closed_and_an_ended_one_released():
    """The pump lets go of a leg's connection either way (a broken one left open stays in
    aiohttp's hands, unclosed)."""
    from vllm_ext.router.openai import ClientStream

    async def pump(end):
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = _take(routed, router.instances[0])
        await leg.content.events.put(_token_event(7))
        if end == "broken":
            leg.content.set_exception(aiohttp.ClientPayloadError("cut"))
        else:
            await leg.content.events.put(b"")
        how = await router.relay.pump(routed, _Out())
        return how, leg.closed, leg.released, client.token_ids, routed.leg

    assert asyncio.run(pump("broken")) == ("broken", True, False, [], None)  # (the error comes first)
    assert asyncio.run(pump("ended")) == ("ended", False, True, [7], None)


@pytest.mark.parametrize("case", ["stream", "answer", "relayed", "busy"])
def test_the_streams_and_waits_of_a_silent_instance_are_cut_and_continued_elsewhere(case):
    """A goes silent (a partition with no FIN or RST): its polls fail and, once silent_s passed,
    a stream of it that sent nothing as long continues on B from the router's tokens ("stream"),
    a request A never answered goes to B ("answer", and "relayed": one that cannot move). "busy":
    A's stream pauses for four times silent_s, but A answers its polls: nothing is cut."""
    silent, release, got = asyncio.Event(), asyncio.Event(), []

    async def metrics(request):
        if silent.is_set() and case != "busy":
            await release.wait()
        return web.Response(text="")

    async def a(request):
        got.append(("A", await request.json()))
        if case in ("answer", "relayed"):
            silent.set()
            await release.wait()
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(_token_event(7, prompt=[1, 2]))
        silent.set()
        if case == "busy":
            await asyncio.sleep(2.0)
            await r.write(_token_event(8, finish="length") + b"data: [DONE]\n\n")
        else:
            await release.wait()
        return r

    async def b(request):
        body = await request.json()
        got.append(("B", body))
        if case == "relayed":
            return web.json_response({"id": "x", "choices": [{"index": i, "text": "b"} for i in range(2)]})
        r = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        if case == "answer":  # the request as it came
            await r.write(_token_event(7, prompt=body["prompt"]))
        await r.write(_token_event(8, finish="length") + b"data: [DONE]\n\n")
        return r

    async def go():
        (ra, a_url), (rb, b_url) = await _backend(a, metrics), await _backend(b)
        settings = Settings(policy="round_robin", health_interval_s=0.05, health_timeout_s=0.2, silent_s=0.5)
        runner, url = await _serving(build_app([a_url, b_url], None, settings))
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 2, "stream": True, "return_token_ids": True}
        if case == "relayed":
            body.update(n=2, stream=False)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json=body) as r:
                    return r.status, await r.text()
        finally:
            release.set()
            for x in (runner, ra, rb):
                await x.cleanup()

    status, text = asyncio.run(go())
    assert status == 200, (status, text)
    if case == "busy":
        assert [who for who, _ in got] == ["A"], got
    else:
        assert [who for who, _ in got] == ["A", "B"], got
    if case == "stream":
        assert got[1][1]["prompt"] == [1, 2, 7] and got[1][1]["max_tokens"] == 1, got[1][1]
    elif case == "answer":
        assert got[1][1]["prompt"] == [1, 2] and got[1][1]["max_tokens"] == 2, got[1][1]
    if case == "relayed":
        assert [c["text"] for c in json.loads(text)["choices"]] == ["b", "b"], text
    else:
        events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert ids == [7, 8] and text.endswith("data: [DONE]\n\n"), text


def test_a_silent_instance_cuts_what_waited_as_long_even_if_it_began_after_the_silence():
    """The rule is per stream and per wait: silent_s without a word from it (and no poll answered
    for as long), whether it began before the instance went silent or after."""

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings(silent_s=10.0))
        inst, now = router.instances[0], time.monotonic()
        inst.silent_since = now - 30
        waits = {began: asyncio.get_running_loop().create_future() for began in (now - 11, now - 9)}
        for began, cut in waits.items():
            inst.waits[cut] = began
        legs = {}
        for heard in (now - 12, now - 8):
            routed = _routed_on(router, inst, rid=f"r{heard}")
            legs[heard] = _take(routed, inst)
            routed.leg.heard_at = heard
        router.fleet.cut_silent(inst)
        return ([waits[b].done() for b in sorted(waits)],
                [isinstance(legs[h].content.exception(), aiohttp.ClientConnectionError) for h in sorted(legs)])

    assert asyncio.run(go()) == ([True, False], [True, False])
