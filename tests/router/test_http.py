"""What both fronts share (vllm_ext/router/http.py): how a large request body is parsed. The
stall it causes is measured, not asserted (docs/security.md); these tests hold the mechanism:
a body at most max_body_bytes (1 MiB by default), one large body parsed at a time, off the loop's
thread."""

import asyncio
import json
import random

import pytest

pytest.importorskip("aiohttp", reason="the fronts need aiohttp (a vLLM dependency)")

from vllm_ext.router import http  # noqa: E402


def run_admission(bodies, max_body_bytes=4 << 20):
    """Posts `bodies` at once to an app whose handler answers what Admission.read_json parsed;
    returns [(status, parsed or None)]."""
    import aiohttp
    from aiohttp import web

    admission = http.Admission(0, max_body_bytes)

    async def handler(request):
        try:
            body = await admission.read_json(request)
        except http.Rejected as e:
            return e.response
        return web.json_response({"keys": sorted(body), "n": len(body.get("prompt", []))})

    async def main():
        app = web.Application(client_max_size=max_body_bytes, middlewares=[admission.middleware])
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async def post(raw):
                    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as r:
                        return r.status, await r.json()
                return await asyncio.gather(*(post(raw) for raw in bodies))
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def large_body(rng, n):
    return json.dumps({"model": "m", "prompt": [rng.randrange(1 << 20) for _ in range(n)]}).encode()


def test_large_bodies_are_parsed_one_at_a_time_off_the_loop(monkeypatch):
    """Six bodies over INLINE_PARSE_BYTES arrive at once: never two are parsed at once, and none
    on the loop's thread; each is parsed right, and a small one beside them too."""
    import threading

    rng = random.Random()
    seen = {"now": 0, "most": 0, "threads": set()}
    real_loads = json.loads
    loop_thread = threading.get_ident()

    def watched_loads(raw, *args, **kwargs):
        if len(raw) > http.INLINE_PARSE_BYTES:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
            seen["threads"].add(threading.get_ident())
            try:
                threading.Event().wait(0.05)  # long enough for a second parse to begin, were it allowed
                return real_loads(raw, *args, **kwargs)
            finally:
                seen["now"] -= 1
        return real_loads(raw, *args, **kwargs)

    monkeypatch.setattr(http.json, "loads", watched_loads)
    n = http.INLINE_PARSE_BYTES // 4  # ids of 7-8 bytes: about twice INLINE_PARSE_BYTES
    bodies = [large_body(rng, n + i) for i in range(6)] + [b'{"model": "m", "prompt": [1, 2]}']
    assert all(len(b) > http.INLINE_PARSE_BYTES for b in bodies[:6])
    answers = run_admission(bodies)
    assert [a for a in answers] == [(200, {"keys": ["model", "prompt"], "n": n + i}) for i in range(6)] + \
        [(200, {"keys": ["model", "prompt"], "n": 2})]
    assert seen["most"] == 1, seen
    assert loop_thread not in seen["threads"], seen


def test_the_default_body_limit_and_what_is_past_it():
    """The fronts' default max_body_bytes is 1 MiB (the stall one body can cause grows with its
    size: docs/security.md); a body past the limit is 413, a large one that is not JSON 400."""
    from vllm_ext.router.settings import ProxySettings, Settings

    assert Settings().max_body_bytes == ProxySettings().max_body_bytes == 1 << 20
    rng = random.Random()
    bad = large_body(rng, http.INLINE_PARSE_BYTES // 4)[:-1]  # cut short
    [(status, answer)] = run_admission([bad], max_body_bytes=1 << 20)
    assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
    [(status, answer)] = run_admission([large_body(rng, (1 << 20) // 5)], max_body_bytes=1 << 20)
    assert status == 413 and "larger than 1048576 bytes" in answer["error"]["message"], answer
