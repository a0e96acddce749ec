"""A prefill/decode proxy in front of vLLM servers running VllmExtConnector (OpenAI API).

    python -m vllm_ext.proxy --prefill http://P1:8100 [...] --decode http://D1:8200 [...] --port 8000

For each /v1/completions or /v1/chat/completions request it asks a prefill server for one token
with `kv_transfer_params={"do_remote_decode": true}` (not streamed), then sends the original
request with the returned kv_transfer_params to a decode server and relays its answer, streamed
or not. A client's own kv_transfer_params are dropped (only the prefill leg's reach the decode
server), and no backend's reach the client. What the decode server would refuse of the fields
the prefill leg does not carry (stream_options without stream, bad or inconsistent output
limits, several choices: one lease serves one) is refused before the prefill server is asked;
whenever the decode leg fails anyway (refused, unreachable, silent, the client left) the prefill
server's lease is released at once over its lease channel (with the deployment secret,
VLLM_EXT_AUTH_SECRET, as the router's); a served request's, which its decode server releases
itself, is released served_release_s after its answer in case that server died first. A decode
server that answers an internal error before any token (what vLLM answers a failed KV load under
kv_load_failure_policy "fail") is asked once more, without the prefill server's KV: the decode
side computes the prompt. The decode server's answer ends at the client's max_tokens
(max_completion_tokens) whatever it sends, and no event of it larger than max_event_bytes is
held (OutputLimit). The client's Authorization and X-Request-Id headers go to both legs. A
prefill server's error answer is relayed as is, one that is not JSON gives 502; a server that
cannot be reached, or that has begun no answer after first_byte_s and answers no /health, is
skipped with a log line and the next one tried (503 or 504 when none is left); a decode server
that fails mid-stream ends the stream with an error event. Also serves /health and /v1/models;
other routes get a JSON 404 as vLLM gives. Needs aiohttp (a vLLM dependency); does not import
vLLM.
"""

import argparse
import asyncio
import collections
import json
import logging
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

import aiohttp
from aiohttp import web

from ..lease.channel import ChannelError, ChannelRefused, LeaseClient
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
    read_event,
    scrub_answer,
    unless_client_leaves,
)
from .placement import Turns
from .settings import ProxySettings

logger = logging.getLogger("vllm_ext.proxy")

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
RELEASE_TRIES = 5  # a release of a prefill lease, asked again while its server does not answer ...
RELEASE_BACKOFF_S = 1.0  # ... this long after the first, then twice as long each time (40 s in all at most)
# Served requests' leases waiting for their late release (settings.served_release_s); past this
# many, the oldest is let go (its lease expires by itself, at the prefill server's lease_s)
MAX_LATE_RELEASES = 1 << 16
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


def asked_limit(body: Dict[str, Any], chat: bool) -> Optional[int]:
    """The output limit the client gave (None: none given), which the proxy enforces whatever the
    decode server sends (refusal() has checked its type)."""
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if body.get(name) is not None:
            return body[name]
    return None


def _cut_choice(choice: Dict[str, Any], keep: int, n: int) -> bool:
    """`choice` (of a stream chunk or a whole answer, `n` tokens) cut to its first `keep` tokens,
    finishing "length"; False when its text cannot be cut there (several tokens and no logprobs
    whose tokens spell it), True when it was."""
    keep = max(keep, 0)
    holder = choice.get("delta") if isinstance(choice.get("delta"), dict) else \
        choice.get("message") if isinstance(choice.get("message"), dict) else choice
    key = "text" if holder is choice else "content"
    text = holder.get(key)
    logprobs = choice.get("logprobs")
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        choice["token_ids"] = ids[:keep]
    tokens = None
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # completions
        tokens = logprobs["tokens"]
        choice["logprobs"] = {k: v[:keep] if isinstance(v, list) else v for k, v in logprobs.items()}
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # chat
        tokens = [t.get("token") if isinstance(t, dict) else None for t in logprobs["content"]]
        choice["logprobs"] = dict(logprobs, content=logprobs["content"][:keep])
    choice["finish_reason"], choice["stop_reason"] = "length", None
    if not isinstance(text, str) or not text or keep >= n:
        return True
    if keep == 0:
        holder[key] = ""
        return True
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) and "".join(tokens) == text:
        holder[key] = "".join(tokens[:keep])
        return True
    return False


