"""The router's arguments, admin API guard and answers with no instance up (no vLLM; its real
behaviour is tests/live/test_live_e2e.py's)."""

import asyncio
import json
import socket

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vllm_ext.router.app import ENV_TOKEN, Settings, build_app  # noqa: E402


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("urls,leases,settings,match", [
    ([], None, Settings(), "--instance: at least one URL"),
    (["a:1"], None, Settings(), "is not an http"),
    (["http://a", "http://b"], ["h:1"], Settings(), "--lease: 1 addresses for 2 instances"),
    (["http://a"], None, Settings(policy="random"), "policy: 'random'"),
])
def test_bad_arguments_are_refused(urls, leases, settings, match):
    with pytest.raises(ValueError, match=match):
        build_app(urls, leases, settings)


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
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await calls(session, f"http://127.0.0.1:{port}")
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


class _Leg:
    def __init__(self):
        self.content, self.closed = _Content(), False

    def close(self):
        self.closed = True


class _Out:
    def __init__(self):
        self.chunks = []

    async def write(self, data):
        self.chunks.append(data)


def _token_event(token_id):
    choice = {"index": 0, "text": f" t{token_id}", "token_ids": [token_id], "logprobs": None, "finish_reason": None}
    return ("data: " + json.dumps({"id": "c", "choices": [choice]}) + "\n\n").encode()


def _switch(gap_s, tokens_after_stop):
    """A routed request with a leg; the driver's stop while the pump relays. Returns (what stop
    returned, the client's token ids, the leg, seconds the stop took)."""
    from vllm_ext.router import app as router_app
    from vllm_ext.router.streams import ClientStream

    async def go():
        router = router_app.Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = router_app.Routed("c", {"model": "m"}, False, client, None)
        leg = routed.leg = _Leg()
        out = _Out()
        for t in (10, 11):  # two tokens: the client's last gap between tokens is known
            await leg.content.events.put(_token_event(t))
        pump = asyncio.ensure_future(router._pump(routed, out))
        while len(client.token_ids) < 2:
            await asyncio.sleep(0.005)
        client.last_gap_s = gap_s
        driver = router_app._Driver(router, routed)
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
    monkeypatch.setattr("vllm_ext.router.app.STOP_WAIT_MAX_S", 60.0)  # a slow host does not make the token late
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
    from vllm_ext.router import app as router_app
    from vllm_ext.router.streams import ClientStream

    async def go():
        router = router_app.Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = router_app.Routed("c", {"model": "m"}, False, client, None)
        routed.leg = _Leg()
        routed.leg.content = _Buffered([_token_event(t) for t in range(100, 300)])
        seen = []  # the client's token count each time the other task ran

        async def other():
            for _ in range(5):
                seen.append(len(client.token_ids))
                await asyncio.sleep(0)
        pump = asyncio.ensure_future(router._pump(routed, _Out()))
        others = asyncio.ensure_future(other())
        assert await pump == "ended" and len(client.token_ids) == 200
        await others
        return seen

    seen = asyncio.run(go())
    assert len(set(seen)) == 5 and max(seen) < 200, seen


def test_a_seeded_request_moves_only_between_instances_that_sample_alike(monkeypatch):
    """The router asks each instance's lease channel (real lease servers here) how it samples:
    a seeded request may go only where its random stream goes on; others go anywhere."""
    from vllm_ext.migration import protocol
    from vllm_ext.migration.lease import LeaseServer
    from vllm_ext.router.app import Routed, Router, _Driver
    from vllm_ext.router.streams import ClientStream

    secret = "router-unit-test-deployment-secret"
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", secret)
    samplers = {"A": "generator:cpu:0.32", "B": "generator:cpu:0.32", "C": "position:cuda:0.26", "D": ""}
    asked = []

    def serving(kind):
        def handler(request):
            asked.append(kind)
            assert isinstance(request, protocol.LeaseDescribe)
            return protocol.LeaseDescribeReply({}, "0" * 32, {}, kind), b""
        return handler
    servers = {n: LeaseServer(secret.encode(), serving(k)) for n, k in samplers.items()}
    try:
        urls = {n: f"http://{n.lower()}.invalid" for n in samplers}
        router = Router(list(urls.values()), [f"127.0.0.1:{s.port}" for s in servers.values()], Settings())

        def refusal(body, to):
            routed = Routed("cmpl-1", body, False, ClientStream("cmpl-1", False, "m", False, want_usage=False), None)
            routed.instance = router.instances[0]
            return asyncio.run(_Driver(router, routed).refuse(urls[to]))

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
        for s in servers.values():
            s.close()
        for inst in router.instances:
            inst.control.close()
