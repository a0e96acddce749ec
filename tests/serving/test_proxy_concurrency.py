"""The P/D proxy at the serving benchmark's concurrency: more streamed answers at once than
aiohttp's default connection pool holds (100) must all go through. The CPU serving run (600
requests at 10 req/s, 142 in flight) saw the 101st wait for a pooled connection to the decode
server until its connect deadline (5 s) ran out, and the proxy then answered 503 as if the
server were down. Fake backends in this process (tests/router/test_pd.py's)."""

import os

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # in .venv-vllm (CI): a missing aiohttp is a failure
    import aiohttp  # noqa: F401
else:
    pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (a vLLM dependency)")

from tests.router.test_pd import open_stream, prefill_answer, run_with_backends  # noqa: E402

IN_FLIGHT = 130
HOLD_S = 6.0  # each answer streams longer than the proxy's connect deadline


def test_more_streams_than_a_default_pool_are_all_answered():
    import asyncio

    import aiohttp

    async def decode(request):
        out = await open_stream(request)
        await asyncio.sleep(HOLD_S)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def calls(_, url):
        # a client without a pool limit of its own, so that the proxy sees every request at once
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one():
                async with session.post(url + "/v1/completions",
                                        json={"model": "m", "prompt": "hi", "stream": True}) as r:
                    return r.status, (await r.read()).decode()

            return await asyncio.gather(*(one() for _ in range(IN_FLIGHT)))

    answers = run_with_backends(prefill_answer, decode, calls)
    assert [status for status, _ in answers] == [200] * IN_FLIGHT
    assert all(text.endswith("data: [DONE]\n\n") for _, text in answers)
