"""The router's parts wired together: the client routes (/health, /v1/models, the completions
of both APIs) and the admin API, over the instances (`python -m vllm_ext.router`: cli.py)."""

import asyncio
import concurrent.futures
import hmac
import inspect
import itertools
import json
import logging
import os
import secrets
import time
from typing import Any, Dict, List, Optional, Set

import aiohttp
from aiohttp import web

from ..lease import messages
from ..lease.channel import ChannelError
from ..migration import auth
from . import legs, live, openai
from .http import backend_session, client_auth, error, first_models, openai_app
from .openai import ClientStream
from .settings import MAX_STAGES_LIMIT, Settings
from .state import Instance, Leg, Relayed, Routed, StopLeg

logger = logging.getLogger("vllm_ext.router")

# One event of a backend's stream may be large (the first carries the prompt's token ids): read
# up to this much per event where aiohttp takes a bound (its default is 128 KiB).
MAX_EVENT_BYTES = 64 << 20
_EVENT_READ = ({"max_size": MAX_EVENT_BYTES}
               if "max_size" in inspect.signature(aiohttp.StreamReader.readuntil).parameters else {})

ENV_TOKEN = "VLLM_EXT_ROUTER_TOKEN"
ENV_API_KEY = "VLLM_API_KEY"  # vLLM's --api-key from the environment
# A migration's stop waits at most this long for the source's next token (it stops right after one)
STOP_WAIT_MAX_S = 1.0
# A resume that loads KV: the destination is asked, when the resume is sent, to answer once the
# load's result is in; it answers by then or after this long (the router then asks again at the
# first token). At most this many of those questions wait at once.
RESUME_CHECK_WAIT_S = 5.0
CLIENT_CHECK_S = 0.5  # how often a request's wait for its whole answer looks whether its client is still there
DESCRIBE_RETRY_S = 10.0  # the poll asks an instance that did not describe itself again after this
MAX_RESUME_CHECKS = 8
# A chat stream whose instance splits reasoning off its content (--reasoning-parser) stays there:
# a resumed leg is a completion, whose text nothing would split.
REASONING_PINS = "its instance splits reasoning off the content (--reasoning-parser); a resumed leg would not"


class _Silent(aiohttp.ClientConnectionError):
    """Ends a stream of, or a wait for, an instance that has been silent (Router._cut_silent)."""

    def __init__(self, url: str, seconds: float):
        super().__init__(f"{url} sent nothing for {seconds:g} s")


class _LegFailed(Exception):
    """A backend could not be reached, or broke the stream."""


