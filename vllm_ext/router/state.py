"""What the router knows of its instances and of each request it holds: Instance, Leg (one
backend stream of a request, and the stop handshake between the pump that relays it and a
migration that stops it), Routed (a request across its legs: the one owner of its current leg),
Relayed (a request relayed as is) and OutputLimit (what every leg of a request may generate)."""

import asyncio
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from ..lease import messages
from ..lease.channel import LeaseClient
from . import legs, live
from .openai import ClientStream


class Instance:
    """One vLLM instance at `url`, with its lease channel at `lease` (host:port; None: none, so
    its requests cannot move): what the fleet's polls found, and the requests it runs now."""

    def __init__(self, url: str, lease: Optional[str], secret: Optional[bytes]):
        self.url = url.rstrip("/")
        self.lease = lease
        self.control: Optional[LeaseClient] = None
        if lease:
            host, _, port = lease.rpartition(":")
            self.control = LeaseClient(secret, host, int(port))
        self.healthy = True
        self.failed_polls = 0  # consecutive /metrics polls that failed
        self.silent_since: Optional[float] = None  # monotonic: the first of them began
        self.waits: Dict[asyncio.Future, float] = {}  # the router's waits for its answers (Fleet.answer): their start
        self.draining = False
        self.requests: Dict[str, Union[Routed, Relayed]] = {}
        self.migrating_in = 0
        self.migrating_out = 0
        self.metrics: Dict[str, float] = {}
        # its lease channel's describe (seeded sampling, output limits), until it is marked down
        self.described: Optional[messages.LeaseDescribeReply] = None
        self.describe_after = 0.0  # monotonic: the poll asks again for a describe that failed after this
        self.downs = 0  # times it was marked down: a describe or a limit from before one is not its own
        self.models: Optional[Dict[str, Any]] = None  # its /v1/models answer, until it is marked down

    @property
    def load(self) -> int:
        return len(self.requests)

    def max_model_len(self, body: Dict[str, Any]) -> Optional[int]:
        """The model length it serves `body`'s model with (None: not known yet)."""
        return legs.max_model_len(self.models, body.get("model")) if self.models is not None else None

    def describe(self) -> Dict[str, Any]:
        return {"url": self.url, "lease": self.lease, "healthy": self.healthy, "draining": self.draining,
                "load": self.load, "requests": sorted(self.requests), "migrating_in": self.migrating_in,
                "migrating_out": self.migrating_out, "metrics": self.metrics}


class StopLeg(Exception):
    """Wakes a pump waiting on its leg: the router stops relaying it (a migration's switch)."""


class Leg:
    """One backend stream of a request: its `response` (aiohttp's) from `instance`, the lines
    read before the pump took it, when it last sent something, and the stop handshake: the pump
    (relay.py) relays the leg and looks at `stopping` between events; a migration asks it to stop
    (stop) and learns whether it did."""

    def __init__(self, response, instance: Instance, pushback: Optional[List[bytes]] = None):
        self.response, self.instance = response, instance
        self.pushback: List[bytes] = list(pushback or [])
        self.heard_at = time.monotonic()  # its last event (or its start)
        self._stop_now = False  # the pump closes the leg at its next chance
        self._stop_after_token = False  # the pump closes the leg once it relayed the next token
        self._stopped: Optional[asyncio.Future] = None  # True: the pump closed the leg; False: it had ended
        self._writing = False  # the pump waits for the client to take what it recorded

    # ---- the pump's side -----------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """The pump closes the leg now (stopped)."""
        return self._stop_now

    def writing(self, now: bool) -> None:
        """The pump begins (True) or ended (False) a write to the client of what the client's
        stream recorded already: a stop due meanwhile is done at once, not after the write (a
        client that stops reading holds no migration)."""
        self._writing = now
        if now and self._stop_now:
            self._stop_while_writing()

    def _stop_while_writing(self) -> None:
        self.response.close()  # the instance aborts the request (its blocks stay under the final lease)
        self.done(True)

    def relayed_token(self) -> None:
        """The pump relayed a token: a stop that waited for it is due now."""
        if self._stop_after_token:
            self._stop_now = True

    def done(self, stopped: bool) -> None:
        """The pump is done with the leg: it closed it for a stop (True), or it ended or broke
        (False); a stop waiting learns which (a late one, given up already, does not)."""
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(stopped)

    def close(self) -> None:
        """Closes the stream (its instance aborts the request); a stop waiting learns that the
        leg was not stopped."""
        self.done(False)
        self.response.close()

    def cut(self, error: Exception) -> bool:
        """Breaks the stream with `error` (a pump waiting for its next event gets it); False when
        it was broken already."""
        if self.response.content.exception() is not None:
            return False
        self.response.content.set_exception(error)
        return True

    # ---- the migration's side ------------------------------------------------------------
    async def stop(self, after_token_s: Optional[float], within_s: float) -> bool:
        """Has the pump close the leg: right after it relays the next token, or at once when that
        token is later than `after_token_s` (None: at once). True once the pump closed it; False
        when the leg ended first. asyncio.TimeoutError when the pump did not stop it within
        `within_s` more (it stops it at its next step all the same)."""
        self._stopped = asyncio.get_running_loop().create_future()
        if after_token_s is not None:
            self._stop_after_token = True
            try:
                return await asyncio.wait_for(asyncio.shield(self._stopped), after_token_s)
            except asyncio.TimeoutError:
                pass
        self._stop_now = True
        if self._writing:
            self._stop_while_writing()
        else:
            self.response.content.set_exception(StopLeg())  # a pump waiting for the next event wakes up
        return await asyncio.wait_for(asyncio.shield(self._stopped), within_s)


