"""The router's arguments, admin API guard and answers with no instance up (no vLLM; its real
behaviour is tests/live/test_live_e2e.py's)."""

import asyncio
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
        return out
    (s1, _), (s2, _), (s3, instances), (s4, missing), (s5, bad) = run(with_token, "s3cret", monkeypatch)
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
