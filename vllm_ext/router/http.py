"""What the P/D proxy and the router share as OpenAI-compatible fronts (aiohttp): vLLM-shaped
error bodies, an app with the OpenAI routes and JSON answers for unknown routes, and the
client session to the vLLM servers."""

import asyncio
from typing import Optional

import aiohttp
from aiohttp import web

# A pooled connection to a backend is dropped after this long idle: before the vLLM server's
# own limit (uvicorn closes after 5 s), so that a request never goes out on a connection the
# server is closing ("Server disconnected").
BACKEND_KEEPALIVE_S = 3.0


def backend_session(read_timeout_s: float):
    """The client session of a front (router, proxy) to its vLLM servers: no pool limit
    (aiohttp's default of 100 connections: every stream holds one to its end), a deadline on
    connecting only (a request waiting for a pooled connection must not take a busy server for a
    dead one), and `read_timeout_s` of silence."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=read_timeout_s))


class Refused(Exception):
    """An instance's (or the admin API's) refusal, relayed with its status."""

    def __init__(self, status: int, body: bytes, content_type: Optional[str]):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body, self.content_type = status, body, content_type or "application/json"


def error(status: int, message: str, kind: str) -> web.Response:
    """An error body shaped like vLLM's."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


@web.middleware
async def json_http_errors(request: web.Request, handler):
    """Unknown routes and methods answer JSON, as vLLM's (FastAPI) server does."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def client_auth(request: web.Request) -> dict:
    """The client's Authorization header, for what a front asks its servers on the client's
    behalf: a server started with --api-key checks it as it would the client's own request."""
    return {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}


async def first_models(session, urls, what: str, log, headers=None) -> web.Response:
    """/v1/models of the first of `urls` that answers (`what` names them in the log and the 503)."""
    for url in urls:
        try:
            async with session.get(url + "/v1/models", headers=headers) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("%s %s is down (%s): trying the next", what, url, e)
    return error(503, f"no {what} is reachable", "ServiceUnavailableError")


def openai_app(front, middlewares=()) -> web.Application:
    """An app serving `front`'s health, models and completions (both APIs), started and
    stopped with it."""
    app = web.Application(client_max_size=64 << 20, middlewares=[*middlewares, json_http_errors])
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    app.router.add_get("/health", front.health)
    app.router.add_get("/v1/models", front.models)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.completions)
    return app
