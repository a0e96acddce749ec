"""The router's parts wired together, its client routes (/health, /v1/models, the completions of
both APIs) and build_app (`python -m vllm_ext.router`: cli.py).

    fleet.py      the instances: polls, mark-downs, silence cuts, describes
    placement.py  where requests and migrations go (the P/D proxy's order too)
    relay.py      a request's legs: opened, pumped to the client, recovered; or relayed as is
    driver.py     migrations: started, driven through live.py's state machine, recorded
    admin.py      /instances /requests /migrate /drain /undrain
"""

import logging
import secrets
from typing import Dict, List, Optional

from aiohttp import web

from . import legs, openai
from .admin import ENV_TOKEN, Admin
from .driver import Migrations
from .fleet import Fleet
from .http import Admission, ClientGone, Refused, Rejected, client_auth, error, first_models, openai_app
from .openai import ClientStream
from .placement import Placement
from .relay import Relay
from .settings import Settings
from .state import Instance, Routed

__all__ = ["ENV_TOKEN", "Router", "build_app"]

logger = logging.getLogger("vllm_ext.router")


class Router:
    """The router over the instances at `urls` (their lease channels at `leases`)."""

    def __init__(self, urls: List[str], leases: Optional[List[Optional[str]]], settings: Settings):
        self.settings = settings
        self.admission = Admission(settings.max_requests, settings.max_body_bytes)
        self.fleet = Fleet(urls, leases, settings)
        self.placement = Placement(self.fleet, settings)
        self.relay = Relay(self.fleet, self.placement, settings)
        self.migrations = Migrations(self.fleet, self.relay, self.placement, settings)
        self.requests: Dict[str, Routed] = {}  # the running requests that may move, by id
        self.admin = Admin(self.fleet, self.placement, self.migrations, self.requests, self.relay.relayed, settings)

    @property
    def instances(self) -> List[Instance]:
        return self.fleet.instances

    async def start(self, app) -> None:
        await self.fleet.start()
        self.migrations.start_balancing()

    async def stop(self, app) -> None:
        self.migrations.stop()
        await self.fleet.stop()

    # ---- client routes -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Each instance's health, in --instance order (their URLs are the admin API's to tell)."""
        up = [i.healthy for i in self.instances]
        return web.json_response({"instances": up}, status=200 if any(up) else 503)

    async def models(self, request: web.Request) -> web.Response:
        return await first_models(self.fleet.session, [i.url for i in self.placement.candidates()], "instance",
                                  logger, headers=client_auth(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await self.admission.read_json(request)
        except Rejected as e:
            return e.response
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "BadRequestError")
        body.pop("kv_transfer_params", None)  # a client's own never reach an instance
        reason = legs.not_migratable(body, chat)
        if reason is not None:
            logger.info("a request that cannot move (%s): relayed as is", reason)
            return await self.relay.as_is(request, body, reason)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(16)
        opts = body.get("stream_options") or {}
        client = ClientStream(rid, chat, str(body.get("model", "")), bool(body.get("return_token_ids")),
                              want_usage=not body.get("stream") or bool(opts.get("include_usage")),
                              stops=openai.stop_strings(body),
                              include_stop=bool(body.get("include_stop_str_in_output")),
                              min_tokens=body.get("min_tokens") or 0)
        routed = Routed(rid, body, chat, client, client_auth(request))
        self.requests[rid] = routed
        try:
            return await self.relay.serve(request, routed)
        finally:
            self.requests.pop(rid, None)
            routed.close()  # a migration in flight notices (driver.finished) and ends on its own


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except Refused as e:
        return web.Response(status=e.status, body=e.body, content_type=e.content_type.split(";")[0])
    except ClientGone:
        return web.Response(status=499)


def build_app(urls: List[str], leases: Optional[List[Optional[str]]] = None,
              settings: Optional[Settings] = None) -> web.Application:
    settings = settings or Settings()
    router = Router(urls, leases, settings)
    app = openai_app(router, router.admission, middlewares=[_errors])
    router.admin.add_routes(app)
    return app
