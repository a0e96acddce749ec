"""A prefill/decode proxy in front of vLLM servers running VllmExtConnector (OpenAI API).

    python -m vllm_ext.proxy --prefill http://P1:8100 [...] --decode http://D1:8200 [...] --port 8000

For each /v1/completions or /v1/chat/completions request it asks a prefill server for one token
with `kv_transfer_params={"do_remote_decode": true}` (not streamed), then sends the original
request with the returned kv_transfer_params to a decode server and relays its answer,
streamed or not. A client's own kv_transfer_params are dropped (only the prefill leg's reach
the decode server), and the prefill leg always asks for one choice (n=1). The client's
Authorization and X-Request-Id headers go to both legs. A prefill server's error answer (a bad
request) is relayed as is, a prefill answer that is not JSON gives 502; a server that cannot be
reached is skipped with a log line and the next one tried; a decode server that fails mid-stream
ends the stream with an error event. Also serves /health and /v1/models; other routes get a
JSON 404 as vLLM gives. Needs aiohttp (a vLLM dependency); does not import vLLM.
"""

import argparse
import asyncio
import json
import logging
from typing import Dict, List, Optional

import aiohttp
from aiohttp import web

from .http import backend_session, client_auth, error, first_models, openai_app
from .placement import POLICIES, Turns, check_policy

logger = logging.getLogger("vllm_ext.proxy")

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")


class Backend:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.in_flight = 0

    @property
    def load(self) -> int:
        """What the least_loaded policy weighs (placement.Turns)."""
        return self.in_flight


class Pool:
    """Servers of one stage; `candidates()` orders them for one request by the policy (the
    router's: placement.Turns)."""

    def __init__(self, name: str, urls: List[str], policy: str):
        if not urls:
            raise ValueError(f"--{name}: at least one URL is needed")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--{name}: {url!r} is not an http(s) URL")
        self.name = name
        self.backends = [Backend(u) for u in urls]
        self.policy = policy
        self._turns = Turns(policy)

    def candidates(self) -> List[Backend]:
        return self._turns.order(self.backends)


class Proxy:
    def __init__(self, prefill: Pool, decode: Pool, timeout_s: float):
        self.prefill, self.decode = prefill, decode
        self.timeout_s = timeout_s
        self.session: Optional[aiohttp.ClientSession] = None

    async def start(self, app) -> None:
        self.session = backend_session(self.timeout_s)

    async def stop(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- routes --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        async def ok(backend: Backend) -> bool:
            try:
                async with self.session.get(backend.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        pools = {"prefill": self.prefill, "decode": self.decode}
        states = {name: await asyncio.gather(*(ok(b) for b in pool.backends)) for name, pool in pools.items()}
        body = {name: {b.url: up for b, up in zip(pools[name].backends, states[name])} for name in pools}
        healthy = all(any(s) for s in states.values())
        return web.json_response(body, status=200 if healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        return await first_models(self.session, [b.url for b in self.decode.candidates()], "decode server", logger,
                                  headers=client_auth(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            body = await request.json()
        except (UnicodeDecodeError, ValueError) as e:
            return error(400, f"the request body is not valid JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "BadRequestError")

        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        prefill_body = dict(body, stream=False, max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        answer = await self._prefill(path, prefill_body, headers)
        if isinstance(answer, web.Response):
            return answer  # the prefill server's error (a bad request), or none reachable
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        decode_body = dict(body)
        decode_body.pop("kv_transfer_params", None)  # a client's own never reach a decode server
        if isinstance(params, dict):
            decode_body["kv_transfer_params"] = params
        else:
            logger.warning("prefill answered without kv_transfer_params (is VllmExtConnector configured?): "
                           "the decode server computes the prompt itself")
        return await self._decode(request, path, decode_body, headers)

    # ---- legs ----------------------------------------------------------------------------
    async def _prefill(self, path: str, body: Dict, headers: Dict[str, str]):
        for backend in self.prefill.candidates():
            backend.in_flight += 1
            try:
                async with self.session.post(backend.url + path, json=body, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        return web.Response(status=r.status, body=raw,
                                            content_type=r.content_type or "application/json")
                    try:
                        return json.loads(raw)
                    except (UnicodeDecodeError, ValueError) as e:
                        logger.warning("prefill server %s answered 200 with a body that is not JSON: %s",
                                       backend.url, e)
                        return error(502, f"the prefill server's answer is not JSON: {e}", "BadGatewayError")
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                logger.warning("prefill server %s is down (%s: %s): trying the next", backend.url,
                               type(e).__name__, e)
            finally:
                backend.in_flight -= 1
        return error(503, "no prefill server is reachable", "ServiceUnavailableError")

    async def _decode(self, request: web.Request, path: str, body: Dict, headers: Dict[str, str]) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        for backend in self.decode.candidates():
            backend.in_flight += 1
            out = None
            try:
                async with self.session.post(backend.url + path, json=body, headers=headers) as r:
                    if not stream or r.status != 200:
                        return web.Response(status=r.status, body=await r.read(),
                                            content_type=r.content_type or "application/json")
                    out = web.StreamResponse(status=200, headers={
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    async for chunk in r.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                if out is not None:  # part of the stream went out already: it ends here, with an error event
                    logger.warning("decode server %s failed mid-stream (%s: %s)", backend.url, type(e).__name__, e)
                    event = {"error": {"message": f"the decode server failed mid-stream: {type(e).__name__}",
                                       "type": "BadGatewayError", "param": None, "code": 502}}
                    try:
                        await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                        await out.write_eof()
                    except (ConnectionError, RuntimeError) as e2:  # the client left meanwhile
                        logger.debug("could not end the stream: %s", e2)
                    return out
                logger.warning("decode server %s is down (%s: %s): trying the next", backend.url,
                               type(e).__name__, e)
            finally:
                backend.in_flight -= 1
        return error(503, "no decode server is reachable", "ServiceUnavailableError")


def build_app(prefill: List[str], decode: List[str], policy: str = "round_robin",
              timeout_s: float = 600.0) -> web.Application:
    check_policy(policy)
    proxy = Proxy(Pool("prefill", prefill, policy), Pool("decode", decode, policy), timeout_s)
    return openai_app(proxy)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a backend may stay silent")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(args.prefill, args.decode, args.policy, args.timeout)
    except ValueError as e:
        parser.error(str(e))
    logger.info("P/D proxy on http://%s:%d: prefill %s, decode %s, %s", args.host, args.port, args.prefill,
                args.decode, args.policy)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
