"""The router's instances and what it knows of them: each one's /metrics (health and load) and
/v1/models, polled; its lease channel's describe (how it samples, its output limits), asked
aside and kept until it is marked down; and the silence cut: once an instance has answered no
poll for silent_s (a partition that sends no FIN or RST), each of its streams and each wait for
its answer that heard nothing as long is broken, so that the request goes on elsewhere."""

import asyncio
import logging
import os
import time
from typing import Dict, List, Optional, Set

import aiohttp

from ..lease import messages
from ..lease.channel import ChannelError
from ..migration import auth
from .http import backend_session, local_limit
from .state import Instance

logger = logging.getLogger("vllm_ext.router")

ENV_API_KEY = "VLLM_API_KEY"  # vLLM's --api-key from the environment
DESCRIBE_RETRY_S = 10.0  # the poll asks an instance that did not describe itself again after this
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class Silent(aiohttp.ClientConnectionError):
    """Ends a stream of, or a wait for, an instance that has been silent (Fleet.cut_silent)."""

    def __init__(self, url: str, seconds: float):
        super().__init__(f"{url} sent nothing for {seconds:g} s")


class Fleet:
    """The instances at `urls`, with their lease channels at `leases` (None: none), and the
    client session the router reaches them with (from start to stop)."""

    def __init__(self, urls: List[str], leases: Optional[List[Optional[str]]], settings):
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
        # what the router asks for itself (an instance's /v1/models), under vLLM's own --api-key
        # variable when the instances need one
        key = os.environ.get(ENV_API_KEY)
        self._own_auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.session: Optional[aiohttp.ClientSession] = None
        self._watching: Optional[asyncio.Task] = None
        self._describing: Set[asyncio.Future] = set()  # lease-channel describes the polls asked for

    def __getitem__(self, url: str) -> Instance:
        return self._by_url[url]

    def get(self, url: str) -> Optional[Instance]:
        """The instance at `url` (None: none)."""
        return self._by_url.get(url.rstrip("/"))

    async def start(self) -> None:
        self.session = backend_session(self.settings.timeout_s)
        self._watching = asyncio.create_task(self.watch())

    async def stop(self) -> None:
        for task in [*([self._watching] if self._watching else []), *self._describing]:
            task.cancel()
        if self.session is not None:
            await self.session.close()
        for inst in self.instances:
            if inst.control is not None:
                inst.control.close()

    # ---- what the others tell it -----------------------------------------------------------
    def mark_down(self, inst: Instance, e: BaseException) -> None:
        """`inst` failed with `e`: down until a poll finds it again. Never for a limit of the
        router's own (file descriptors, ports, memory: `e` says nothing of the instance)."""
        limit = local_limit(e)
        if limit is not None:
            logger.warning("instance %s not reached: the router is at a local limit (%s)", inst.url, limit.strerror)
            return
        if inst.healthy:
            logger.warning("instance %s is down (%s: %s)", inst.url, type(e).__name__, e)
        inst.healthy = False
        inst.described = inst.models = None  # it may come back with another configuration
        inst.downs += 1
        inst.describe_after = 0.0

    async def answer(self, inst: Instance, request):
        """Awaits `request` (an answer of `inst`); Silent once cut_silent gives up on it."""
        task = asyncio.ensure_future(request)
        cut = asyncio.get_running_loop().create_future()
        inst.waits[cut] = time.monotonic()
        try:
            await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise Silent(inst.url, self.settings.silent_s)
            return task.result()
        finally:
            inst.waits.pop(cut, None)
            if not task.done():
                task.cancel()

    async def describe(self, inst: Instance) -> Optional[messages.LeaseDescribeReply]:
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

    async def sampler(self, inst: Instance) -> str:
        """How `inst` draws seeded requests' numbers ("" when it cannot say)."""
        described = await self.describe(inst)
        return described.sampler if described is not None else ""

    # ---- the poll ----------------------------------------------------------------------------
    async def watch(self) -> None:
        """Health and load of every instance (its /metrics); streams of a silent one are cut."""
        poll = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
        while True:
            for inst in self.instances:
                began = time.monotonic()
                try:
                    async with self.session.get(inst.url + "/metrics", timeout=poll) as r:
                        text = await r.text()
                    inst.metrics = _metrics(text)
                    if inst.models is None:  # what a resumed leg of a request without a limit may ask
                        async with self.session.get(inst.url + "/v1/models", timeout=poll,
                                                    headers=self._own_auth) as r:
                            inst.models = await r.json() if r.status == 200 else None
                    if inst.described is None and began >= inst.describe_after:  # its requests' limits,
                        # asked aside: a slow lease channel holds no poll
                        task = asyncio.ensure_future(self.describe(inst))
                        self._describing.add(task)
                        task.add_done_callback(self._describing.discard)
                    if not inst.healthy:
                        logger.info("instance %s is back", inst.url)
                    inst.healthy, inst.failed_polls, inst.silent_since = True, 0, None
                except aiohttp.ClientConnectorError as e:  # nothing listens: down now
                    if local_limit(e) is not None:  # the router's limit, not the instance's silence
                        self.mark_down(inst, e)  # (logs it only)
                        continue
                    inst.silent_since = inst.silent_since or began
                    self.mark_down(inst, e)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    if local_limit(e) is not None:
                        self.mark_down(inst, e)  # (logs it only)
                        continue
                    inst.silent_since = inst.silent_since or began
                    inst.failed_polls += 1  # slow (a busy host): down only after three in a row
                    if inst.failed_polls >= 3:
                        self.mark_down(inst, e)
                self.cut_silent(inst)
            await asyncio.sleep(self.settings.health_interval_s)

    def cut_silent(self, inst: Instance) -> None:
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
                    and leg.cut(Silent(inst.url, self.settings.silent_s)):
                logger.warning("request %s: %s sent nothing for %.0f s and answers no poll: its stream is cut",
                               key, inst.url, now - leg.heard_at)


def _metrics(text: str) -> Dict[str, float]:
    """The METRICS of a /metrics answer, by their names without vllm: (summed over engines)."""
    metrics: Dict[str, float] = {}
    for line in text.splitlines():
        for name in METRICS:
            if line.startswith(name + "{") or line.startswith(name + " "):
                metrics[name.split(":")[1]] = metrics.get(name.split(":")[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return metrics