class Router:
    def __init__(self, urls: List[str], leases: Optional[List[Optional[str]]], settings: Settings):
        if not urls:
            raise ValueError("--instance: at least one URL is needed")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--instance: {url!r} is not an http(s) URL")
        leases = list(leases or [None] * len(urls))
        if len(leases) != len(urls):
            raise ValueError(f"--lease: {len(leases)} addresses for {len(urls)} instances (use '-' for none)")
        secret = auth.deployment_secret() if any(leases) else None
        if any(leases) and secret is None:
            raise ValueError(f"--lease needs the deployment secret: set {auth.ENV_SECRET} or {auth.ENV_SECRET_FILE}")
        self.settings = settings
        self.instances = [Instance(u, lease, secret) for u, lease in zip(urls, leases)]
        self._by_url = {i.url: i for i in self.instances}
        self.requests: Dict[str, Routed] = {}
        self.history: List[Dict[str, Any]] = []  # finished migrations (the last 1000)
        self.relayed: Dict[str, Relayed] = {}  # requests that cannot move, by their key in Instance.requests
        self._next = itertools.count()
        self._token = os.environ.get(ENV_TOKEN) or None
        # what the router asks for itself (an instance's /v1/models), under vLLM's own --api-key
        # variable when the instances need one
        key = os.environ.get(ENV_API_KEY)
        self._own_auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.session: Optional[aiohttp.ClientSession] = None
        self._tasks: List[asyncio.Task] = []
        self._describing: Set[asyncio.Future] = set()  # lease-channel describes the polls asked for
        # the resumes' early load checks wait in threads of their own (not the loop's default pool)
        self.checks = concurrent.futures.ThreadPoolExecutor(MAX_RESUME_CHECKS, "vllm-ext-resume-check")

    # ---- lifetime ------------------------------------------------------------------------
    async def start(self, app) -> None:
        self.session = backend_session(self.settings.timeout_s)
        self._tasks.append(asyncio.create_task(self._watch()))
        if self.settings.balance:
            self._tasks.append(asyncio.create_task(self._balance()))

    async def stop(self, app) -> None:
        for task in [*self._tasks, *self._describing]:
            task.cancel()
        if self.session is not None:
            await self.session.close()
        for inst in self.instances:
            if inst.control is not None:
                inst.control.close()
        self.checks.shutdown(wait=False)

    # ---- choosing ------------------------------------------------------------------------
    def _candidates(self, exclude=()) -> List[Instance]:
        live_ = [i for i in self.instances if i.healthy and not i.draining and i not in exclude]
        if not live_:  # every instance marked down: try them all rather than refuse
            live_ = [i for i in self.instances if not i.draining and i not in exclude]
        start = next(self._next) % max(len(live_), 1)
        order = live_[start:] + live_[:start]
        if self.settings.policy == "least_loaded":
            order.sort(key=lambda i: i.load)
        return order

    # ---- client routes -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        body = {i.url: i.healthy for i in self.instances}
        return web.json_response(body, status=200 if any(body.values()) else 503)

    async def models(self, request: web.Request) -> web.Response:
        return await first_models(self.session, [i.url for i in self._candidates()], "instance", logger,
                                  headers=client_auth(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except (UnicodeDecodeError, ValueError) as e:
            return error(400, f"the request body is not valid JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "BadRequestError")
        body.pop("kv_transfer_params", None)  # a client's own never reach an instance
        reason = legs.not_migratable(body, chat)
        if reason is not None:
            logger.info("a request that cannot move (%s): relayed as is", reason)
            return await self._relay(request, body, reason)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(16)
        opts = body.get("stream_options") or {}
        client = ClientStream(rid, chat, str(body.get("model", "")), bool(body.get("return_token_ids")),
                              want_usage=not body.get("stream") or bool(opts.get("include_usage")),
                              stops=openai.stop_strings(body),
                              include_stop=bool(body.get("include_stop_str_in_output")),
                              min_tokens=body.get("min_tokens") or 0)
        routed = Routed(rid, body, chat, client, client_auth(request))  # one that cannot move is relayed
        self.requests[rid] = routed
        try:
            return await self._serve(request, routed)
        finally:
            self.requests.pop(rid, None)
            routed.close()  # a migration in flight notices (driver.finished) and ends on its own

    async def _relay(self, request: web.Request, body: Dict[str, Any], reason: str) -> web.StreamResponse:
        """A request that cannot move: relayed as is (listed by GET /requests with `reason`)."""
        for inst in self._candidates():
            key = "relay-" + secrets.token_hex(8)
            relayed = inst.requests[key] = self.relayed[key] = Relayed(key, inst, reason)
            out = None
            try:
                async with await self._answer(inst, self.session.post(inst.url + request.path, json=body,
                                                                      headers=client_auth(request))) as r:
                    leg = relayed.leg = Leg(r, inst)
                    if not body.get("stream") or r.status != 200:
                        return web.Response(status=r.status, body=await _unless_client_leaves(request, r.read()),
                                            content_type=r.content_type or "application/json")
                    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                                  "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    async for chunk in r.content.iter_any():
                        leg.heard_at = time.monotonic()
                        await self._write(out, chunk)
                    await out.write_eof()
                    return out
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                if out is not None:
                    return out
                self._mark_down(inst, e)
            finally:
                inst.requests.pop(key, None)
                self.relayed.pop(key, None)
        return error(503, "no instance is reachable", "ServiceUnavailableError")

    async def _serve(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        # the first leg: the first instance that answers
        first_error = None
        for inst in self._candidates():
            try:
                await self._open(routed, inst, inst.url + request.path,
                                 legs.first_leg_body(routed.body, {"migration_id": routed.mid}))
                routed.limit.began_on(inst)
                break
            except _LegFailed as e:
                first_error = e
            except _Refused as e:  # the instance refused the request (a bad request): its answer, as is
                return web.Response(status=e.status, body=e.body, content_type=e.content_type.split(";")[0])
        else:
            return error(503, f"no instance is reachable ({first_error})", "ServiceUnavailableError")

        out = None
        if routed.body.get("stream"):
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache"})
            await out.prepare(request)
        try:
            if out is not None:
                await self._run(routed, out)
            else:  # nothing is written to the client until the end: its leaving is looked for
                await _unless_client_leaves(request, self._run(routed, out))
        except _LegFailed as e:
            logger.warning("request %s failed: %s", routed.rid, e)
            if out is None:
                return error(502, f"the request failed: {e}", "BadGatewayError")
            event = {"error": {"message": f"the request failed: {e}", "type": "BadGatewayError", "param": None,
                               "code": 502}}
            await self._write(out, b"data: " + json.dumps(event).encode() + b"\n\n")
            await self._write(out, b"data: [DONE]\n\n")
            return out
        if out is None:
            return web.json_response(routed.client.answer())
        await self._write(out, routed.client.end())
        await out.write_eof()
        return out

    async def _write(self, out, data: bytes) -> None:
        """To the client: one that takes nothing for the timeout setting is gone (the stream's
        pump, and so a migration's stop, never waits on it longer)."""
        if out is not None and data:
            try:
                await _within(out.write(data), self.settings.timeout_s)
            except asyncio.TimeoutError as e:
                raise _ClientGone(f"the client took nothing for {self.settings.timeout_s:g} s") from e
            except (ConnectionError, RuntimeError) as e:
                raise _ClientGone(str(e)) from e

    # ---- legs ----------------------------------------------------------------------------
    async def _open(self, routed: Routed, inst: Instance, url: str, body: Dict[str, Any],
                    first_token: bool = False) -> None:
        """Starts a leg on `inst`: _LegFailed when unreachable or failing, _Refused carrying the
        instance's answer when it refuses the request. `first_token`: return only once the
        leg's first data line arrived (a resumed leg: its KV load is then done)."""
        try:
            r = await self._answer(inst, self.session.post(url, json=body, headers=routed.headers))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._mark_down(inst, e)
            raise _LegFailed(f"{inst.url}: {type(e).__name__}: {e}") from e
        if r.status != 200:
            raw = await r.read()
            r.release()
            if r.status >= 500:
                raise _LegFailed(f"{inst.url} answered {r.status}: {raw[:300]!r}")
            raise _Refused(r.status, raw, r.content_type)
        pushback: List[bytes] = []

        async def first_event():
            while True:
                line = await r.content.readline()
                if not line:
                    raise _LegFailed(f"{inst.url}: the stream ended before its first token")
                pushback.append(line)
                if line.startswith(b"data:"):
                    return

        if first_token:
            try:
                await self._answer(inst, first_event())
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                r.close()
                self._mark_down(inst, e)
                raise _LegFailed(f"{inst.url}: {type(e).__name__}: {e}") from e
            except _LegFailed:
                r.close()
                raise
        routed.take(Leg(r, inst, pushback))

    def _full(self, inst: Instance) -> Optional[str]:
        """Why no migration may go to `inst` now (None: it may), from the last /metrics poll:
        a request that has to wait for blocks there would make the moved one wait too."""
        max_kv_usage = self.settings.max_destination_kv_usage
        usage, waiting = inst.metrics.get("kv_cache_usage_perc", 0.0), inst.metrics.get("num_requests_waiting", 0.0)
        if waiting > 0:
            return f"it queues {waiting:g} requests"
        if usage >= max_kv_usage:
            return f"its KV cache is {100 * usage:.0f}% used (a migration goes where it is under " \
                   f"{100 * max_kv_usage:.0f}%)"
        return None

    async def _run(self, routed: Routed, out) -> None:
        """Relays legs until the request ends (migrations and recoveries between them)."""
        while True:
            ended = await self._pump(routed, out)
            if routed.client.finished:
                routed.drop()  # a leg resumed meanwhile: its instance is still generating
                return
            task = routed.migration
            if ended == "stopped" and task is not None:
                # it resumes the request elsewhere, or fails to; the destination's tokens flow
                # as soon as it resumed (the migration's end on the source is not waited for)
                resumed = asyncio.ensure_future(routed.resumed.wait())
                try:
                    await asyncio.wait({task, resumed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    resumed.cancel()
                if task.cancelled():
                    raise asyncio.CancelledError()
                if routed.leg is not None:
                    continue
            # the leg broke (its instance is avoided), or a migration failed after the stop (its
            # source, which is fine, is tried first): recompute there
            await self._recover(routed, prefer_source=ended == "stopped")

    async def _pump(self, routed: Routed, out) -> str:
        """Relays the current leg: "ended" (its stream ended), "stopped" (closed for a
        migration) or "broken"."""
        leg = routed.leg
        inst, response = leg.instance, leg.response
        lines, leg.pushback = leg.pushback, []
        while True:
            if leg.stopping:
                response.close()  # the instance aborts the request (its blocks stay under the final lease)
                routed.let_go(leg, stopped=True)
                return "stopped"
            if not lines:
                # the loop's other work (other streams, migrations, the admin API) runs between
                # events: a read from a buffer that holds the next event returns without yielding,
                # so a stream arriving faster than it is relayed would hold the loop to its end
                await asyncio.sleep(0)
                try:  # one event ("data: ...\n\n") at a time; a stop wakes it up (Leg.stop)
                    event = await response.content.readuntil(b"\n\n", **_EVENT_READ)
                except StopLeg:
                    continue
                except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, asyncio.TimeoutError,
                        ConnectionError) as e:
                    response.close()  # its connection goes (aiohttp would keep it, unclosed)
                    self._mark_down(inst, e)
                    routed.let_go(leg, stopped=False)
                    return "broken"
                if not event:  # EOF
                    response.release()
                    routed.let_go(leg, stopped=False)
                    return "ended"
                leg.heard_at = time.monotonic()
                lines = event.split(b"\n")
            line = lines.pop(0).strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                piece = openai.parse_chunk(json.loads(data))
            except ValueError as e:
                logger.warning("request %s: %s sent a bad chunk: %s", routed.rid, inst.url, e)
                response.close()
                routed.let_go(leg, stopped=False)
                return "broken"
            if piece.reasoning and routed.pinned is None:
                routed.pinned = REASONING_PINS
                logger.info("request %s: %s", routed.rid, REASONING_PINS)
            if piece.prompt_token_ids is not None and routed.client.prompt_token_ids is None:
                routed.client.prompt_token_ids = list(piece.prompt_token_ids)
                await self._write(out, routed.client.start())
            await self._write(out, routed.client.add(piece))
            if routed.client.finished:
                response.close()
                routed.let_go(leg, stopped=False)
                return "ended"
            if piece.token_ids:
                leg.relayed_token()

    async def _recover(self, routed: Routed, prefer_source: bool = False) -> None:
        """The request's leg is gone (instance dead, stream broken, migration failed after the
        stop): it continues elsewhere, recomputed from the tokens the client got; one whose client
        got nothing yet is sent again as it came. `prefer_source`: its instance first, unless
        that one is draining."""
        routed.recoveries += 1
        if routed.recoveries > len(self.instances) + 1:
            raise _LegFailed("no instance could continue it")
        client = routed.client
        again = client.prompt_token_ids is None and not client.token_ids and not client.text
        if client.prompt_token_ids is None and not again:
            raise _LegFailed("the instance failed before the prompt's token ids reached the router")
        prev = routed.instance
        others = self._candidates(exclude=(prev,))
        others += [i for i in self.instances if i.draining and i.healthy and i is not prev and i not in others]
        source = [prev] if prev is not None and prev.healthy else []
        order = source + others if prefer_source and source and not prev.draining else others + source
        for inst in order:
            routed.mid = live.new_migration_id()
            if again:
                url = inst.url + ("/v1/chat/completions" if routed.chat else "/v1/completions")
                body = legs.first_leg_body(routed.body, {"migration_id": routed.mid})
            else:
                url = inst.url + "/v1/completions"
                body = legs.resume_leg_body(routed.body, routed.limit.value(), routed.tokens(), len(client.token_ids),
                                               {"migration_id": routed.mid}, inst.max_model_len(routed.body))
            try:
                await self._open(routed, inst, url, body, first_token=not again)
                if again:
                    routed.limit.began_on(inst)
                    logger.info("request %s: sent again to %s (its instance failed before its first token)",
                                routed.rid, inst.url)
                else:
                    logger.info("request %s: continues on %s, recomputed from %d tokens", routed.rid, inst.url,
                                len(routed.tokens()))
                return
            except (_LegFailed, _Refused) as e:
                logger.warning("request %s: %s cannot continue it: %s", routed.rid, inst.url, e)
        raise _LegFailed("no instance could continue it")

    async def _answer(self, inst: Instance, request):
        """Awaits `request` (an answer of `inst`); _Silent once _cut_silent gives up on it."""
        task = asyncio.ensure_future(request)
        cut = asyncio.get_running_loop().create_future()
        inst.waits[cut] = time.monotonic()
        try:
            await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise _Silent(inst.url, self.settings.silent_s)
            return task.result()
        finally:
            inst.waits.pop(cut, None)
            if not task.done():
                task.cancel()

    def _mark_down(self, inst: Instance, e: BaseException) -> None:
        if inst.healthy:
            logger.warning("instance %s is down (%s: %s)", inst.url, type(e).__name__, e)
        inst.healthy = False
        inst.described = inst.models = None  # it may come back with another configuration
        inst.downs += 1
        inst.describe_after = 0.0

    async def _describe(self, inst: Instance) -> Optional[messages.LeaseDescribeReply]:
        """`inst`'s lease channel's describe (None when it cannot say); kept until it is down."""
        if inst.described is None and inst.control is not None:
            inst.describe_after = time.monotonic() + DESCRIBE_RETRY_S
            downs = inst.downs
            try:
                described = await asyncio.get_running_loop().run_in_executor(None, inst.control.describe)
            except (ChannelError, ValueError, OSError, RuntimeError) as e:
                logger.info("instance %s: no describe (%s)", inst.url, e)
                return None
            if inst.downs == downs:  # else it was marked down meanwhile: not its configuration now
                inst.described = described
        return inst.described

    async def _sampler(self, inst: Instance) -> str:
        """How `inst` draws seeded requests' numbers ("" when it cannot say)."""
        described = await self._describe(inst)
        return described.sampler if described is not None else ""

    # ---- migration -----------------------------------------------------------------------
    def start_migration(self, routed: Routed, dst: Instance, stages: Optional[int] = None,
                        recompute: bool = False) -> asyncio.Task:
        """Starts moving `routed` to `dst` (ValueError when it cannot move now); `stages`: at
        most this many pre-copy stages (default: the max_stages setting; 0: stop and copy)."""
        src = routed.instance
        if routed.migration is not None:
            raise ValueError(f"request {routed.rid} is moving already")
        if routed.pinned:
            raise ValueError(f"request {routed.rid} cannot move: {routed.pinned}")
        if src is None or routed.leg is None or routed.client.prompt_token_ids is None:
            raise ValueError(f"request {routed.rid} has not started yet")
        if src is dst:
            raise ValueError(f"request {routed.rid} runs on {dst.url} already")
        if src.control is None:
            raise ValueError(f"instance {src.url} has no lease channel (--lease): its requests cannot move")
        full = self._full(dst)
        if full is not None:
            raise ValueError(f"to: {dst.url} takes no migration now: {full}")
        record = live.Record(routed.mid, routed.rid, src.url, dst.url)
        driver = _Driver(self, routed)
        routed.resumed.clear()
        src.migrating_out += 1
        dst.migrating_in += 1

        async def run():
            try:
                await live.migrate(record, src.control, driver,
                                   max_stages=self.settings.max_stages if stages is None else stages,
                                   last_stage_max_blocks=self.settings.last_stage_max_blocks,
                                   next_migration_id=driver.next_mid, recompute=recompute)
            except asyncio.CancelledError:
                record.outcome, record.reason = live.Outcome.FAILED, "cancelled (the client left)"
                raise
            except Exception as e:  # noqa: BLE001 - a bug must not take the request with it
                logger.exception("migration %s of %s failed", record.migration_id[:8], routed.rid)
                record.outcome, record.reason = live.Outcome.FAILED, f"{type(e).__name__}: {e}"
                driver.abandon()
            finally:
                if driver.late_stop:
                    record.outcome, record.reason = live.Outcome.FAILED, driver.late_stop
                if routed.gone:  # resumed for a client that left meanwhile
                    routed.drop()
                src.migrating_out -= 1
                dst.migrating_in -= 1
                routed.migrations.append(record)
                routed.migration = None
                self.history.append(dict(record.as_dict()))
                del self.history[:-1000]
                logger.info("migration %s: %s %s -> %s: %s %s", record.migration_id[:8], routed.rid, src.url,
                            dst.url, record.outcome.value if record.outcome else "?", record.reason)
            return record

        routed.migration = asyncio.create_task(run())
        return routed.migration

    def _pick(self, inst: Instance) -> Optional[Routed]:
        """The request the balancer moves off `inst`: the shortest running (fewest tokens
        generated) of those that may move."""
        best = None
        for routed in inst.requests.values():
            if not isinstance(routed, Routed) or routed.migration is not None or routed.leg is None \
                    or routed.pinned:
                continue
            if (routed.client.prompt_token_ids is None
                    or len(routed.migrations) >= self.settings.max_migrations_per_request):
                continue
            limit = routed.limit.value()
            if limit is not None and limit - len(routed.client.token_ids) < self.settings.min_remaining_tokens:
                continue
            if best is None or len(routed.client.token_ids) < len(best.client.token_ids):
                best = routed
        return best

    async def _balance(self) -> None:
        """Llumnix-style: from the most to the least loaded instance when their loads differ by
        balance_threshold or more; one migration in and one out per instance at a time."""
        while True:
            await asyncio.sleep(self.settings.balance_interval_s)
            pool = [i for i in self.instances if i.healthy and not i.draining]
            if len(pool) < 2:
                continue
            src = max(pool, key=lambda i: i.load)
            room = [i for i in pool if self._full(i) is None]
            if not room:
                continue
            dst = min(room, key=lambda i: i.load)
            if src.load - dst.load < self.settings.balance_threshold or src.control is None:
                continue
            if src.migrating_out or src.migrating_in or dst.migrating_in or dst.migrating_out:
                continue
            routed = self._pick(src)
            if routed is not None:
                try:
                    self.start_migration(routed, dst)
                except ValueError as e:
                    logger.debug("balancer: %s", e)

    async def _watch(self) -> None:
        """Health and load of every instance (its /metrics); streams of a silent one are cut."""
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        poll = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
        while True:
            for inst in self.instances:
                began = time.monotonic()
                try:
                    async with self.session.get(inst.url + "/metrics", timeout=poll) as r:
                        text = await r.text()
                    metrics = {}
                    for line in text.splitlines():
                        for name in names:
                            if line.startswith(name + "{") or line.startswith(name + " "):
                                metrics[name.split(":")[1]] = metrics.get(name.split(":")[1], 0.0) + float(
                                    line.rsplit(" ", 1)[1])
                    inst.metrics = metrics
                    if inst.models is None:  # what a resumed leg of a request without a limit may ask
                        async with self.session.get(inst.url + "/v1/models", timeout=poll,
                                                    headers=self._own_auth) as r:
                            inst.models = await r.json() if r.status == 200 else None
                    if inst.described is None and began >= inst.describe_after:  # its requests' limits,
                        # asked aside: a slow lease channel holds no poll
                        task = asyncio.ensure_future(self._describe(inst))
                        self._describing.add(task)
                        task.add_done_callback(self._describing.discard)
                    if not inst.healthy:
                        logger.info("instance %s is back", inst.url)
                    inst.healthy, inst.failed_polls, inst.silent_since = True, 0, None
                except aiohttp.ClientConnectorError as e:  # nothing listens: down now
                    inst.silent_since = inst.silent_since or began
                    self._mark_down(inst, e)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    inst.silent_since = inst.silent_since or began
                    inst.failed_polls += 1  # slow (a busy host): down only after three in a row
                    if inst.failed_polls >= 3:
                        self._mark_down(inst, e)
                self._cut_silent(inst)
            await asyncio.sleep(self.settings.health_interval_s)

    def _cut_silent(self, inst: Instance) -> None:
        """Once `inst` has answered no poll for silent_s (a partition that sends no FIN or RST),
        breaks each of its streams that sent nothing as long, and each wait for its answer that
        lasted as long: a movable request continues elsewhere, a relayed one ends (or, before its
        answer began, is sent elsewhere)."""
        now = time.monotonic()
        if inst.silent_since is None or now - inst.silent_since < self.settings.silent_s:
            return
        for cut, began in list(inst.waits.items()):
            if now - began >= self.settings.silent_s and not cut.done():
                logger.warning("%s answered nothing for %.0f s and answers no poll: the wait is cut", inst.url,
                               now - began)
                cut.set_result(None)
        for key, request in list(inst.requests.items()):
            leg = request.watched()  # a migration has deadlines of its own
            if leg is not None and now - leg.heard_at >= self.settings.silent_s \
                    and leg.cut(_Silent(inst.url, self.settings.silent_s)):
                logger.warning("request %s: %s sent nothing for %.0f s and answers no poll: its stream is cut",
                               key, inst.url, now - leg.heard_at)

    # ---- admin routes --------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> Optional[web.Response]:
        if self._token is None:
            return error(403, f"the admin API is off: set {ENV_TOKEN} on the router", "PermissionDenied")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            return error(401, "the admin API needs Authorization: Bearer <token>", "Unauthorized")
        return None

    async def admin_instances(self, request: web.Request) -> web.Response:
        return self._authorized(request) or web.json_response([i.describe() for i in self.instances])

    async def admin_requests(self, request: web.Request) -> web.Response:
        return self._authorized(request) or web.json_response(
            {"running": [r.describe() for r in [*self.requests.values(), *self.relayed.values()]],
             "migrations": self.history[-100:]})

    async def _admin_body(self, request: web.Request, fields):
        try:
            body = await request.json()
        except (UnicodeDecodeError, ValueError):
            body = None
        if not isinstance(body, dict) or any(not isinstance(body.get(f), str) for f in fields):
            raise _Refused(400, json.dumps({"error": {"message": f"expected a JSON object with {', '.join(fields)}",
                                                      "type": "BadRequestError", "code": 400}}).encode(), "")
        return body

    def _instance(self, url: str) -> Instance:
        inst = self._by_url.get(url.rstrip("/"))
        if inst is None:
            raise _Refused(404, json.dumps({"error": {"message": f"no instance {url!r}", "type": "NotFoundError",
                                                      "code": 404}}).encode(), "")
        return inst

    async def admin_migrate(self, request: web.Request) -> web.Response:
        """POST /migrate {"request_id", optional "to", "stages", "recompute"}: moves one
        request (by default to the least loaded other instance); answers when it is done, with
        the migration's record. One migration out of and one into each instance at a time (409)."""
        denied = self._authorized(request)
        if denied:
            return denied
        body = await self._admin_body(request, ("request_id",))
        routed = self.requests.get(body["request_id"])
        if routed is None:
            return error(404, f"no running request {body['request_id']!r}", "NotFoundError")
        src = routed.instance
        if src is not None and src.migrating_out:
            return error(409, f"request {routed.rid}: its instance {src.url} has a migration out already (one at "
                              "a time: try again once it ended)", "ConflictError")
        if body.get("to") is not None:
            dst = self._instance(str(body["to"]))
            if not dst.healthy or dst.draining:
                return error(409, f"to: {dst.url} is {'draining' if dst.healthy else 'down'}", "ConflictError")
        else:
            targets = [i for i in self._candidates(exclude=(src,))
                       if i.healthy and self._full(i) is None]
            if not targets:
                targets = self._candidates(exclude=(src,))  # none known healthy: try the others
            if not targets:
                return error(409, "no other healthy instance to move it to", "ConflictError")
            dst = min(targets, key=lambda i: (i.migrating_in > 0, i.load))
        if dst.migrating_in:
            return error(409, f"to: {dst.url} has a migration in already (one at a time: try again once it ended)",
                         "ConflictError")
        stages = body.get("stages")
        if stages is not None and (type(stages) is not int or not 0 <= stages <= MAX_STAGES_LIMIT):
            return error(400, f"stages: expected an integer in [0, {MAX_STAGES_LIMIT}], got {stages!r}",
                         "BadRequestError")
        try:
            task = self.start_migration(routed, dst, stages, recompute=bool(body.get("recompute")))
        except ValueError as e:
            return error(409, str(e), "ConflictError")
        record = await asyncio.shield(task)
        return web.json_response(record.as_dict())

    async def admin_drain(self, request: web.Request) -> web.Response:
        """POST /drain {"instance", optional "timeout_s"}: no new requests go there; its running
        requests move to the others (one at a time, each to the least loaded instance that has no
        migration coming in); those that cannot move finish in place.
        Answers when it is empty, or with what is left after timeout_s (0: only marks it)."""
        denied = self._authorized(request)
        if denied:
            return denied
        body = await self._admin_body(request, ("instance",))
        timeout_s = body.get("timeout_s", self.settings.timeout_s)
        if type(timeout_s) not in (int, float) or not 0 <= timeout_s <= 86400:
            return error(400, f"timeout_s: expected a number of seconds in [0, 86400], got {timeout_s!r}",
                         "BadRequestError")
        inst = self._instance(body["instance"])
        inst.draining = True
        moved, stayed = [], set()
        deadline = time.monotonic() + timeout_s
        while inst.requests and inst.draining and time.monotonic() < deadline:
            candidates = [r for r in inst.requests.values()
                          if r is not None and r.migration is None and r.leg is not None and not r.pinned
                          and r.client.prompt_token_ids is not None and r.rid not in stayed]
            # one migration in per destination and out of this instance at a time, as the balancer
            # and /migrate: a busy one (a /migrate of one of its requests) is waited for
            targets = [i for i in self._candidates(exclude=(inst,)) if i.healthy and not i.migrating_in
                       and self._full(i) is None]
            if not candidates or not targets or inst.migrating_out:
                await asyncio.sleep(0.05)
                continue
            routed = candidates[0]
            try:
                record = await asyncio.shield(self.start_migration(routed, min(targets, key=lambda i: i.load)))
                moved.append(record.as_dict())
                if record.outcome not in (live.Outcome.MOVED, live.Outcome.RECOMPUTED):  # not tried again:
                    stayed.add(routed.rid)  # one that ended leaves by itself, a failed one went elsewhere
            except ValueError:
                stayed.add(routed.rid)
        if not inst.draining:  # /undrain came meanwhile
            return web.json_response({"instance": inst.url, "migrations": moved, "left": sorted(inst.requests),
                                      "undrained": True}, status=409)
        return web.json_response({"instance": inst.url, "migrations": moved, "left": sorted(inst.requests)},
                                 status=200 if not inst.requests else 504)

    async def admin_undrain(self, request: web.Request) -> web.Response:
        denied = self._authorized(request)
        if denied:
            return denied
        body = await self._admin_body(request, ("instance",))
        inst = self._instance(body["instance"])
        inst.draining = False
        return web.json_response(inst.describe())


class _Refused(Exception):
    """An instance's (or the admin API's) refusal, relayed with its status."""

    def __init__(self, status: int, body: bytes, content_type: Optional[str]):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body, self.content_type = status, body, content_type or "application/json"


async def _unless_client_leaves(request: web.Request, awaitable):
    """`awaitable`, for a client that waits for a whole answer (nothing is written to it
    meanwhile): cancelled, and _ClientGone, once the client's connection closes (a leg then
    closes, and its instance aborts the request, as vLLM does for a client of its own)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CLIENT_CHECK_S)
            if done:
                return task.result()
            if request.transport is None or request.transport.is_closing():
                raise _ClientGone("the client closed its connection before its answer")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


async def _within(awaitable, seconds: float):
    """`awaitable` with a deadline (asyncio.TimeoutError), without a task of its own where the
    Python has asyncio.timeout (one write per token)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class _ClientGone(Exception):
    """The client closed its connection."""


class _Driver:
    """live.Driver over one routed request."""

    def __init__(self, router: Router, routed: Routed):
        self.router, self.routed = router, routed
        self.next_mid = live.new_migration_id()
        # The KV this migration moves is cached on the destination under a salt of its own, so
        # that no other request reads it: after a failed resume vLLM's recompute policy leaves
        # the blocks in its prefix cache with whatever they hold (it recomputes them in place,
        # and the router has dropped that leg first), and only this migration's requests (its
        # pre-copies and its resume) could hit them.
        self.cache_salt = secrets.token_hex(16)
        self.resume_sent_s = self.resume_first_s = 0.0  # time.time(): the resume's request, its first token
        self.check_s: Optional[float] = None  # the first token's wait for the trace (a resume that loaded KV)
        self.trace: Optional[messages.MigrateTraceReply] = None  # the destination's, of a resume that loaded KV
        self.late_stop: Optional[str] = None  # why the stop was given up
        self._stopping: Optional[Leg] = None  # the leg it stopped

    def finished(self) -> bool:
        return self.routed.client.finished or self.routed.gone

    async def refuse(self, destination: str) -> Optional[str]:
        """A request moves only where its output limit holds (the destination caps none of what is
        left of it below it), and a seeded one only where its random stream goes on: both
        instances draw the same way (vllm_ext/connector/sampling.py). Asked again before the
        stop: a request pinned meanwhile stays."""
        if self.routed.pinned:
            return self.routed.pinned
        described = await self.router._describe(self.router._by_url[destination])
        cap = described.max_tokens_cap if described is not None else 0
        limit = self.routed.limit.value()
        left = None if limit is None else limit - len(self.routed.client.token_ids)
        if cap and (left is None or left > cap):
            return (f"the destination caps a request's output at {cap} tokens (its generation config), "
                    f"this one has {'no limit' if left is None else f'{left} tokens'} left")
        if not legs.seeded_random(self.routed.body) or self.routed.instance is None:
            return None
        source = await self.router._sampler(self.routed.instance)
        there = await self.router._sampler(self.router._by_url[destination])
        if not source or source != there:
            return (f"a seeded request's random stream would not go on there: the source samples by "
                    f"{source or 'an unknown way'!r}, the destination by {there or 'an unknown way'!r}")
        return None

    def tokens(self) -> List[int]:
        return self.routed.tokens()

    def last_token_at(self) -> Optional[float]:
        return self.routed.client.last_token_at

    async def load(self, destination: str, token_ids: List[int], params: Dict[str, Any]) -> bool:
        inst = self.router._by_url[destination]
        body = {"model": self.routed.body.get("model"), "prompt": token_ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": params, "cache_salt": self.cache_salt}
        try:
            async with await self.router._answer(inst, self.router.session.post(
                    inst.url + "/v1/completions", json=body, headers=self.routed.headers)) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("migration of %s: pre-copy to %s failed: %s", self.routed.rid, destination, e)
            return False

    async def stop(self) -> bool:
        """Right after the source's next token reaches the client, so that the client's wait
        starts at the stop; at once when that token is late (twice the last gap between tokens,
        at most STOP_WAIT_MAX_S)."""
        leg = self.routed.leg
        if leg is None or self.routed.client.finished:
            return False
        self._stopping = leg
        gap = self.routed.client.last_gap_s
        # the pump stops at its next step: at once, or after a write to a slow client (at most the
        # timeout setting, then the client is gone)
        wait_s = self.router.settings.timeout_s + STOP_WAIT_MAX_S
        try:
            return await leg.stop(None if gap is None else min(2 * gap, STOP_WAIT_MAX_S), wait_s)
        except asyncio.TimeoutError:  # the pump stops it later, and the request is recomputed where it was
            self.late_stop = f"the stream did not stop within {wait_s:g} s"
            return False

    def abandon(self) -> None:
        """The migration failed (a bug): a stop it asked for waits no more."""
        if self._stopping is not None:
            self._stopping.done(False)

    async def resume(self, destination: str, params: Optional[Dict[str, Any]]) -> bool:
        """A resume that loaded KV is trusted only once the destination's trace says its load did
        not fail under a step already in flight (vLLM then recomputes the blocks, but may have sent
        a token computed on them): such a leg is dropped before its first token is relayed. That
        trace is asked for with the resume and usually answers before the first token arrives."""
        routed = self.routed
        source, inst = routed.instance, self.router._by_url[destination]
        body = legs.resume_leg_body(routed.body, routed.limit.value(), routed.tokens(),
                                       len(routed.client.token_ids), params, inst.max_model_len(routed.body))
        checked = params is not None and "remote_lease" in params  # it loads KV, vouched for by the trace
        if checked:  # under the salt of the pre-copies' blocks (a recompute reads the prefix cache as any request)
            body["cache_salt"] = self.cache_salt
        early = None
        if checked and inst.control is not None:
            early = asyncio.get_running_loop().run_in_executor(self.router.checks, inst.control.settled_trace,
                                                               self.next_mid, RESUME_CHECK_WAIT_S)
            early.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is only looked at below
        self.resume_sent_s = time.time()
        try:
            await self.router._open(routed, inst, inst.url + "/v1/completions", body, first_token=True)
        except (_LegFailed, _Refused) as e:
            logger.warning("migration of %s: %s did not resume it: %s", routed.rid, destination, e)
            return False
        self.resume_first_s = time.time()
        if checked:
            self.trace = await self._load_check(inst, early)
            self.check_s = time.time() - self.resume_first_s
            why = None
            if self.trace is None or not self.trace.settled:  # unknown is not safe
                why = "did not say whether its load of the KV failed (no trace)"
            elif self.trace.unsafe:
                why = "failed to load its KV with its next step in flight (its first tokens may be wrong)"
            if why is not None:
                logger.warning("migration of %s: %s %s: dropped, recomputed", routed.rid, destination, why)
                routed.drop()  # vLLM aborts it there
                routed.place(source)  # recomputed at the source first: its prefix cache holds the KV
                return False
        routed.mid = self.next_mid
        routed.resumed.set()
        return True

    def load_failed(self) -> bool:
        return self.trace is not None and self.trace.load_failed

    async def _load_check(self, inst: Instance, early) -> Optional[messages.MigrateTraceReply]:
        """The trace that vouches for the resume's load, at its first token: the one asked with
        the resume when it is in and settled (the load's step reports before its token leaves
        the destination), else one asked now (settled by then)."""
        if early is not None and early.done() and not early.cancelled() and early.exception() is None \
                and early.result().settled:
            return early.result()
        return await self._trace(inst)

    async def _trace(self, inst: Instance) -> Optional[messages.MigrateTraceReply]:
        if inst.control is None:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, inst.control.trace, self.next_mid)
        except (ChannelError, ValueError) as e:  # a diagnostic: the migration's outcome stands
            logger.info("migration of %s: no trace from %s: %s", self.routed.rid, inst.url, e)
            return None

    async def resume_trace(self, destination: str) -> Optional[Dict[str, float]]:
        if not self.resume_first_s:
            return None
        trace = self.trace or await self._trace(self.router._by_url[destination])
        if trace is None:
            return None
        return live.resume_spans(self.resume_sent_s, trace, self.resume_first_s, self.check_s)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except _Refused as e:
        return web.Response(status=e.status, body=e.body, content_type=e.content_type.split(";")[0])
    except _ClientGone:
        return web.Response(status=499)


def build_app(urls: List[str], leases: Optional[List[Optional[str]]] = None,
              settings: Optional[Settings] = None) -> web.Application:
    settings = settings or Settings()
    router = Router(urls, leases, settings)
    app = openai_app(router, middlewares=[_errors])
    app.router.add_get("/instances", router.admin_instances)
    app.router.add_get("/requests", router.admin_requests)
    app.router.add_post("/migrate", router.admin_migrate)
    app.router.add_post("/drain", router.admin_drain)
    app.router.add_post("/undrain", router.admin_undrain)
    return app
