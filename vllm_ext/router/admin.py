"""The router's admin API: GET /instances and /requests, POST /migrate, /drain and /undrain.
Every route needs `Authorization: Bearer $VLLM_EXT_ROUTER_TOKEN`; without that variable the API
is off (403)."""

import asyncio
import hmac
import json
import os
import time
from typing import Dict, Optional

from aiohttp import web

from . import live
from .http import Refused, error
from .settings import MAX_STAGES_LIMIT
from .state import Instance, Relayed, Routed

ENV_TOKEN = "VLLM_EXT_ROUTER_TOKEN"


class Admin:
    """The admin routes over `fleet`'s instances, the running `requests` (and those `relayed` as
    is), moving them with `migrations` where `placement` lets them go."""

    def __init__(self, fleet, placement, migrations, requests: Dict[str, Routed], relayed: Dict[str, Relayed],
                 settings):
        self.fleet, self.placement, self.migrations, self.settings = fleet, placement, migrations, settings
        self.requests, self.relayed = requests, relayed
        self._token = os.environ.get(ENV_TOKEN) or None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/instances", self.instances)
        app.router.add_get("/requests", self.running)
        app.router.add_post("/migrate", self.migrate)
        app.router.add_post("/drain", self.drain)
        app.router.add_post("/undrain", self.undrain)

    def _authorized(self, request: web.Request) -> Optional[web.Response]:
        if self._token is None:
            return error(403, f"the admin API is off: set {ENV_TOKEN} on the router", "PermissionDenied")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            return error(401, "the admin API needs Authorization: Bearer <token>", "Unauthorized")
        return None

    async def instances(self, request: web.Request) -> web.Response:
        """Each instance as the router sees it, with what its lease channel's last describe found:
        lease_state (fleet.LEASE_*: "ok", "wrong_secret", "not_a_lease_channel", ...) and
        lease_error (why, or null)."""
        denied = self._authorized(request)
        if denied:
            return denied
        checks = self.fleet.lease_checks
        return web.json_response([{**i.describe(), "lease_state": checks[i.url].state,
                                   "lease_error": checks[i.url].error} for i in self.fleet.instances])

    async def running(self, request: web.Request) -> web.Response:
        return self._authorized(request) or web.json_response(
            {"running": [r.describe() for r in [*self.requests.values(), *self.relayed.values()]],
             "migrations": self.migrations.history[-100:]})

    async def _admin_body(self, request: web.Request, fields):
        try:
            body = await request.json()
        except (UnicodeDecodeError, ValueError):
            body = None
        if not isinstance(body, dict) or any(not isinstance(body.get(f), str) for f in fields):
            raise Refused(400, json.dumps({"error": {"message": f"expected a JSON object with {', '.join(fields)}",
                                                      "type": "BadRequestError", "code": 400}}).encode(), "")
        return body

    def _instance(self, url: str) -> Instance:
        inst = self.fleet.get(url)
        if inst is None:
            raise Refused(404, json.dumps({"error": {"message": f"no instance {url!r}", "type": "NotFoundError",
                                                      "code": 404}}).encode(), "")
        return inst

    async def migrate(self, request: web.Request) -> web.Response:
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
            dst = self.placement.target(src)
            if dst is None:
                return error(409, "no other healthy instance to move it to", "ConflictError")
        if dst.migrating_in:
            return error(409, f"to: {dst.url} has a migration in already (one at a time: try again once it ended)",
                         "ConflictError")
        stages = body.get("stages")
        if stages is not None and (type(stages) is not int or not 0 <= stages <= MAX_STAGES_LIMIT):
            return error(400, f"stages: expected an integer in [0, {MAX_STAGES_LIMIT}], got {stages!r}",
                         "BadRequestError")
        try:
            task = self.migrations.start(routed, dst, stages, recompute=bool(body.get("recompute")))
        except ValueError as e:
            return error(409, str(e), "ConflictError")
        record = await asyncio.shield(task)
        return web.json_response(record.as_dict())

    async def drain(self, request: web.Request) -> web.Response:
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
            candidates = [r for r in inst.requests.values() if self.placement.movable(r) and r.rid not in stayed]
            # one migration in per destination and out of this instance at a time, as the balancer
            # and /migrate: a busy one (a /migrate of one of its requests) is waited for
            dst = self.placement.drain_target(inst)
            if not candidates or dst is None or inst.migrating_out:
                await asyncio.sleep(0.05)
                continue
            routed = candidates[0]
            try:
                record = await asyncio.shield(self.migrations.start(routed, dst))
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

    async def undrain(self, request: web.Request) -> web.Response:
        denied = self._authorized(request)
        if denied:
            return denied
        body = await self._admin_body(request, ("instance",))
        inst = self._instance(body["instance"])
        inst.draining = False
        return web.json_response(inst.describe())