class OutputLimit:
    """What the proxy relays of the decode server's streamed answer: each choice's tokens up to
    the client's limit (counted by the server's own per-chunk usage, which the decode leg asks
    for, else by token ids, else one per chunk with text), the chunk that crosses it cut there
    and finished "length", nothing after; the usage the client did not ask for taken out again.
    A crossing chunk of several tokens whose text cannot be cut there (no logprobs that spell it:
    vLLM sends several tokens in one chunk when its reader lags) is not relayed: `uncut` then
    says why, and the stream ends with that error (never more text than was asked)."""

    def __init__(self, limit: Optional[int], choices: int, want_usage: bool, want_continuous: bool):
        self.limit, self.choices = limit, choices
        self.want_usage, self.want_continuous = want_usage, want_continuous
        self.counts: Dict[int, int] = {}
        self.cut: Set[int] = set()  # choices ended here (the server sent past their limit)
        self.prompt_tokens: Optional[int] = None
        self.last: Dict[str, Any] = {}  # id, object, created, model of the last chunk
        self.overran = False
        self.uncut: Optional[str] = None

    @property
    def done(self) -> bool:
        """Every choice has been ended by the proxy: nothing more of the server is relayed."""
        return len(self.cut) >= self.choices

    def shape(self, event: bytes) -> bytes:
        """An event of the server (b"data: ...\n\n") as the client gets it (b"": nothing)."""
        out = []
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                out.append(line)
                continue
            data = line[5:].strip()
            try:
                chunk = json.loads(data) if data != b"[DONE]" else None
            except ValueError:
                chunk = None
            if not isinstance(chunk, dict) or "error" in chunk:
                out.append(line)
                continue
            shaped = self._chunk(chunk)
            if shaped is not None:
                out.append(b"data: " + json.dumps(shaped).encode())
        lines = [x for x in out if x]
        return b"\n".join(lines) + b"\n\n" if lines else b""

    def _chunk(self, chunk: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
        if usage is not None and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        self.last = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        choices = chunk.get("choices") if isinstance(chunk.get("choices"), list) else []
        if not choices:  # the usage chunk at the end
            if not self.want_usage:
                return None
            if usage is not None and self.limit is not None:
                done = sum(min(n, self.limit) for n in self.counts.values())
                chunk["usage"] = dict(usage, completion_tokens=done, total_tokens=(self.prompt_tokens or 0) + done)
            return chunk
        kept = []
        for choice in choices:
            if not isinstance(choice, dict):
                kept.append(choice)
                continue
            i = choice.get("index", 0)
            if i in self.cut:
                continue  # the server goes on past the limit: nothing more of this choice
            before = self.counts.get(i, 0)
            ids = choice.get("token_ids")
            holder = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice
            if usage is not None and len(choices) == 1 and isinstance(usage.get("completion_tokens"), int):
                now = usage["completion_tokens"]
            elif isinstance(ids, list):
                now = before + len(ids)
            else:
                now = before + (1 if holder.get("text") or holder.get("content") else 0)
            self.counts[i] = now
            if self.limit is not None and (now > self.limit or (now == self.limit and not choice.get("finish_reason"))):
                if not self.overran:  # at the limit, unfinished: it would go on
                    self.overran = True
                    logger.warning("the decode server went on past the client's max_tokens (%d): cut there",
                                   self.limit)
                self.counts[i] = self.limit
                self.cut.add(i)
                if not _cut_choice(choice, self.limit - before, now - before):
                    self.counts[i] = before
                    self.uncut = (f"the decode server sent past the client's max_tokens ({self.limit}), {now - before} "
                                  "tokens in one chunk whose text the proxy cannot cut (no logprobs spell it)")
                    logger.warning("%s: the stream ends here", self.uncut)
                    continue
            kept.append(choice)
        if not kept:
            return None
        chunk["choices"] = kept
        if not self.want_continuous:
            chunk.pop("usage", None)
        elif usage is not None and self.limit is not None and isinstance(usage.get("completion_tokens"), int) \
                and usage["completion_tokens"] > self.limit:
            chunk["usage"] = dict(usage, completion_tokens=self.limit,
                                  total_tokens=(self.prompt_tokens or 0) + self.limit)
        return chunk

    def end(self) -> bytes:
        """What ends the client's stream once the proxy ended every choice: the usage chunk (when
        the client asked for it) and [DONE]."""
        tail = b""
        if self.want_usage:
            done = sum(self.counts.values())
            usage = {"prompt_tokens": self.prompt_tokens or 0, "completion_tokens": done,
                     "total_tokens": (self.prompt_tokens or 0) + done}
            tail = b"data: " + json.dumps(dict(self.last, choices=[], usage=usage)).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"


def limit_answer(raw: bytes, limit: Optional[int]) -> Optional[bytes]:
    """A whole (not streamed) answer of the decode server cut to the client's limit: `raw` when
    within it, the cut answer, or None when a choice went past it and its text cannot be cut."""
    if limit is None:
        return raw
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return raw
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list):
        return raw
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    changed = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            n = len(ids)
        elif usage is not None and len(choices) == 1 and isinstance(usage.get("completion_tokens"), int):
            n = usage["completion_tokens"]
        else:
            continue
        if n > limit:
            logger.warning("the decode server answered past the client's max_tokens (%d tokens, %d asked)", n, limit)
            if not _cut_choice(choice, limit, n):
                return None
            changed = True
    if not changed:
        return raw
    if usage is not None and len(choices) == 1:
        prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else 0
        body["usage"] = dict(usage, completion_tokens=limit, total_tokens=prompt + limit)
    return json.dumps(body).encode()


