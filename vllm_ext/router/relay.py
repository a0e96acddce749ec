"""How the router relays a request: it opens a leg on an instance, pumps the leg's events to the
client through its ClientStream (openai.py), and when a leg ends before the answer (its instance
died, its stream broke, a migration failed after the stop) recovers the request elsewhere from
the tokens the client got. A request that cannot move is relayed as is. A migration's switch
happens between two legs (driver.py); the pump only stops when asked (state.Leg.stop)."""

import asyncio
import inspect
import json
import logging
import secrets
import time
from typing import Any, Dict, List, Optional

import aiohttp
from aiohttp import web

from . import legs, live, openai
from .http import (
    ClientGone,
    Refused,
    TooLarge,
    busy,
    client_auth,
    error,
    local_limit,
    read_bounded,
    scrub_answer,
    unless_client_leaves,
)
from .state import Instance, Leg, Relayed, Routed, StopLeg

__all__ = ["ClientGone", "LegFailed", "Relay", "unless_client_leaves"]

logger = logging.getLogger("vllm_ext.router")

# One event of a backend's stream may be large (the first carries the prompt's token ids): read
# up to the max_event_bytes setting per event where aiohttp takes a bound (its default is 128 KiB).
_BOUNDED_READ = "max_size" in inspect.signature(aiohttp.StreamReader.readuntil).parameters
# A chat stream whose instance splits reasoning off its content (--reasoning-parser) stays there:
# a resumed leg is a completion, whose text nothing would split.
REASONING_PINS = "its instance splits reasoning off the content (--reasoning-parser); a resumed leg would not"


class LegFailed(Exception):
    """A backend could not be reached, or broke the stream. `public`: what the client is told
    (never an instance's address); `local`: the router ran out of something (file descriptors,
    ports), no instance failed."""

    def __init__(self, message: str, public: str = "its instance failed", local: bool = False):
        super().__init__(message)
        self.public, self.local = public, local


def asked_limit(body: Dict[str, Any], chat: bool) -> Optional[int]:
    """The output limit the client gave (None: none given), which the router enforces whatever a
    backend sends."""
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def cut_to(piece: openai.Piece, keep: int) -> bool:
    """`piece` cut to its first `keep` tokens, finishing "length": its backend sent past the
    client's limit. Its text is cut where its logprobs' tokens spell it; False (the piece left
    as it is) when it cannot be: several tokens and no such logprobs."""
    if keep < len(piece.token_ids):
        tokens = piece.logprobs.get("tokens") if isinstance(piece.logprobs, dict) else None
        if keep <= 0:
            piece.text = ""
        elif isinstance(tokens, list) and len(tokens) == len(piece.token_ids) \
                and all(isinstance(t, str) for t in tokens) and "".join(tokens) == piece.text:
            piece.text = "".join(tokens[:keep])
        elif piece.text:
            return False
        piece.token_ids = piece.token_ids[:max(keep, 0)]
        if isinstance(piece.logprobs, dict):
            piece.logprobs = {k: v[:max(keep, 0)] if isinstance(v, list) else v for k, v in piece.logprobs.items()}
    piece.finish_reason, piece.stop_reason = "length", None
    return True


