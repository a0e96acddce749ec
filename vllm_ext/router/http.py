"""What the P/D proxy and the router share as OpenAI-compatible fronts (aiohttp): vLLM-shaped
error bodies, an app with the OpenAI routes and JSON answers for unknown routes, the client
session to the vLLM servers, and what bounds a front against its clients and its backends:
admission (requests at once, a body's size, its parsing), what a backend's answer may make it
hold, and what of a backend's answer a client never sees."""

import asyncio
import errno
import json
import logging
import resource
from typing import Any, Optional

import aiohttp
from aiohttp import web

logger = logging.getLogger("vllm_ext.router")

# A pooled connection to a backend is dropped after this long idle: before the vLLM server's
# own limit (uvicorn closes after 5 s), so that a request never goes out on a connection the
# server is closing ("Server disconnected").
BACKEND_KEEPALIVE_S = 3.0
CLIENT_CHECK_S = 0.5  # how often a wait for a whole answer looks whether its client is still there
RETRY_AFTER_S = 1  # what a 503 for a local limit tells the client to wait
# max_requests' default: the file-descriptor limit, less a reserve (listening sockets, the polls,
# lease channels, logs), over what one request holds (its client, its leg, a migration's or a
# P/D proxy's second connection)
FD_RESERVE = 64
FDS_PER_REQUEST = 3
# A body larger than this is parsed after any other large one (one at a time, in a thread), so
# that streams get the loop between two parses
INLINE_PARSE_BYTES = 256 << 10
# errno values that say this process (or host) ran out of something: a local limit, not a backend down
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})
# Fields of a backend's answer that only the fronts may read: a producer's kv_transfer_params tell
# how much of a prompt its prefix cache holds (remote_prefill_cached_tokens: an oracle of other
# users' prompts) and name its lease
BACKEND_ONLY_FIELDS = ("kv_transfer_params",)


def backend_session(read_timeout_s: float):
    """The client session of a front (router, proxy) to its vLLM servers: no pool limit
    (aiohttp's default of 100 connections: every stream holds one to its end; admission bounds
    them), a deadline on connecting only (a request waiting for a pooled connection must not
    take a busy server for a dead one), and `read_timeout_s` of silence."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=read_timeout_s))


def default_max_requests() -> int:
    """Requests a front serves at once by default: what its file-descriptor limit leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(1, (soft - FD_RESERVE) // FDS_PER_REQUEST)


def local_limit(e: BaseException) -> Optional[OSError]:
    """The OSError under `e` that says this process or host ran out of something (file
    descriptors, ports, memory): not the backend's fault (None: none)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        os_error = getattr(e, "os_error", None)  # aiohttp's ClientConnectorError
        for candidate in (e, os_error):
            if isinstance(candidate, OSError) and candidate.errno in LOCAL_ERRNOS:
                return candidate
        e = e.__cause__ or e.__context__
    return None


class Refused(Exception):
    """An instance's (or the admin API's) refusal, relayed with its status."""

    def __init__(self, status: int, body: bytes, content_type: Optional[str]):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body, self.content_type = status, body, content_type or "application/json"


class ClientGone(Exception):
    """The client closed its connection."""


class Rejected(Exception):
    """A client's request refused before any backend is asked: `response` says why."""

    def __init__(self, response: web.Response):
        super().__init__(response.text)
        self.response = response


class TooLarge(Exception):
    """A backend's answer (or one event of it) is larger than the front holds."""


def error(status: int, message: str, kind: str) -> web.Response:
    """An error body shaped like vLLM's."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def busy(message: str) -> web.Response:
    """A 503 for a local limit: the client may retry after RETRY_AFTER_S."""
    response = error(503, message, "ServiceUnavailableError")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


@web.middleware
async def json_http_errors(request: web.Request, handler):
    """Unknown routes and methods answer JSON, as vLLM's (FastAPI) server does."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