# vLLM's answer to a request that finished with FinishReason.ERROR (a KV load failed under
# kv_load_failure_policy "fail"): its GenerationError, a 500 (a whole answer) or the same error as
# the first event of a stream. An overload (503, RetryableRequestError) or another internal error
# (its own message) is not a failed load: it is relayed, never recomputed.
FAILED_LOAD_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}


def _failed_load(status: int, body: Any) -> bool:
    """Whether the decode server's answer (its status, its JSON error) is vLLM's to a request whose
    KV load failed under kv_load_failure_policy "fail": its GenerationError before any token."""
    error_ = body.get("error") if isinstance(body, dict) else None
    if status != 500 or not isinstance(error_, dict):
        return False
    return all(error_.get(key) == value for key, value in FAILED_LOAD_ERROR.items())


class Proxy:
    def __init__(self, prefill: Pool, decode: Pool, settings: ProxySettings, secret: Optional[bytes] = None):
        self.prefill, self.decode, self.settings = prefill, decode, settings
        self.secret = secret  # for releasing the prefill servers' leases (None: they expire)
        self.admission = Admission(settings.max_requests, settings.max_body_bytes)
        self.session: Optional[aiohttp.ClientSession] = None
        self._lease_clients: Dict[Tuple[str, int], LeaseClient] = {}
        self._releasing: Set[asyncio.Task] = set()
        self._late: Deque[Tuple[float, Tuple[str, str, int]]] = collections.deque(maxlen=MAX_LATE_RELEASES)
        self._late_added: Optional[asyncio.Event] = None
        self._late_task: Optional[asyncio.Task] = None
        self.released = 0  # leases released after a failed decode leg, since start
        self.released_late = 0  # served requests' leases their decode server had not released, since start
        self.retried = 0  # requests asked again without remote KV after a failed load, since start

    async def start(self, app) -> None:
        self.session = backend_session(self.settings.timeout_s)
        if self.secret is None:
            logger.warning("no deployment secret (%s): a failed decode leg's prefill lease is held until it "
                           "expires", auth.ENV_SECRET)
        self._late_added = asyncio.Event()
        self._late_task = asyncio.get_running_loop().create_task(self._release_late())

    async def stop(self, app) -> None:
        if self._late_task is not None:  # the served requests' leases still waiting expire by themselves
            self._late_task.cancel()
        if self._releasing:
            _, pending = await asyncio.wait(self._releasing, timeout=self.settings.release_timeout_s)
            for task in pending:  # still asking a server that does not answer: its lease expires by itself
                task.cancel()
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
        if body.get("stream"):  # the server's own count of each chunk's tokens (OutputLimit)
            opts = body.get("stream_options") or {}
            decode_body["stream_options"] = dict(opts, include_usage=True, continuous_usage_stats=True)
        if isinstance(params, dict):
            decode_body["kv_transfer_params"] = params
        else:
            logger.warning("prefill answered without kv_transfer_params (is VllmExtConnector configured?): "
                           "the decode server computes the prompt itself")
        served = False
        try:
            response, served = await self._decode(request, path, decode_body, headers, body)
            if isinstance(response, FailedLoad) and isinstance(params, dict):
                # vLLM's kv_load_failure_policy "fail" lost the request with its load: once more, without
                # the remote KV (the decode server computes the prompt)
                logger.warning("decode server %s failed the request's KV load (%s): asking again without the "
                               "prefill server's KV", response.url, response.message)
                self.retried += 1
                self._release(params)
                params = None
                decode_body.pop("kv_transfer_params", None)
                response, served = await self._decode(request, path, decode_body, headers, body)
            return response.response if isinstance(response, FailedLoad) else response
        finally:
            if not served:  # also when the client left (this handler cancelled)
                self._release(params)
            else:  # released by its decode server, unless that died before its release went out
                self._release_after_answer(params)

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

    def _lease_client(self, host: str, port: int) -> LeaseClient:
        client = self._lease_clients.get((host, port))
        if client is None:
            client = self._lease_clients[(host, port)] = LeaseClient(self.secret, host, port,
                                                                     self.settings.release_timeout_s)
        return client

    def _release_after_answer(self, params: Any) -> None:
        """A served request's lease: its decode server released it when it pulled (or chose not to
        pull) the blocks, but one killed before its release went out would leave the blocks held
        until the lease expired. Nothing else may use the lease now, so the proxy releases it
        settings.served_release_s after the answer (its refusal, the usual case, is not logged)."""
        ref = lease_ref(params)
        if ref is None or self.secret is None or self._late_added is None:
            return
        self._late.append((asyncio.get_running_loop().time() + self.settings.served_release_s, ref))
        self._late_added.set()

    async def _release_late(self) -> None:
        """_release_after_answer's releases, in the order of their answers (one at a time: a
        prefill server that does not answer delays the rest, whose leases then expire at worst)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._late:
                self._late_added.clear()
                await self._late_added.wait()
                continue
            due, (lease, host, port) = self._late[0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
                continue
            self._late.popleft()
            try:
                await loop.run_in_executor(None, self._lease_client(host, port).release, lease,
                                           self.settings.release_timeout_s)
            except ChannelRefused:  # the decode server released it (or it expired): the usual case
                continue
            except ChannelError as e:
                logger.info("lease %s... of %s:%d not released after its answer (%s): it expires by itself",
                            lease[:8], host, port, e)
                continue
            self.released_late += 1
            logger.info("lease %s... of %s:%d released %g s after its answer: its decode server had not released it",
                        lease[:8], host, port, self.settings.served_release_s)

    async def _release_now(self, lease: str, host: str, port: int) -> None:
        """Releases a lease; a prefill server that does not answer (stopped, busy) is asked again,
        RELEASE_TRIES times in all, BACKOFF_S apart and doubling: otherwise the lease would hold
        its blocks until it expires."""
        client = self._lease_client(host, port)
        for attempt in range(1, RELEASE_TRIES + 1):
            try:
                await asyncio.get_running_loop().run_in_executor(None, client.release, lease,
                                                                 self.settings.release_timeout_s)
                self.released += 1
                logger.info("lease %s... of %s:%d released: its decode leg failed", lease[:8], host, port)
                return
            except ChannelRefused as e:  # taken and ended by the decode server already, or expired
                logger.info("lease %s... of %s:%d not released: %s", lease[:8], host, port, e)
                return
            except ChannelError as e:  # no answer: asked again
                if attempt == RELEASE_TRIES:
                    logger.warning("lease %s... of %s:%d not released after %d tries (%s): it holds its blocks "
                                   "until it expires", lease[:8], host, port, attempt, e)
                    return
                logger.info("lease %s... of %s:%d not released yet (%s): asking again", lease[:8], host, port, e)
                await asyncio.sleep(RELEASE_BACKOFF_S * 2 ** (attempt - 1))

    # ---- legs ----------------------------------------------------------------------------
    async def _alive(self, backend: Backend) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self.session.get(backend.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _begin(self, backend: Backend, path: str, body: Dict, headers: Dict[str, str]):
        """(the backend's answer, its first event: b"" unless a streamed 200); Stalled when
        nothing of it came within first_byte_s and the backend answers no /health."""
        stream = bool(body.get("stream"))

        async def begin():
            r = await self.session.post(backend.url + path, json=body, headers=headers)
            try:
                first = await read_event(r, self.settings.max_event_bytes) if stream and r.status == 200 else b""
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

    async def _decode(self, request: web.Request, path: str, body: Dict, headers: Dict[str, str],
                      asked: Dict) -> Tuple[Any, bool]:
        """The client's answer (a FailedLoad when the server answered an internal error before any
        token to a body with remote KV), and whether the decode server served it (200, relayed whole). `asked`: the
        client's own body (its limit, the usage it wants)."""
        stream = bool(body.get("stream"))
        chat = path.endswith("/chat/completions")
        limit = asked_limit(asked, chat)
        remote = "kv_transfer_params" in body  # a failed load can be asked again without it
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
                            failed = _json_or_none(raw)
                            if remote and _failed_load(r.status, failed):
                                return FailedLoad(backend.url, r.status, failed, raw, r.content_type), False
                            return web.Response(status=r.status, body=scrub_answer(raw, r.content_type),
                                                content_type=r.content_type or "application/json"), False
                        raw = limit_answer(scrub_answer(raw, r.content_type), limit)
                        if raw is None:
                            return error(502, "the decode server answered past the client's max_tokens",
                                         "BadGatewayError"), False
                        return web.Response(status=200, body=raw, content_type=r.content_type or "application/json"), \
                            True
                    shaper = OutputLimit(limit, _prompts(asked, chat), _wants(asked, "include_usage"),
                                         _wants(asked, "continuous_usage_stats"))
                    event = first
                    failed = _error_event(event)
                    if remote and failed is not None and _failed_load(500, failed):
                        return FailedLoad(backend.url, 500, failed, json.dumps(failed).encode(),
                                          "application/json"), False
                    out = web.StreamResponse(status=200, headers={
                        "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache"})
                    await _to_client(out.prepare(request))
                    while event:
                        shaped = shaper.shape(event)
                        if shaped:
                            await _to_client(out.write(shaped))
                        if shaper.uncut is not None:
                            r.close()
                            await _end_with_error(out, shaper.uncut)
                            return out, True
                        if shaper.done:  # the server sent past the limit: the rest is the proxy's
                            r.close()
                            await _to_client(out.write(shaper.end()))
                            break
                        event = await read_event(r, self.settings.max_event_bytes)
                    await _to_client(out.write_eof())
                    return out, True
                finally:
                    r.release()
            except ClientGone as e:
                logger.info("the client left before the end of its answer: %s", e)
                return out if out is not None else web.Response(status=499), False
            except TooLarge as e:
                logger.warning("decode server %s sent %s", backend.url, e)
                if out is not None:
                    await _end_with_error(out, "the decode server sent an event larger than the proxy holds")
                    return out, False
                return error(502, "the decode server's answer is too large", "BadGatewayError"), False
            except Stalled as e:
                stalled = True
                logger.warning("decode server %s is stalled (%s): trying the next", backend.url, e)
            except BACKEND_ERRORS as e:
                if out is not None:  # part of the stream went out already: it ends here, with an error event
                    logger.warning("decode server %s failed mid-stream (%s: %s)", backend.url, type(e).__name__, e)
                    await _end_with_error(out, f"the decode server failed mid-stream: {type(e).__name__}")
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