class Relay:
    """Relays requests to `fleet`'s instances (fleet.py) in `placement`'s order."""

    def __init__(self, fleet, placement, settings):
        self.fleet, self.placement, self.settings = fleet, placement, settings
        self.relayed: Dict[str, Relayed] = {}  # requests that cannot move, by their key in Instance.requests

    async def serve(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        """A request that may move, from its first leg (the first instance that answers) to its
        end; the client's answer."""
        first_error = None
        for inst in self.placement.candidates():
            try:
                await self.open(routed, inst, inst.url + request.path,
                                legs.first_leg_body(routed.body, {"migration_id": routed.mid}))
                routed.limit.began_on(inst)
                break
            except LegFailed as e:
                if e.local:
                    return busy(f"the router is at a local limit ({e.public}): retry later")
                first_error = e
            except Refused as e:  # the instance refused the request (a bad request): its answer, as is
                return web.Response(status=e.status, body=e.body, content_type=e.content_type.split(";")[0])
        else:
            logger.warning("request %s: no instance is reachable (%s)", routed.rid, first_error)
            return error(503, "no instance is reachable", "ServiceUnavailableError")

        out = None
        if routed.body.get("stream"):
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache"})
            await out.prepare(request)
        try:
            if out is not None:
                await self.run(routed, out)
            else:  # nothing is written to the client until the end: its leaving is looked for
                await unless_client_leaves(request, self.run(routed, out))
        except LegFailed as e:
            logger.warning("request %s failed: %s", routed.rid, e)
            if out is None:
                return error(502, f"the request failed: {e.public}", "BadGatewayError")
            event = {"error": {"message": f"the request failed: {e.public}", "type": "BadGatewayError", "param": None,
                               "code": 502}}
            await self.write(out, b"data: " + json.dumps(event).encode() + b"\n\n")
            await self.write(out, b"data: [DONE]\n\n")
            return out
        if out is None:
            return web.json_response(routed.client.answer())
        await self.write(out, routed.client.end())
        await out.write_eof()
        return out

    async def as_is(self, request: web.Request, body: Dict[str, Any], reason: str) -> web.StreamResponse:
        """A request that cannot move: relayed as is (listed by GET /requests with `reason`)."""
        for inst in self.placement.candidates():
            key = "relay-" + secrets.token_hex(8)
            relayed = inst.requests[key] = self.relayed[key] = Relayed(key, inst, reason)
            out = None
            try:
                answer = self.fleet.session.post(inst.url + request.path, json=body, headers=client_auth(request))
                async with await self.fleet.answer(inst, answer) as r:
                    leg = relayed.leg = Leg(r, inst)
                    if not body.get("stream") or r.status != 200:
                        try:
                            raw = await unless_client_leaves(request, read_bounded(r, self.settings.max_event_bytes))
                        except TooLarge as e:
                            logger.warning("a request relayed as is: %s sent %s", inst.url, e)
                            return error(502, f"the instance's answer is too large: {e}", "BadGatewayError")
                        return web.Response(status=r.status, body=scrub_answer(raw, r.content_type),
                                            content_type=r.content_type or "application/json")
                    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                                  "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    async for chunk in r.content.iter_any():
                        leg.heard_at = time.monotonic()
                        await self.write(out, chunk)
                    await out.write_eof()
                    return out
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                if out is not None:
                    return out
                if local_limit(e) is not None:
                    return busy(f"the router is at a local limit ({local_limit(e).strerror}): retry later")
                self.fleet.mark_down(inst, e)
            finally:
                inst.requests.pop(key, None)
                self.relayed.pop(key, None)
        return error(503, "no instance is reachable", "ServiceUnavailableError")

    async def write(self, out, data: bytes, leg: Optional[Leg] = None) -> None:
        """To the client: one that takes nothing for the timeout setting is gone. While the pump
        of `leg` writes, a migration's stop need not wait for it (Leg.writing): what the client
        is given is recorded already."""
        if out is not None and data:
            if leg is not None:
                leg.writing(True)
            try:
                await _within(out.write(data), self.settings.timeout_s)
            except asyncio.TimeoutError as e:
                raise ClientGone(f"the client took nothing for {self.settings.timeout_s:g} s") from e
            except (ConnectionError, RuntimeError) as e:
                raise ClientGone(str(e)) from e
            finally:
                if leg is not None:
                    leg.writing(False)

    async def open(self, routed: Routed, inst: Instance, url: str, body: Dict[str, Any],
                   first_token: bool = False) -> None:
        """Starts a leg on `inst`: LegFailed when unreachable or failing, Refused carrying the
        instance's answer when it refuses the request. `first_token`: return only once the
        leg's first data line arrived (a resumed leg: its KV load is then done)."""
        try:
            r = await self.fleet.answer(inst, self.fleet.session.post(url, json=body, headers=routed.headers))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            limit = local_limit(e)
            if limit is not None:  # the router's own limit: no instance is marked down for it
                raise LegFailed(f"{inst.url}: {type(e).__name__}: {e}", limit.strerror or "", local=True) from e
            self.fleet.mark_down(inst, e)
            raise LegFailed(f"{inst.url}: {type(e).__name__}: {e}") from e
        if r.status != 200:
            try:
                raw = await read_bounded(r, self.settings.max_event_bytes)
            except (aiohttp.ClientError, asyncio.TimeoutError, TooLarge) as e:
                raise LegFailed(f"{inst.url} answered {r.status}, then {type(e).__name__}: {e}") from e
            finally:
                r.release()
            if r.status >= 500:
                raise LegFailed(f"{inst.url} answered {r.status}: {raw[:300]!r}")
            raise Refused(r.status, raw, r.content_type)
        pushback: List[bytes] = []
        bound = {"max_size": self.settings.max_event_bytes} if _BOUNDED_READ else {}

        async def first_event():
            while True:
                line = await r.content.readuntil(b"\n", **bound)
                if not line:
                    raise LegFailed(f"{inst.url}: the stream ended before its first token")
                pushback.append(line)
                if line.startswith(b"data:"):
                    return

        if first_token:
            try:
                await self.fleet.answer(inst, first_event())
            except aiohttp.http_exceptions.LineTooLong as e:  # not a failure of the instance's
                r.close()
                raise LegFailed(f"{inst.url}: an event of more than {self.settings.max_event_bytes} bytes") from e
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                r.close()
                self.fleet.mark_down(inst, e)
                raise LegFailed(f"{inst.url}: {type(e).__name__}: {e}") from e
            except LegFailed:
                r.close()
                raise
        routed.take(Leg(r, inst, pushback))

    async def run(self, routed: Routed, out) -> None:
        """Relays legs until the request ends (migrations and recoveries between them)."""
        while True:
            ended = await self.pump(routed, out)
            if routed.client.finished:
                routed.drop()  # a leg resumed meanwhile: its instance is still generating
                return
            task = routed.migration
            if ended == "stopped":
                if task is not None:
                    # it resumes the request elsewhere, or fails to; the destination's tokens flow
                    # as soon as it resumed (the migration's end on the source is not waited for)
                    resumed = asyncio.ensure_future(routed.resumed.wait())
                    try:
                        await asyncio.wait({task, resumed}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        resumed.cancel()
                    if task.cancelled():
                        raise asyncio.CancelledError()
                if routed.leg is not None:  # resumed (maybe while the pump still wrote to a slow client)
                    continue
            # the leg broke (its instance is avoided), or a migration failed after the stop (its
            # source, which is fine, is tried first): recompute there
            await self.recover(routed, prefer_source=ended == "stopped")

    async def pump(self, routed: Routed, out) -> str:
        """Relays the current leg: "ended" (its stream ended), "stopped" (closed for a
        migration) or "broken"."""
        leg = routed.leg
        inst, response = leg.instance, leg.response
        lines, leg.pushback = leg.pushback, []
        limit = asked_limit(routed.body, routed.chat)
        bound = {"max_size": self.settings.max_event_bytes} if _BOUNDED_READ else {}
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
                    event = await response.content.readuntil(b"\n\n", **bound)
                except StopLeg:
                    continue
                except aiohttp.http_exceptions.LineTooLong:  # the instance is not down for it
                    logger.warning("request %s: %s sent an event of more than %d bytes (max_event_bytes): its leg is "
                                   "broken", routed.rid, inst.url, self.settings.max_event_bytes)
                    response.close()
                    routed.let_go(leg, stopped=False)
                    return "broken"
                except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, asyncio.TimeoutError,
                        ConnectionError) as e:
                    response.close()  # its connection goes (aiohttp would keep it, unclosed)
                    self.fleet.mark_down(inst, e)
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
            if limit is not None and piece.token_ids and len(routed.client.token_ids) + len(piece.token_ids) >= limit \
                    and (len(routed.client.token_ids) + len(piece.token_ids) > limit or piece.finish_reason is None):
                if len(routed.client.token_ids) + len(piece.token_ids) > limit:
                    logger.warning("request %s: %s sent past the client's max_tokens (%d): cut there", routed.rid,
                                   inst.url, limit)
                if not cut_to(piece, limit - len(routed.client.token_ids)):  # its text would say more than its
                    # tokens: nothing of it is relayed, and the rest is computed elsewhere from what the client got
                    logger.warning("request %s: %s sent %d tokens in one event whose text cannot be cut at max_tokens "
                                   "(%d): its leg is broken", routed.rid, inst.url, len(piece.token_ids), limit)
                    response.close()
                    routed.let_go(leg, stopped=False)
                    return "broken"
            if piece.prompt_token_ids is not None and routed.client.prompt_token_ids is None:
                routed.client.prompt_token_ids = list(piece.prompt_token_ids)
                await self.write(out, routed.client.start(), leg)
            await self.write(out, routed.client.add(piece), leg)
            if routed.client.finished:
                response.close()
                routed.let_go(leg, stopped=False)
                return "ended"
            if piece.token_ids:
                leg.relayed_token()

    async def recover(self, routed: Routed, prefer_source: bool = False) -> None:
        """The request's leg is gone (instance dead, stream broken, migration failed after the
        stop): it continues elsewhere, recomputed from the tokens the client got; one whose client
        got nothing yet is sent again as it came. `prefer_source`: its instance first, unless
        that one is draining."""
        routed.recoveries += 1
        if routed.recoveries > len(self.fleet.instances) + 1:
            raise LegFailed("no instance could continue it")
        client = routed.client
        again = client.prompt_token_ids is None and not client.token_ids and not client.text
        if client.prompt_token_ids is None and not again:
            raise LegFailed("the instance failed before the prompt's token ids reached the router")
        for inst in self.placement.recovery_order(routed, prefer_source):
            routed.mid = live.new_migration_id()
            if again:
                url = inst.url + ("/v1/chat/completions" if routed.chat else "/v1/completions")
                body = legs.first_leg_body(routed.body, {"migration_id": routed.mid})
            else:
                url = inst.url + "/v1/completions"
                body = legs.resume_leg_body(routed.body, routed.limit.value(), routed.tokens(), len(client.token_ids),
                                            {"migration_id": routed.mid}, inst.max_model_len(routed.body), client.text)
            try:
                await self.open(routed, inst, url, body, first_token=not again)
                if again:
                    routed.limit.began_on(inst)
                    logger.info("request %s: sent again to %s (its instance failed before its first token)",
                                routed.rid, inst.url)
                else:
                    logger.info("request %s: continues on %s, recomputed from %d tokens", routed.rid, inst.url,
                                len(routed.tokens()))
                return
            except (LegFailed, Refused) as e:
                logger.warning("request %s: %s cannot continue it: %s", routed.rid, inst.url, e)
        raise LegFailed("no instance could continue it")


async def _within(awaitable, seconds: float):
    """`awaitable` with a deadline (asyncio.TimeoutError), without a task of its own where the
    Python has asyncio.timeout (one write per token)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)
