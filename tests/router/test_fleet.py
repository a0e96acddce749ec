"""The fleet's silence cut: the streams and waits of an instance that answers no poll (a
partition with no FIN or RST) are broken after silent_s, and the request goes on elsewhere."""

import asyncio
import json
import time

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vllm_ext.router.app import Router, build_app  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402

from .fakes import backend, routed_on, serving, take, token_event  # noqa: E402


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
        await r.write(token_event(7, prompt=[1, 2]))
        silent.set()
        if case == "busy":
            await asyncio.sleep(2.0)
            await r.write(token_event(8, finish="length") + b"data: [DONE]\n\n")
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
            await r.write(token_event(7, prompt=body["prompt"]))
        await r.write(token_event(8, finish="length") + b"data: [DONE]\n\n")
        return r

    async def go():
        (ra, a_url), (rb, b_url) = await backend(a, metrics), await backend(b)
        settings = Settings(policy="round_robin", health_interval_s=0.05, health_timeout_s=0.2, silent_s=0.5)
        runner, url = await serving(build_app([a_url, b_url], None, settings))
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
            routed = routed_on(router, inst, rid=f"r{heard}")
            legs[heard] = take(routed, inst)
            routed.leg.heard_at = heard
        router.fleet.cut_silent(inst)
        return ([waits[b].done() for b in sorted(waits)],
                [isinstance(legs[h].content.exception(), aiohttp.ClientConnectionError) for h in sorted(legs)])

    assert asyncio.run(go()) == ([True, False], [True, False])
