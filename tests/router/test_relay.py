"""The relay over fake legs: the pump and a migration's stop (the switch), the loop's fairness,
a client that stopped reading, how a leg is let go, and where a recovery goes."""

import asyncio

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402

from vllm_ext.router.app import Router  # noqa: E402
from vllm_ext.router.relay import LegFailed  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402
from vllm_ext.router.state import Routed  # noqa: E402

from .fakes import Out, routed_on, take, token_event  # noqa: E402


def _switch(gap_s, tokens_after_stop):
    """A routed request with a leg; the driver's stop while the pump relays. Returns (what stop
    returned, the client's token ids, the leg, seconds the stop took)."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = take(routed, router.instances[0])
        out = Out()
        for t in (10, 11):  # two tokens: the client's last gap between tokens is known
            await leg.content.events.put(token_event(t))
        pump = asyncio.ensure_future(router.relay.pump(routed, out))
        while len(client.token_ids) < 2:
            await asyncio.sleep(0.005)
        client.last_gap_s = gap_s
        driver = router.migrations.driver(routed)
        started = asyncio.get_running_loop().time()
        stop = asyncio.ensure_future(driver.stop())
        await asyncio.sleep(0.05)
        assert not stop.done() or not tokens_after_stop  # it waits for the source's next token
        for t in tokens_after_stop:
            await leg.content.events.put(token_event(t))
        stopped = await stop
        took = asyncio.get_running_loop().time() - started
        assert await pump == "stopped" and routed.leg is None
        return stopped, list(client.token_ids), leg, took

    return asyncio.run(go())


def test_the_stop_comes_right_after_the_sources_next_token(monkeypatch):
    monkeypatch.setattr("vllm_ext.router.driver.STOP_WAIT_MAX_S", 60.0)  # a slow host does not make the token late
    stopped, ids, leg, _ = _switch(gap_s=30.0, tokens_after_stop=[12, 13, 14])
    # 12 reached the client, then the leg closed: 13 and 14 were never relayed
    assert stopped is True and ids == [10, 11, 12] and leg.closed


def test_a_late_token_does_not_hold_the_stop_past_twice_the_last_gap():
    stopped, ids, leg, took = _switch(gap_s=0.1, tokens_after_stop=[])
    assert stopped is True and ids == [10, 11] and leg.closed
    assert took >= 0.2  # it waited for the token that did not come, as long as it may


class _Buffered:
    """A backend stream whose events all arrived already: like aiohttp's reader, a read returns
    without yielding to the loop (b"" at the end)."""

    def __init__(self, events):
        self.events = list(events)

    async def readuntil(self, sep, **_):
        return self.events.pop(0) if self.events else b""


def test_a_stream_that_arrives_faster_than_it_is_relayed_does_not_hold_the_loop():
    """Other streams, migrations and the admin API run between a stream's events, also while
    the next event is already buffered (an aiohttp read then returns without yielding)."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        take(routed, router.instances[0]).content = _Buffered([token_event(t) for t in range(100, 300)])
        seen = []  # the client's token count each time the other task ran

        async def other():
            for _ in range(5):
                seen.append(len(client.token_ids))
                await asyncio.sleep(0)
        pump = asyncio.ensure_future(router.relay.pump(routed, Out()))
        others = asyncio.ensure_future(other())
        assert await pump == "ended" and len(client.token_ids) == 200
        await others
        return seen

    seen = asyncio.run(go())
    assert len(set(seen)) == 5 and max(seen) < 200, seen


class _StuckOut:
    """A client that stopped reading: its third write never completes."""

    def __init__(self):
        self.writes = 0

    async def write(self, data):
        self.writes += 1
        if self.writes >= 3:
            await asyncio.Event().wait()


def test_a_client_that_stopped_reading_does_not_hold_a_migrations_stop():
    """The finding: a client that stopped reading held an admin /migrate for 113 s (and a drain
    answered 504 with nothing moved). While the pump waits on a write to the client, what the
    client is given is recorded already: the stop is done at once (the source's leg closed), and
    the write goes on until the client takes it or the timeout setting says it is gone."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9"], None, Settings(timeout_s=600))
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = take(routed, router.instances[0])
        for t in (10, 11, 12):
            await leg.content.events.put(token_event(t))
        pump = asyncio.ensure_future(router.relay.pump(routed, _StuckOut()))
        while len(client.token_ids) < 3:
            await asyncio.sleep(0.01)
        driver = router.migrations.driver(routed)
        stopped = await asyncio.wait_for(driver.stop(), 30)  # bounded: without the fix it waits 601 s
        tokens = driver.tokens()
        pump.cancel()
        return stopped, driver.late_stop, tokens, leg.closed

    stopped, late, tokens, closed = asyncio.run(go())
    assert stopped is True and late is None and closed
    assert tokens == [1, 2, 10, 11, 12]  # the third token, whose write waits, is the client's


def test_a_broken_leg_is_closed_and_an_ended_one_released():
    """The pump lets go of a leg's connection either way (a broken one left open stays in
    aiohttp's hands, unclosed)."""
    from vllm_ext.router.openai import ClientStream

    async def pump(end):
        router = Router(["http://127.0.0.1:9"], None, Settings())
        client = ClientStream("c", False, "m", want_ids=True, want_usage=False)
        client.prompt_token_ids = [1, 2]
        routed = Routed("c", {"model": "m"}, False, client)
        leg = take(routed, router.instances[0])
        await leg.content.events.put(token_event(7))
        if end == "broken":
            leg.content.set_exception(aiohttp.ClientPayloadError("cut"))
        else:
            await leg.content.events.put(b"")
        how = await router.relay.pump(routed, Out())
        return how, leg.closed, leg.released, client.token_ids, routed.leg

    assert asyncio.run(pump("broken")) == ("broken", True, False, [], None)  # (the error comes first)
    assert asyncio.run(pump("ended")) == ("ended", False, True, [7], None)


def test_a_recovery_after_a_failed_move_prefers_the_source_unless_it_drains():

    async def go(draining):
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        a.draining = draining
        tried = []

        async def fake_open(routed, inst, url, body, first_token=False):
            tried.append(inst)
            raise LegFailed("no")
        router.relay.open = fake_open
        with pytest.raises(LegFailed, match="no instance could continue it"):
            await router.relay.recover(routed_on(router, a), prefer_source=True)
        return [router.instances.index(i) for i in tried]

    assert asyncio.run(go(False)) == [0, 1]
    assert asyncio.run(go(True)) == [1, 0]  # a draining source last: the move was to take it off there
