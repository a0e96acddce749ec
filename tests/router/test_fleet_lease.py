"""The router checks each --lease: at start, that it is HOST:PORT (not a bare port, a URL or the
instance's own HTTP address); at the first polls, what answers there (real lease servers, with
the router's secret or another one, and a real HTTP server): a WARNING naming the instance and
what is wrong, and lease_state / lease_error in GET /instances."""

import asyncio
import logging
import secrets
import socket
import time

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402

from vllm_ext.router import fleet  # noqa: E402
from vllm_ext.router.app import ENV_TOKEN, build_app  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402

from .fakes import backend, describing_lease_servers, empty, serving  # noqa: E402

SETTLE_S = 60.0  # deadline for the first polls and describes (a busy host is slow; nothing waits on speed)


@pytest.fixture
def secret(monkeypatch):
    value = secrets.token_hex(16)
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", value)
    monkeypatch.delenv("VLLM_EXT_AUTH_SECRET_FILE", raising=False)
    return value


@pytest.mark.parametrize("lease,match", [
    ("8101", r"--lease '8101' \(of http://127.0.0.1:8100\): expected HOST:PORT"),
    (":8101", "expected HOST:PORT"),
    ("127.0.0.1:0", "expected HOST:PORT with a port 1-65535"),
    ("127.0.0.1:99999", "expected HOST:PORT with a port 1-65535"),
    ("127.0.0.1:lease", "expected HOST:PORT"),
    ("http://127.0.0.1:8101", "a lease channel is HOST:PORT with no scheme or path"),
    ("127.0.0.1:8101/", "a lease channel is HOST:PORT with no scheme or path"),
    ("127.0.0.1:8100", "that is the instance's HTTP address"),
])
def test_a_lease_address_that_is_not_host_port_is_refused_at_start(secret, lease, match):
    with pytest.raises(ValueError, match=match):
        build_app(["http://127.0.0.1:8100"], [lease], Settings())


def test_the_command_line_names_the_bad_lease(secret, capsys):
    from vllm_ext.router import cli

    with pytest.raises(SystemExit):
        cli.main(["--instance", "http://127.0.0.1:8100", "--lease", "http://127.0.0.1:8101"])
    assert "--lease 'http://127.0.0.1:8101' (of http://127.0.0.1:8100)" in capsys.readouterr().err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_answers_at_each_lease_address_is_told_at_the_first_polls(secret, monkeypatch, caplog):
    """Four instances: A's lease channel holds the router's secret, B's another one, C was given
    an HTTP port (another server's), D a port nothing listens on. Each problem is a WARNING
    naming the instance, and /instances says it."""
    token = secrets.token_hex(8)
    monkeypatch.setenv(ENV_TOKEN, token)
    (good,), _ = describing_lease_servers(secret, [("", 0, 0)])
    (other,), _ = describing_lease_servers(secrets.token_hex(16), [("", 0, 0)])
    caplog.set_level(logging.INFO, logger="vllm_ext.router")

    async def go():
        backends = [await backend(empty) for _ in range(4)]
        http_port = int(backends[0][1].rpartition(":")[2])  # A's HTTP port, given as C's lease
        urls = [url for _, url in backends]
        leases = [f"127.0.0.1:{good.port}", f"127.0.0.1:{other.port}", f"127.0.0.1:{http_port}",
                  f"127.0.0.1:{closed_port()}"]
        app = build_app(urls, leases, Settings(health_interval_s=0.05))
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
                deadline = time.monotonic() + SETTLE_S
                while True:
                    async with s.get(url + "/instances") as r:
                        assert r.status == 200
                        seen = await r.json()
                    if all(i["lease_state"] != fleet.LEASE_UNCHECKED for i in seen) or time.monotonic() > deadline:
                        return urls, seen
                    await asyncio.sleep(0.1)
        finally:
            for x in (runner, *(r for r, _ in backends)):
                await x.cleanup()

    try:
        urls, seen = asyncio.run(go())
    finally:
        good.close()
        other.close()
    states = {i["url"]: (i["lease_state"], i["lease_error"]) for i in seen}
    a, b, c, d = (states[u] for u in urls)
    assert a == (fleet.LEASE_OK, None), a
    assert b[0] == fleet.LEASE_WRONG_SECRET and "does not hold the router's deployment secret" in b[1], b
    assert c[0] == fleet.LEASE_NOT_A_LEASE_CHANNEL and "is an HTTP server, not a lease channel" in c[1], c
    assert d[0] == fleet.LEASE_UNREACHABLE and "cannot connect" in d[1], d
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for u, (state, _) in zip(urls, (a, b, c, d)):
        named = [w for w in warnings if w.startswith(f"instance {u}: lease channel")]
        assert len(named) == (0 if state == fleet.LEASE_OK else 1), (u, warnings)


def test_an_instance_without_a_lease_says_so(secret, monkeypatch):
    token = secrets.token_hex(8)
    monkeypatch.setenv(ENV_TOKEN, token)

    async def go():
        r_b, b_url = await backend(empty)
        runner, url = await serving(build_app([b_url], [None], Settings()))
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
                async with s.get(url + "/instances") as r:
                    return await r.json()
        finally:
            await runner.cleanup()
            await r_b.cleanup()

    (inst,) = asyncio.run(go())
    assert (inst["lease"], inst["lease_state"], inst["lease_error"]) == (None, fleet.LEASE_NONE, None)