class Admission:
    """What a front lets in: at most `max_requests` OpenAI requests at once (the rest get a 503
    with Retry-After before their body is read), bodies of at most `max_body_bytes` (413), and
    large bodies parsed one at a time off the loop's thread (read_json)."""

    LIMITED = ("/v1/completions", "/v1/chat/completions", "/v1/models")

    def __init__(self, max_requests: int, max_body_bytes: int):
        self.max_requests = max_requests or default_max_requests()
        self.max_body_bytes = max_body_bytes
        self.active = 0
        self.refused = 0  # requests answered 503 for the limit, since start
        self._parsing = asyncio.Lock()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path not in self.LIMITED:
            return await handler(request)
        if self.active >= self.max_requests:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("%d requests at once, the limit (max_requests): refused with 503 (%d so far)",
                               self.active, self.refused)
            return busy(f"the server is at its limit of {self.max_requests} requests at once: retry later")
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1

    async def read_json(self, request: web.Request) -> Any:
        """The request's JSON body; Rejected (with the error answer) when it is too large (413) or
        not JSON (400). Small bodies are parsed at once, large ones one at a time in a thread."""
        too_large = f"the request body is larger than {self.max_body_bytes} bytes (the server's max_body_bytes)"
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise Rejected(error(413, too_large, "BadRequestError"))
        try:
            raw = await request.read()  # aiohttp stops at client_max_size (= max_body_bytes)
        except web.HTTPRequestEntityTooLarge:
            raise Rejected(error(413, too_large, "BadRequestError")) from None
        try:
            if len(raw) <= INLINE_PARSE_BYTES:
                return json.loads(raw)
            async with self._parsing:
                return await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise Rejected(error(400, f"the request body is not valid JSON: {e}", "BadRequestError")) from None


def client_auth(request: web.Request) -> dict:
    """The client's Authorization header, for what a front asks its servers on the client's
    behalf: a server started with --api-key checks it as it would the client's own request."""
    return {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}


async def read_bounded(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """A backend's whole answer body; TooLarge past `max_bytes` (the connection is closed)."""
    if response.content_length is not None and response.content_length > max_bytes:
        response.close()
        raise TooLarge(f"an answer of {response.content_length} bytes (the most held is {max_bytes})")
    parts, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            response.close()
            raise TooLarge(f"an answer of more than {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def read_event(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The next event of a backend's stream, through its blank line (b"" at the end of the
    stream); TooLarge past `max_bytes` (the connection is closed)."""
    try:
        return await response.content.readuntil(b"\n\n", max_size=max_bytes)
    except aiohttp.http_exceptions.LineTooLong:
        response.close()
        raise TooLarge(f"an event of more than {max_bytes} bytes") from None


def scrub_answer(raw: bytes, content_type: Optional[str]) -> bytes:
    """A backend's whole (not streamed) answer as the client gets it: without BACKEND_ONLY_FIELDS
    (vLLM's streams carry none of them)."""
    if not any(name.encode() in raw for name in BACKEND_ONLY_FIELDS) or "json" not in (content_type or ""):
        return raw
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return raw
    if not isinstance(body, dict):
        return raw
    for name in BACKEND_ONLY_FIELDS:
        body.pop(name, None)
    return json.dumps(body).encode()


def public_models(raw: bytes) -> bytes:
    """A backend's /v1/models answer as a client gets it: each card's `root` (vLLM puts the
    model's path there) and `parent` say its id."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return raw
    data = body.get("data") if isinstance(body, dict) else None
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict):
            for name in ("root", "parent"):
                if card.get(name) is not None:
                    card[name] = card.get("id")
    return json.dumps(body).encode()


async def first_models(session, urls, what: str, log, headers=None) -> web.Response:
    """/v1/models of the first of `urls` that answers (`what` names them in the log and the 503)."""
    for url in urls:
        try:
            async with session.get(url + "/v1/models", headers=headers) as r:
                raw = await read_bounded(r, 1 << 20)
                return web.Response(status=r.status, body=public_models(raw) if r.status == 200 else raw,
                                    content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError, TooLarge) as e:
            if local_limit(e) is not None:
                return busy(f"the server is at a local limit ({local_limit(e).strerror}): retry later")
            log.warning("%s %s is down (%s): trying the next", what, url, e)
    return error(503, f"no {what} is reachable", "ServiceUnavailableError")


async def unless_client_leaves(request: web.Request, awaitable):
    """`awaitable`, for a client that waits for a whole answer (nothing is written to it
    meanwhile): cancelled, and ClientGone, once the client's connection closes (a leg then
    closes, and its instance aborts the request, as vLLM does for a client of its own)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CLIENT_CHECK_S)
            if done:
                return task.result()
            if request.transport is None or request.transport.is_closing():
                raise ClientGone("the client closed its connection before its answer")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def openai_app(front, admission: Admission, middlewares=()) -> web.Application:
    """An app serving `front`'s health, models and completions (both APIs), started and
    stopped with it, under `admission`."""
    app = web.Application(client_max_size=admission.max_body_bytes,
                          middlewares=[*middlewares, json_http_errors, admission.middleware])
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    app.router.add_get("/health", front.health)
    app.router.add_get("/v1/models", front.models)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.completions)
    return app
