"""The router's side of live migration (live.py runs the state machine): RouterDriver, what
the state machine does through the router for one request (its legs, the destination's answers,
the source's stop), and Migrations, which starts migrations (by hand, for a drain, or to
balance load), one at a time per request, and keeps their records."""

import asyncio
import concurrent.futures
import logging
import secrets
import time
from typing import Any, Dict, List, Optional

import aiohttp

from ..lease import messages
from ..lease.channel import ChannelError
from . import legs, live
from .http import Refused
from .relay import LegFailed
from .state import Instance, Leg, Routed

logger = logging.getLogger("vllm_ext.router")

# A migration's stop waits at most this long for the source's next token (it stops right after one)
STOP_WAIT_MAX_S = 1.0
# A resume that loads KV: the destination is asked, when the resume is sent, to answer once the
# load's result is in; it answers by then or after this long (the router then asks again at the
# first token). At most this many of those questions wait at once.
RESUME_CHECK_WAIT_S = 5.0
MAX_RESUME_CHECKS = 8


class Migrations:
    """Starts and records the migrations of requests relayed by `relay` between `fleet`'s
    instances, where `placement` lets them go; runs the balancer when the settings ask."""

    def __init__(self, fleet, relay, placement, settings):
        self.fleet, self.relay, self.placement, self.settings = fleet, relay, placement, settings
        self.history: List[Dict[str, Any]] = []  # finished migrations (the last 1000)
        # the resumes' early load checks wait in threads of their own (not the loop's default pool)
        self.checks = concurrent.futures.ThreadPoolExecutor(MAX_RESUME_CHECKS, "vllm-ext-resume-check")
        self._balancing: Optional[asyncio.Task] = None

    def start_balancing(self) -> None:
        if self.settings.balance:
            self._balancing = asyncio.create_task(self.balance())

    def stop(self) -> None:
        if self._balancing is not None:
            self._balancing.cancel()
        self.checks.shutdown(wait=False)

    def start(self, routed: Routed, dst: Instance, stages: Optional[int] = None,
              recompute: bool = False) -> asyncio.Task:
        """Starts moving `routed` to `dst` (ValueError when it cannot move now); `stages`: at
        most this many pre-copy stages (default: the max_stages setting; 0: stop and copy)."""
        why_not = self.placement.cannot_start(routed, dst)
        if why_not is not None:
            raise ValueError(why_not)
        src = routed.instance
        record = live.Record(routed.mid, routed.rid, src.url, dst.url)
        driver = self.driver(routed)
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
                if routed.gone:  # resumed for a client that left meanwhile: no instance keeps it
                    routed.close()
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

    def driver(self, routed: Routed) -> "RouterDriver":
        """The live.Driver of one migration of `routed`."""
        return RouterDriver(routed, self.fleet, self.relay, self.placement, self.settings, self.checks)

    async def balance(self) -> None:
        """Every balance_interval_s, the move the placement's balancer asks for (placement.py)."""
        while True:
            await asyncio.sleep(self.settings.balance_interval_s)
            move = self.placement.balance()
            if move is not None:
                try:
                    self.start(*move)
                except ValueError as e:
                    logger.debug("balancer: %s", e)


class RouterDriver:
    """live.Driver over one routed request: its legs through `relay`, the destination's answers
    and lease channel through `fleet`, whether it may move through `placement`; `checks` is the
    pool the resumes' early load checks wait in."""

    def __init__(self, routed: Routed, fleet, relay, placement, settings, checks: concurrent.futures.Executor):
        self.routed, self.fleet, self.relay, self.placement = routed, fleet, relay, placement
        self.settings, self.checks = settings, checks
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
        return await self.placement.refusal(self.routed, self.fleet[destination])

    def tokens(self) -> List[int]:
        return self.routed.tokens()

    def last_token_at(self) -> Optional[float]:
        return self.routed.client.last_token_at

    async def load(self, destination: str, token_ids: List[int], params: Dict[str, Any]) -> bool:
        inst = self.fleet[destination]
        body = {"model": self.routed.body.get("model"), "prompt": token_ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": params, "cache_salt": self.cache_salt}
        try:
            async with await self.fleet.answer(inst, self.fleet.session.post(
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
        # the pump stops at its next step, or at once while it waits on a write to the client
        # (Leg.writing): a slow client holds no stop
        wait_s = self.settings.timeout_s + STOP_WAIT_MAX_S
        try:
            stopped = await leg.stop(None if gap is None else min(2 * gap, STOP_WAIT_MAX_S), wait_s)
            return stopped and not self.routed.client.finished  # a stop during the last write: nothing to move
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
        source, inst = routed.instance, self.fleet[destination]
        body = legs.resume_leg_body(routed.body, routed.limit.value(), routed.tokens(),
                                       len(routed.client.token_ids), params, inst.max_model_len(routed.body),
                                       routed.client.text)
        checked = params is not None and "remote_lease" in params  # it loads KV, vouched for by the trace
        if checked:  # under the salt of the pre-copies' blocks (a recompute reads the prefix cache as any request)
            body["cache_salt"] = self.cache_salt
        early = None
        if checked and inst.control is not None:
            early = asyncio.get_running_loop().run_in_executor(self.checks, inst.control.settled_trace,
                                                               self.next_mid, RESUME_CHECK_WAIT_S)
            early.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is only looked at below
        self.resume_sent_s = time.time()
        try:
            await self.relay.open(routed, inst, inst.url + "/v1/completions", body, first_token=True)
        except (LegFailed, Refused) as e:
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
        trace = self.trace or await self._trace(self.fleet[destination])
        if trace is None:
            return None
        return live.resume_spans(self.resume_sent_s, trace, self.resume_first_s, self.check_s)
