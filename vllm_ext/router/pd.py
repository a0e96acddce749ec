"""A prefill/decode proxy in front of vLLM servers running VllmExtConnector (OpenAI API).

    python -m vllm_ext.proxy --prefill http://P1:8100 [...] --decode http://D1:8200 [...] --port 8000

For each /v1/completions or /v1/chat/completions request it asks a prefill server for one token
with `kv_transfer_params={"do_remote_decode": true}` (not streamed), then sends the original
request with the returned kv_transfer_params to a decode server and relays its answer,
streamed or not. A client's own kv_transfer_params are dropped (only the prefill leg's reach
the decode server), and no backend's reach the client. What the decode server would refuse of
the fields the prefill leg does not carry (stream_options without stream, bad or inconsistent
output limits, several choices: one lease serves one) is refused before the prefill server is
asked; whenever the decode leg fails anyway (refused, unreachable, silent, the client left) the
prefill server's lease is released at once over its lease channel (with the deployment secret,
VLLM_EXT_AUTH_SECRET, as the router's). The client's Authorization and X-Request-Id headers go to
both legs. A prefill server's error answer is relayed as is, one that is not JSON gives 502; a
server that cannot be reached, or that has begun no answer after first_byte_s and answers no
/health, is skipped with a log line and the next one tried (503 or 504 when none is left); a
decode server that fails mid-stream ends the stream with an error event. Also serves /health and
/v1/models; other routes get a JSON 404 as vLLM gives. Needs aiohttp (a vLLM dependency); does
not import vLLM.
"""

import argparse
import asyncio
import json
import logging
from typing import Any, Dict, List, Optional, Set, Tuple

import aiohttp
from aiohttp import web

from ..lease.channel import ChannelError, LeaseClient
from ..lease.kv_params import lease_ref
from ..migration import auth
from . import settings as settings_
from .http import (
    Admission,
    ClientGone,
    Rejected,
    TooLarge,
    backend_session,
    busy,
    client_auth,
    error,
    first_models,
    local_limit,
    openai_app,
    read_bounded,
    scrub_answer,
    unless_client_leaves,
)
from .placement import Turns
from .settings import ProxySettings

logger = logging.getLogger("vllm_ext.proxy")

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
BACKEND_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, ConnectionError)


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


class Stalled(Exception):
    """A backend began no answer within first_byte_s and answered no /health."""


def refusal(body: Dict[str, Any]) -> Optional[str]:
    """Why the decode server would refuse `body` in a field the prefill leg does not carry
    (stream, stream_options, the output limits, n), as vLLM says it (None: it would not): asked
    before the prefill server, so that no lease is made for a request that cannot use it."""
    opts = body.get("stream_options")
    if opts is not None and not body.get("stream"):
        return "Stream options can only be defined when `stream=True`."
    if opts is not None and not isinstance(opts, dict):
        return "stream_options: expected an object"
    n = body.get("n")
    if n is not None and n != 1:
        return f"n: the P/D proxy serves one choice per request (one prefill lease serves one), got {n!r}"
    if body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "best_of and use_beam_search: the P/D proxy serves one choice per request"
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{name}: expected an integer, got {value!r}"
        if value is not None and value < (0 if name == "min_tokens" else 1):
            return f"{name} must be at least {0 if name == 'min_tokens' else 1}, got {value}."
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    if body.get("min_tokens") is not None and limit is not None and body["min_tokens"] > limit:
        return f"min_tokens must be less than or equal to max_tokens={limit}, got {body['min_tokens']}."
    return None