class FailedLoad:
    """A decode server's internal error before any token (vLLM's answer to a failed KV load
    under kv_load_failure_policy "fail"): asked once more without remote KV, else relayed."""

    def __init__(self, url: str, status: int, body: Any, raw: bytes, content_type: Optional[str]):
        self.url, self.status = url, status
        error_ = body.get("error") if isinstance(body, dict) else None
        self.message = str(error_.get("message") if isinstance(error_, dict) else body)[:300]
        self.response = web.Response(status=status, body=raw, content_type=content_type or "application/json")


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None


def _error_event(event: bytes) -> Optional[Dict[str, Any]]:
    """The error object of a stream's event (`data: {"error": ...}`), None when it is none."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and b'"error"' in line:
            data = _json_or_none(line[5:].strip())
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                return data
    return None


def _wants(body: Dict[str, Any], option: str) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get(option))


def _prompts(body: Dict[str, Any], chat: bool) -> int:
    """How many choices a request's answer has (one per prompt of a completion's list)."""
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def _end_with_error(out: web.StreamResponse, message: str) -> None:
    """Ends a stream already begun with an error event (as vLLM ends one that fails)."""
    event = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
    try:
        await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write_eof()
    except (ConnectionError, RuntimeError) as e:  # the client left meanwhile
        logger.debug("could not end the stream: %s", e)


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
