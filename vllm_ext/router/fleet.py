"""The router's instances and what it knows of them: each one's /metrics (health and load) and
/v1/models, polled; its lease channel's describe (how it samples, its output limits), asked
aside and kept until it is marked down; and the silence cut: once an instance has answered no
poll for silent_s (a partition that sends no FIN or RST), each of its streams and each wait for
its answer that heard nothing as long is broken, so that the request goes on elsewhere."""

import asyncio
import dataclasses
import logging
import os
import socket
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
HTTP_PROBE_S = 2.0  # a lease address that failed is asked whether it speaks HTTP, within this

# what the router found at an instance's lease channel (GET /instances: lease_state, lease_error)
LEASE_NONE = "none"  # no --lease given: its requests stay where they are
LEASE_UNCHECKED = "unchecked"  # not asked yet (the instance has not answered a poll)
LEASE_OK = "ok"  # it answered a describe: authenticated, the same protocol
LEASE_UNREACHABLE = "unreachable"  # nothing listens there, or it did not answer in time
LEASE_WRONG_SECRET = "wrong_secret"  # it does not hold the router's deployment secret
LEASE_NOT_A_LEASE_CHANNEL = "not_a_lease_channel"  # an HTTP server (or another protocol) answers there
LEASE_FAILED = "failed"  # another failure (its message says which)


@dataclasses.dataclass
class LeaseCheck:
    """What the last describe of an instance's lease channel found: `state` (LEASE_*) and, when it
    failed, why."""

    state: str
    error: Optional[str] = None


def check_lease_address(instance_url: str, lease: str) -> None:
    """ValueError naming --lease `lease` (of the instance at `instance_url`) unless it is
    HOST:PORT: not a bare port, a URL, or the instance's own HTTP address."""
    host, _, port = lease.rpartition(":")
    what = f"--lease {lease!r} (of {instance_url})"
    if "://" in lease or "/" in lease:
        raise ValueError(f"{what}: a lease channel is HOST:PORT with no scheme or path, the instance's "
                         "kv_connector_extra_config.lease_port (not its HTTP URL)")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT with a port 1-65535 (e.g. 127.0.0.1:8101: the instance's "
                         "kv_connector_extra_config.lease_host and lease_port)")
    from urllib.parse import urlsplit

    http = urlsplit(instance_url)
    http_port = http.port or (443 if http.scheme == "https" else 80)
    if host.strip("[]") == (http.hostname or "") and int(port) == http_port:
        raise ValueError(f"{what}: that is the instance's HTTP address; its lease channel listens on "
                         "kv_connector_extra_config.lease_port")


def speaks_http(host: str, port: int, timeout_s: float = HTTP_PROBE_S) -> bool:
    """Whether an HTTP server answers at host:port (a lease address given an HTTP port)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"GET /health HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            return s.recv(5) == b"HTTP/"
    except OSError:
        return False


def lease_problem(error: BaseException, host: str, port: int) -> LeaseCheck:
    """What a failed describe of the lease channel at host:port says is wrong there (blocking:
    an unexplained failure is followed by an HTTP probe)."""
    text = str(error)
    where = f"{host}:{port}"
    if "did not prove it holds the secret" in text or "authentication failed" in text:
        return LeaseCheck(LEASE_WRONG_SECRET, f"the lease channel at {where} does not hold the router's deployment "
                          f"secret ({auth.ENV_SECRET} or {auth.ENV_SECRET_FILE} differs): {text}")
    if "protocol" in text and "there," in text and "here" in text:
        return LeaseCheck(LEASE_NOT_A_LEASE_CHANNEL, f"{where} speaks another lease protocol: {text}")
    if speaks_http(host, port):
        return LeaseCheck(LEASE_NOT_A_LEASE_CHANNEL, f"{where} is an HTTP server, not a lease channel: give "
                          "--lease the instance's kv_connector_extra_config.lease_port")
    if "cannot connect" in text or "no answer within" in text:
        return LeaseCheck(LEASE_UNREACHABLE, f"{where}: {text}")
    if "frame" in text or "header" in text:
        return LeaseCheck(LEASE_NOT_A_LEASE_CHANNEL, f"{where} does not speak the lease protocol: {text}")
    return LeaseCheck(LEASE_FAILED, text)


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
        for url, lease in zip(urls, leases):
            if lease:
                check_lease_address(url, lease)
        secret = auth.deployment_secret() if any(leases) else None
        if any(leases) and secret is None:
            raise ValueError(f"--lease needs the deployment secret: set {auth.ENV_SECRET} or {auth.ENV_SECRET_FILE}")
        self.settings = settings
        self.instances = [Instance(u, lease, secret) for u, lease in zip(urls, leases)]
        self.lease_checks: Dict[str, LeaseCheck] = {
            i.url: LeaseCheck(LEASE_UNCHECKED if i.control is not None else LEASE_NONE) for i in self.instances}
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
            loop = asyncio.get_running_loop()
            try:
                described = await loop.run_in_executor(None, inst.control.describe)
            except (ChannelError, ValueError, OSError, RuntimeError) as e:
                check = await loop.run_in_executor(None, lease_problem, e, inst.control.host, inst.control.port)
                self._lease_checked(inst, check)
                return None
            self._lease_checked(inst, LeaseCheck(LEASE_OK))
            if inst.downs == downs:  # else it was marked down meanwhile: not its configuration now
                inst.described = described
        return inst.described

    def _lease_checked(self, inst: Instance, check: LeaseCheck) -> None:
        """Keeps what a describe found at `inst`'s lease channel; a new problem is a WARNING
        (its requests cannot move while it lasts), once."""
        before = self.lease_checks.get(inst.url)
        self.lease_checks[inst.url] = check
        if check.state == LEASE_OK:
            if before is not None and before.state not in (LEASE_OK, LEASE_UNCHECKED):
                logger.info("instance %s: its lease channel %s answers now", inst.url, inst.lease)
        elif before is None or before.state != check.state:
            logger.warning("instance %s: lease channel %s: %s (its requests cannot move while this lasts)",
                           inst.url, inst.lease, check.error)

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