class Proxy:
    def __init__(self, prefill: Pool, decode: Pool, settings: ProxySettings, secret: Optional[bytes] = None):
        self.prefill, self.decode, self.settings = prefill, decode, settings
        self.secret = secret  # for releasing the prefill servers' leases (None: they expire)
        self.admission = Admission(settings.max_requests, settings.max_body_bytes)
        self.session: Optional[aiohttp.ClientSession] = None
        self._lease_clients: Dict[Tuple[str, int], LeaseClient] = {}
        self._releasing: Set[asyncio.Task] = set()
        self.released = 0  # leases released after a failed decode leg, since start

    async def start(self, app) -> None:
        self.session = backend_session(self.settings.timeout_s)
        if self.secret is None:
            logger.warning("no deployment secret (%s): a failed decode leg's prefill lease is held until it "
                           "expires", auth.ENV_SECRET)

    async def stop(self, app) -> None:
        if self._releasing:
            await asyncio.wait(self._releasing, timeout=self.settings.release_timeout_s)
        if self.session is not None:
            await self.session.close()
        for client in self._lease_clients.values():
            client.close()

    # ---- routes --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Each server's health, in command-line order per stage (their URLs are not told)."""
        async def ok(backend: Backend) -> bool:
            try:
                timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
                async with self.session.get(backend.url + "/health", timeout=timeout) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        pools = {"prefill": self.prefill, "decode": self.decode}
        states = {name: list(await asyncio.gather(*(ok(b) for b in pool.backends))) for name, pool in pools.items()}
        healthy = all(any(s) for s in states.values())
        return web.json_response(states, status=200 if healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        return await first_models(self.session, [b.url for b in self.decode.candidates()], "decode server", logger,
                                  headers=client_auth(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            body = await self.admission.read_json(request)
        except Rejected as e:
            return e.response
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "BadRequestError")
        refused = refusal(body)
        if refused is not None:
            return error(400, refused, "BadRequestError")

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
        served = False
        try:
            response, served = await self._decode(request, path, decode_body, headers)
            return response
        finally:
            if not served:  # also when the client left (this handler cancelled)
                self._release(params)

    # ---- the prefill server's lease ------------------------------------------------------
    def _release(self, params: Any) -> None:
        """Releases the lease of a prefill answer's `params` (if any) aside: the decode leg will
        not take it, and its blocks would stay held until it expires."""
        ref = lease_ref(params)
        if ref is None or self.secret is None:
            return
        task = asyncio.get_running_loop().create_task(self._release_now(*ref))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_now(self, lease: str, host: str, port: int) -> None:
        client = self._lease_clients.get((host, port))
        if client is None:
            client = self._lease_clients[(host, port)] = LeaseClient(self.secret, host, port,
                                                                     self.settings.release_timeout_s)
        try:
            await asyncio.get_running_loop().run_in_executor(None, client.release, lease,
                                                             self.settings.release_timeout_s)
            self.released += 1
            logger.info("lease %s... of %s:%d released: its decode leg failed", lease[:8], host, port)
        except ChannelError as e:  # taken and ended by the decode server already, or expired
            logger.info("lease %s... of %s:%d not released: %s", lease[:8], host, port, e)

    # ---- legs ----------------------------------------------------------------------------
    async def _alive(self, backend: Backend) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self.session.get(backend.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _begin(self, backend: Backend, path: str, body: Dict, headers: Dict[str, str]):
        """(the backend's answer, its first bytes: b"" unless a streamed 200); Stalled when
        nothing of it came within first_byte_s and the backend answers no /health."""
        stream = bool(body.get("stream"))

        async def begin():
            r = await self.session.post(backend.url + path, json=body, headers=headers)
            try:
                first = await r.content.readany() if stream and r.status == 200 else b""
            except BaseException:
                r.close()
                raise
            return r, first

        task = asyncio.ensure_future(begin())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.first_byte_s)
                if done:
                    return task.result()
                if not await self._alive(backend):
                    raise Stalled(f"nothing within {self.settings.first_byte_s:g} s, and no answer to /health")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    async def _prefill(self, path: str, body: Dict, headers: Dict[str, str]):
        stalled = False
        for backend in self.prefill.candidates():
            backend.in_flight += 1
            try:
                r, _ = await self._begin(backend, path, body, headers)
                try:
                    raw = await read_bounded(r, self.settings.max_event_bytes)
                finally:
                    r.release()
                if r.status != 200:
                    return web.Response(status=r.status, body=raw, content_type=r.content_type or "application/json")
                try:
                    return json.loads(raw)
                except (UnicodeDecodeError, ValueError) as e:
                    logger.warning("prefill server %s answered 200 with a body that is not JSON: %s", backend.url, e)
                    return error(502, f"the prefill server's answer is not JSON: {e}", "BadGatewayError")
            except TooLarge as e:
                logger.warning("prefill server %s sent %s", backend.url, e)
                return error(502, "the prefill server's answer is too large", "BadGatewayError")
            except Stalled as e:
                stalled = True
                logger.warning("prefill server %s is stalled (%s): trying the next", backend.url, e)
            except BACKEND_ERRORS as e:
                if local_limit(e) is not None:
                    return busy(f"the proxy is at a local limit ({local_limit(e).strerror}): retry later")
                logger.warning("prefill server %s is down (%s: %s): trying the next", backend.url,
                               type(e).__name__, e)
            finally:
                backend.in_flight -= 1
        if stalled:
            return error(504, f"no prefill server answered within {self.settings.first_byte_s:g} s",
                         "GatewayTimeoutError")
        return error(503, "no prefill server is reachable", "ServiceUnavailableError")

    async def _decode(self, request: web.Request, path: str, body: Dict,
                      headers: Dict[str, str]) -> Tuple[web.StreamResponse, bool]:
        """The client's answer, and whether the decode server served it (200, relayed whole)."""
        stream = bool(body.get("stream"))
        stalled = False
        for backend in self.decode.candidates():
            backend.in_flight += 1
            out = None
            try:
                r, first = await unless_client_leaves(request, self._begin(backend, path, body, headers))
                try:
                    if not stream or r.status != 200:
                        raw = await unless_client_leaves(request, read_bounded(r, self.settings.max_event_bytes))
                        if r.status != 200:
                            logger.info("decode server %s refused a request (%d): %s", backend.url, r.status,
                                        raw[:300])
                        return web.Response(status=r.status, body=scrub_answer(raw, r.content_type),
                                            content_type=r.content_type or "application/json"), r.status == 200
                    out = web.StreamResponse(status=200, headers={
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache"})
                    await _to_client(out.prepare(request))
                    if first:
                        await _to_client(out.write(first))
                    async for chunk in r.content.iter_any():
                        await _to_client(out.write(chunk))
                    await _to_client(out.write_eof())
                    return out, True
                finally:
                    r.release()
            except ClientGone as e:
                logger.info("the client left before the end of its answer: %s", e)
                return out if out is not None else web.Response(status=499), False
            except TooLarge as e:
                logger.warning("decode server %s sent %s", backend.url, e)
                return error(502, "the decode server's answer is too large", "BadGatewayError"), False
            except Stalled as e:
                stalled = True
                logger.warning("decode server %s is stalled (%s): trying the next", backend.url, e)
            except BACKEND_ERRORS as e:
                if out is not None:  # part of the stream went out already: it ends here, with an error event
                    logger.warning("decode server %s failed mid-stream (%s: %s)", backend.url, type(e).__name__, e)
                    event = {"error": {"message": f"the decode server failed mid-stream: {type(e).__name__}",
                                       "type": "BadGatewayError", "param": None, "code": 502}}
                    try:
                        await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                        await out.write_eof()
                    except (ConnectionError, RuntimeError) as e2:  # the client left meanwhile
                        logger.debug("could not end the stream: %s", e2)
                    return out, False
                if local_limit(e) is not None:
                    return busy(f"the proxy is at a local limit ({local_limit(e).strerror}): retry later"), False
                logger.warning("decode server %s is down (%s: %s): trying the next", backend.url,
                               type(e).__name__, e)
            finally:
                backend.in_flight -= 1
        if stalled:
            return error(504, f"no decode server answered within {self.settings.first_byte_s:g} s",
                         "GatewayTimeoutError"), False
        return error(503, "no decode server is reachable", "ServiceUnavailableError"), False


async def _to_client(write) -> None:
    """A write to the client; ClientGone when it left."""
    try:
        await write
    except (ConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from e


PROXY = web.AppKey("proxy", Proxy)


def build_app(prefill: List[str], decode: List[str], policy: str = "round_robin",
              timeout_s: float = 600.0, settings: Optional[ProxySettings] = None) -> web.Application:
    """The proxy's app; `settings` (default: ProxySettings(policy, timeout_s)) for every knob."""
    settings = settings or ProxySettings(policy=policy, timeout_s=timeout_s)
    proxy = Proxy(Pool("prefill", prefill, settings.policy), Pool("decode", decode, settings.policy), settings,
                  auth.deployment_secret())
    app = openai_app(proxy, proxy.admission)
    app[PROXY] = proxy
    return app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    settings_.add_flags(parser, ProxySettings)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_.from_flags(args, ProxySettings)
        app = build_app(args.prefill, args.decode, settings=settings)
    except ValueError as e:
        parser.error(str(e))
    logger.info("P/D proxy on http://%s:%d: prefill %s, decode %s, %s", args.host, args.port, args.prefill,
                args.decode, settings.policy)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
