"""The admin API's /migrate, /drain and /undrain over fake instances: which destinations they
refuse or choose, one migration in and out of an instance at a time."""

import asyncio

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from vllm_ext.router.app import ENV_TOKEN, build_app  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402

from .fakes import Control, backend, dead_url, empty, routed_on, serving, take  # noqa: E402


def test_migrate_refuses_a_destination_that_is_down_draining_or_busy_and_undrain_ends_a_drain(monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, "t")
    auth = {"Authorization": "Bearer t"}

    polled = []

    async def go():
        async def metrics(request):
            polled.append(1)
            return web.Response(text="")
        rb, up = await backend(empty, metrics)  # B is up until the test marks it down
        app = build_app([dead_url(), up], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, b = router.instances
        routed = routed_on(router, a)
        take(routed, a)
        router.requests["c"] = routed
        runner, url = await serving(app)
        out = []
        try:
            async with aiohttp.ClientSession(headers=auth) as s:
                while not polled:  # the router's first poll of B is over: the test marks it now
                    await asyncio.sleep(0.01)
                for mark in ("draining", "down", "in", "out"):  # "in": B has a migration in; "out": A one out
                    b.draining, b.healthy = mark == "draining", mark != "down"
                    b.migrating_in, a.migrating_out = int(mark == "in"), int(mark == "out")
                    async with s.post(url + "/migrate", json={"request_id": "c", "to": b.url}) as r:
                        out.append((r.status, (await r.json())["error"]["message"]))
                    async with s.post(url + "/migrate", json={"request_id": "c"}) as r:  # B: the only other one
                        out.append((r.status, (await r.json())["error"]["message"]))
                b.migrating_in = a.migrating_out = 0
                b.draining, b.healthy = False, False  # nowhere to go: the drain waits
                drain = asyncio.ensure_future(s.post(url + "/drain", json={"instance": a.url, "timeout_s": 60}))
                while not a.draining:
                    await asyncio.sleep(0.01)
                async with s.post(url + "/undrain", json={"instance": a.url}) as r:
                    assert r.status == 200
                r = await asyncio.wait_for(drain, 10)
                out.append((r.status, await r.json()))
                r.release()
        finally:
            await runner.cleanup()
            await rb.cleanup()
        return out

    *refused, (s3, drained) = asyncio.run(go())
    (draining, _), (down, _), (busy_in, busy_in_any), (busy_out, busy_out_any) = zip(refused[::2], refused[1::2])
    assert {s for s, _ in refused} == {409}, refused
    assert draining[1].endswith("is draining") and down[1].endswith("is down"), refused
    assert all("has a migration in already" in m for _, m in (busy_in, busy_in_any)), refused
    assert all(m.startswith("request c: its instance") and "has a migration out already" in m
               for _, m in (busy_out, busy_out_any)), refused
    assert s3 == 409 and drained["undrained"] is True and drained["left"] == ["c"]


def test_a_drain_moves_each_request_to_the_least_loaded_instance_with_no_migration_coming_in(monkeypatch):
    """B is the least loaded but has a migration coming in: A's request goes to C."""
    from vllm_ext.router import live
    from vllm_ext.router.state import Relayed

    monkeypatch.setenv(ENV_TOKEN, "t")
    chosen = []

    async def go():
        backends = [await backend(empty) for _ in range(3)]  # up: the router's polls find them
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, b, c = router.instances
        b.migrating_in = 1
        c.requests.update({key: Relayed(key, c, "n > 1") for key in ("x", "y")})
        routed = routed_on(router, a)
        take(routed, a)
        router.requests["c"] = routed

        def start_migration(routed_, dst, stages=None, recompute=False):
            chosen.append(dst.url)
            a.requests.pop(routed_.rid)
            done = asyncio.get_running_loop().create_future()
            done.set_result(live.Record("ab" * 16, routed_.rid, a.url, dst.url, outcome=live.Outcome.MOVED))
            return done
        router.migrations.start = start_migration
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 10}) as r:
                    return r.status, await r.json(), c.url
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    status, body, c_url = asyncio.run(go())
    assert status == 200 and body["left"] == [] and chosen == [c_url], (status, body, chosen)


def test_no_migration_goes_to_an_instance_whose_kv_cache_is_full_or_that_queues_requests(monkeypatch):
    """From each instance's /metrics: /migrate to one is refused by name, and /migrate's own
    choice and a drain skip it (the resume would wait there for blocks)."""
    monkeypatch.setenv(ENV_TOKEN, "t")

    def metrics(usage, waiting):
        async def answer(request):
            return web.Response(text=f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'
                                     f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n')
        return answer

    async def go():
        backends = [await backend(empty, metrics(u, w)) for u, w in ((0.1, 0), (0.95, 0), (0.2, 3), (0.5, 0))]
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        runner, url = await serving(app)
        a, full, queues, roomy = router.instances
        try:
            while not all(i.metrics for i in router.instances):  # the first poll
                await asyncio.sleep(0.01)
            a.control = Control(None)  # a lease channel (never used: each move is refused or faked)
            routed = routed_on(router, a)
            take(routed, a)
            router.requests["c"] = routed
            reasons = {}
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                for dst in (full, queues):
                    async with s.post(url + "/migrate", json={"request_id": "c", "to": dst.url}) as r:
                        reasons[dst.url] = r.status, (await r.json())["error"]["message"]
                chosen = []

                def start_migration(routed_, dst, *args, **kwargs):
                    chosen.append(dst)
                    a.requests.pop(routed_.rid)
                    return _done(dst)
                router.migrations.start = start_migration
                async with s.post(url + "/migrate", json={"request_id": "c"}) as r:
                    assert r.status == 200, await r.text()
                a.requests["c"] = routed
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 10}) as r:
                    assert r.status == 200, await r.text()
            return reasons, chosen, (full.url, queues.url, roomy)
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    def _done(dst):
        from vllm_ext.router import live

        done = asyncio.get_running_loop().create_future()
        done.set_result(live.Record("ab" * 16, "c", "a", dst.url, outcome=live.Outcome.MOVED))
        return done

    reasons, chosen, (full, queues, roomy) = asyncio.run(go())
    assert reasons[full][0] == 409 and "KV cache is 95% used" in reasons[full][1] and "under 90%" in reasons[full][1]
    assert reasons[queues][0] == 409 and "queues 3 requests" in reasons[queues][1], reasons
    assert chosen == [roomy, roomy], chosen  # the least loaded with room (the three others run nothing)


def test_a_drain_waits_for_a_migration_already_leaving_the_instance(monkeypatch):
    """One migration out of an instance at a time: a drain begun while a /migrate moves one of
    its requests starts none of its own until that one ends."""
    monkeypatch.setenv(ENV_TOKEN, "t")
    started = []

    async def go():
        backends = [await backend(empty) for _ in range(2)]
        app = build_app([url for _, url in backends], None, Settings(health_interval_s=60))
        router = next(h.__self__ for r in app.router.routes() for h in [r.handler]
                      if getattr(h, "__name__", "") == "completions")
        a, _ = router.instances
        a.migrating_out = 1  # a /migrate of another of A's requests is under way
        routed = routed_on(router, a)
        take(routed, a)
        router.requests["c"] = routed
        router.migrations.start = lambda *args, **kwargs: started.append(args)
        runner, url = await serving(app)
        try:
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as s:
                async with s.post(url + "/drain", json={"instance": a.url, "timeout_s": 0.5}) as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()
            for r, _ in backends:
                await r.cleanup()

    status, body = asyncio.run(go())
    assert status == 504 and body["left"] == ["c"] and started == [], (status, body, started)