class OutputLimit:
    """The output limit a request's first leg had, which every later leg carries: the client's
    until the instance of its first leg has described itself, then the one that instance's
    OpenAI server derives (legs.output_limit with its generation-config default and cap),
    unless that instance was marked down since the leg began (it may have come back with another
    configuration: the client's stays)."""

    def __init__(self, body: Dict[str, Any], chat: bool):
        self._body, self._chat = body, chat
        self._value: Optional[int] = legs.max_new_tokens(body, chat)
        self._first: Optional[Tuple[Instance, int]] = None  # None once settled

    def began_on(self, inst: Instance) -> None:
        """The request's first leg began on `inst` (its limit is that instance's)."""
        self._first = (inst, inst.downs)

    def value(self) -> Optional[int]:
        """The limit (None: up to the model's length), settled when it can be."""
        if self._first is not None:
            inst, downs = self._first
            described = inst.described
            if inst.downs != downs:
                self._first = None  # never known: the client's stays
            elif described is not None:
                self._value = legs.output_limit(self._body, self._chat, described.default_max_tokens,
                                                described.max_tokens_cap)
                self._first = None
        return self._value


class Routed:
    """One client request, across its legs. It alone sets its current leg (take, let_go, drop,
    close): a leg is taken when it opened, let go by the pump that is done with it, dropped by a
    migration that will not use it, and closed with the request."""

    def __init__(self, rid: str, body: Dict[str, Any], chat: bool, client: ClientStream,
                 headers: Optional[Dict[str, str]] = None):
        self.rid, self.body, self.chat, self.client = rid, body, chat, client
        self.limit = OutputLimit(body, chat)
        self.instance: Optional[Instance] = None
        self.mid = live.new_migration_id()  # the current leg's migration id
        self._leg: Optional[Leg] = None
        self.resumed = asyncio.Event()  # a migration's destination gave its first token
        self.migration: Optional[asyncio.Task] = None
        self.migrations: List[live.Record] = []
        self.recoveries = 0
        self.gone = False  # the client left, or its answer is complete
        self.pinned: Optional[str] = None  # why it may no longer move (it began as one that could)
        self.headers: Dict[str, str] = dict(headers or {})  # the client's Authorization, sent with each leg

    @property
    def leg(self) -> Optional[Leg]:
        """The leg that relays the request now (None: between legs)."""
        return self._leg

    def tokens(self) -> List[int]:
        return list(self.client.prompt_token_ids or []) + self.client.token_ids

    def place(self, inst: Optional[Instance]) -> None:
        """The request is `inst`'s now (the one its recovery tries first)."""
        if self.instance is not None:
            self.instance.requests.pop(self.rid, None)
        self.instance = inst
        if inst is not None:
            inst.requests[self.rid] = self

    def take(self, leg: Leg) -> None:
        """`leg` relays the request from now on (its instance's request)."""
        self.place(leg.instance)
        self._leg = leg
        self.client.begin_leg()

    def let_go(self, leg: Leg, stopped: bool) -> None:
        """The pump is done with `leg`: stopped for a migration, or ended or broken."""
        if self._leg is leg:
            self._leg = None
        leg.done(stopped)

    def drop(self) -> None:
        """Closes the current leg (its instance aborts the request), if there is one."""
        leg, self._leg = self._leg, None
        if leg is not None:
            leg.close()

    def close(self) -> None:
        """The client left, or its answer is complete: a migration in flight notices and ends on
        its own; a leg still open is closed, so that its instance aborts what nobody reads."""
        self.gone = True
        if self.instance is not None:
            self.instance.requests.pop(self.rid, None)
        self.drop()

    def watched(self) -> Optional[Leg]:
        """The leg a silent instance's cut may break (a migration has deadlines of its own)."""
        return self._leg if self.migration is None else None

    def describe(self) -> Dict[str, Any]:
        return {"request_id": self.rid, "instance": self.instance.url if self.instance else None,
                "generated": len(self.client.token_ids), "migratable": self.pinned is None,
                "why_not": self.pinned, "migrating": self.migration is not None,
                "migrations": len(self.migrations)}


class Relayed:
    """A request that cannot move, relayed as is to `instance` (listed by GET /requests with
    why), under a key of its own in the instance's requests."""

    def __init__(self, key: str, instance: Instance, reason: str):
        self.key, self.instance, self.reason = key, instance, reason
        self.leg: Optional[Leg] = None  # once its instance's answer began

    def watched(self) -> Optional[Leg]:
        return self.leg

    def describe(self) -> Dict[str, Any]:
        return {"request_id": self.key, "instance": self.instance.url, "migratable": False, "why_not": self.reason}
