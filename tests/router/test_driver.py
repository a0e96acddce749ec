"""RouterDriver, live.py's driver over one request: where a request may move (its random
stream, its output limit), the resumed leg's body and salt, and the trace that vouches for a
resume that loaded KV."""

import asyncio

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (a vLLM dependency; make test-connector has it)")

from vllm_ext.router.app import Router  # noqa: E402
from vllm_ext.router.settings import Settings  # noqa: E402
from vllm_ext.router.state import Routed  # noqa: E402

from .fakes import Control, describing_lease_servers, routed_on, take  # noqa: E402


def test_a_seeded_request_moves_only_between_instances_that_sample_alike(monkeypatch):
    """The router asks each instance's lease channel (real lease servers here) how it samples:
    a seeded request may go only where its random stream goes on; others go anywhere."""
    from vllm_ext.router.openai import ClientStream

    secret = "router-unit-test-deployment-secret"
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", secret)
    samplers = {"A": "generator:cpu:0.32", "B": "generator:cpu:0.32", "C": "position:cuda:0.26", "D": ""}
    servers, asked = describing_lease_servers(secret, [(k, 0, 0) for k in samplers.values()])
    try:
        urls = {n: f"http://{n.lower()}.invalid" for n in samplers}
        router = Router(list(urls.values()), [f"127.0.0.1:{s.port}" for s in servers], Settings())

        def refusal(body, to):
            routed = Routed("cmpl-1", body, False, ClientStream("cmpl-1", False, "m", False, want_usage=False))
            routed.instance = router.instances[0]
            return asyncio.run(router.migrations.driver(routed).refuse(urls[to]))

        seeded = {"prompt": [1, 2], "seed": 5, "temperature": 0.8}
        assert refusal(seeded, "B") is None
        for to in "CD":
            why = refusal(seeded, to)
            assert "random stream would not go on there" in why and repr(samplers["A"]) in why, why
        assert len(asked) == 4  # each instance asked once, then known (until it is marked down)
        asked.clear()
        for body in ({"prompt": [1, 2], "temperature": 0.8}, {"prompt": [1, 2], "seed": 5, "temperature": 0}):
            assert refusal(body, "D") is None
        assert asked == []  # nothing to ask for requests with no random stream of their own
    finally:
        for s in servers:
            s.close()
        for inst in router.instances:
            inst.control.close()


def test_only_a_resume_that_loads_kv_reads_the_migrations_salted_blocks():
    """The moved KV is cached under the migration's salt; a recompute resume has none, so it
    reads the destination's prefix cache like any request (a prefix it holds is not recomputed)."""

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append((inst, url, body, first_token))
            take(routed, inst)
        router.relay.open = fake_open
        driver = router.migrations.driver(routed_on(router, a))
        await driver.resume(b.url, {"migration_id": driver.next_mid})
        lease = {"migration_id": driver.next_mid, "remote_lease": "l", "do_remote_prefill": True}
        await driver.resume(b.url, lease)
        return driver, sent

    driver, sent = asyncio.run(go())
    (_, url, recompute, first), (_, _, loads, _) = sent
    assert url.endswith("/v1/completions") and first and recompute["prompt"] == [1, 2, 5, 6]
    assert "cache_salt" not in recompute and loads["cache_salt"] == driver.cache_salt
    assert recompute["max_tokens"] == 7 and recompute["kv_transfer_params"] == {"migration_id": driver.next_mid}


@pytest.mark.parametrize("case", ["vouched", "unsafe", "unsettled", "silent", "no channel"])
def test_a_resume_that_loaded_kv_is_kept_only_when_the_destination_vouches_for_the_load(case):
    """Its first token is relayed only once the destination's trace says its load did not fail
    under a step in flight; unsafe or unknown (no settled answer), the leg is dropped and the
    request is the source's again: its recovery tries the source first (whose prefix cache
    holds the request's blocks)."""
    from vllm_ext.lease import messages

    def trace(unsafe=False, settled=True):
        return messages.MigrateTraceReply(1.0, 2.0, 3.0, unsafe=unsafe, settled=settled, load_failed=unsafe)

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        b.control = {"vouched": Control(trace()), "unsafe": Control(trace(unsafe=True)),
                     "unsettled": Control(trace(settled=False)), "silent": Control(None),
                     "no channel": None}[case]
        legs, tried = [], []

        async def fake_open(routed, inst, url, body, first_token=False):
            tried.append(inst)
            legs.append(take(routed, inst))
        router.relay.open = fake_open
        routed = routed_on(router, a)
        a.requests[routed.rid] = routed
        driver = router.migrations.driver(routed)
        lease = {"migration_id": driver.next_mid, "remote_lease": "l", "do_remote_prefill": True}
        try:
            kept = await driver.resume(b.url, lease)
            where = (routed.instance, sorted(a.requests), sorted(b.requests))
            if not kept:
                await router.relay.recover(routed, prefer_source=True)
        finally:
            router.migrations.checks.shutdown(wait=True)
        return kept, where, legs, [router.instances.index(i) for i in tried], (a, b)

    kept, (inst, on_a, on_b), legs, tried, (a, b) = asyncio.run(go())
    if case == "vouched":
        assert kept and inst is b and on_b == ["c"] and on_a == [] and not legs[0].closed and tried == [1]
    else:
        assert not kept and legs[0].closed and inst is a and on_a == ["c"] and on_b == []
        assert tried == [1, 0]  # the dropped resume on B, then the recovery on A


def test_a_request_without_a_limit_resumes_up_to_the_destinations_model_length():
    """A chat request without max_tokens: its resumed leg (a /v1/completions request, whose
    default is 16 tokens) asks for the destination's max_model_len, from its /v1/models."""
    from vllm_ext.router.openai import ClientStream

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        b.models = {"object": "list", "data": [{"id": "other", "max_model_len": 64},
                                               {"id": "m", "max_model_len": 4096}]}
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append(body)
            take(routed, inst)
        router.relay.open = fake_open
        client = ClientStream("c", True, "m", want_ids=False, want_usage=False)
        client.prompt_token_ids, client.token_ids = [1, 2, 3], [4]
        routed = Routed("c", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True,
                                   client)
        routed.instance = a
        await router.migrations.driver(routed).resume(b.url, None)
        await router.relay.recover(routed, prefer_source=True)  # where it is, B, first
        return sent

    resumed, recovered = asyncio.run(go())
    assert resumed["prompt"] == [1, 2, 3, 4] and resumed["max_tokens"] == 4096 - 4
    assert recovered["max_tokens"] == 4096 - 4


def test_a_moved_request_keeps_the_output_limit_its_first_instance_gave_it(monkeypatch):
    """Each instance's lease channel says the output limits its OpenAI server applies: a chat
    request without a limit, begun where the generation config's default is 300 tokens, resumes
    elsewhere with 300 less what it got (not up to the model's length), also when that instance
    described itself only after the request began; one whose limit its first instance caps at
    200 keeps the cap where there is none; one whose first instance was marked down before it
    described itself keeps the client's limit; and none moves to an instance that caps what it
    has left below it."""
    from vllm_ext.router.openai import ClientStream

    secret = "router-unit-test-deployment-secret"
    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", secret)
    servers, _ = describing_lease_servers(secret, [("", 300, 0), ("", 0, 0), ("", 0, 200)])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def go():
        router = Router(["http://a.invalid", "http://b.invalid", "http://c.invalid"],
                                   [f"127.0.0.1:{s.port}" for s in servers], Settings())
        a, b, c = router.instances
        b.models = {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}
        sent = []

        async def fake_open(routed, inst, url, body, first_token=False):
            sent.append(body)
            take(routed, inst)
        router.relay.open = fake_open

        def chat_routed_on(first, body):
            client = ClientStream("c", True, "m", want_ids=False, want_usage=False)
            client.prompt_token_ids, client.token_ids = [1, 2, 3], [4, 5]
            routed = Routed("c", body, True, client)
            routed.instance = first
            routed.limit.began_on(first)  # its first leg began there
            return routed
        for first, body, down in ((a, chat, False), (c, dict(chat, max_tokens=1000), False), (b, chat, False),
                                  (a, dict(chat, max_tokens=1000), True)):
            first.described = None  # not described when the request's first leg began
            routed = chat_routed_on(first, body)
            if down:
                router.fleet.mark_down(first, OSError("test"))
            assert await router.fleet.describe(first) is not None  # it describes itself now
            await router.migrations.driver(routed).resume(b.url, None)
        legs = [leg["max_tokens"] for leg in sent]
        # to C, which caps output at 200: only a request with at most 200 tokens left
        refusals = [await router.migrations.driver(chat_routed_on(a, body)).refuse(c.url)
                    for body in (chat, dict(chat, max_tokens=202), dict(chat, max_tokens=203))]
        for inst in router.instances:
            inst.control.close()
        return legs, refusals

    try:
        legs, refusals = asyncio.run(go())
        assert legs == [298, 198, 4096 - 5, 998], legs  # the last: A went down before describing itself
        assert refusals[1] is None and "caps a request's output at 200" in refusals[2], refusals
        assert "caps" in refusals[0] and "no limit" not in refusals[0] and "298 tokens" in refusals[0], refusals
    finally:
        for s in servers:
            s.close()


def test_a_request_whose_client_left_between_the_stop_and_the_resume_leaves_no_load_behind(monkeypatch):
    """The client leaves after a migration's stop, before the resume: the resume still places
    the request on the destination, and the migration's end takes it off again (else the
    destination's load counts it for ever)."""
    from vllm_ext.router import live

    async def go():
        router = Router(["http://127.0.0.1:9", "http://127.0.0.1:10"], None, Settings())
        a, b = router.instances
        a.control = Control(None)
        routed = routed_on(router, a)
        take(routed, a)

        async def fake_open(routed, inst, url, body, first_token=False):
            take(routed, inst)
        router.relay.open = fake_open

        async def migrate(record, source, driver, **_):
            routed.let_go(routed.leg, stopped=True)  # the stop
            routed.close()  # the client leaves (app.Router.completions' finally)
            await driver.resume(b.url, {"migration_id": driver.next_mid})  # recompute: no trace asked
            record.outcome = live.Outcome.RECOMPUTED
            return record
        monkeypatch.setattr(live, "migrate", migrate)
        await router.migrations.start(routed, b)
        return a, b, routed

    a, b, routed = asyncio.run(go())
    assert routed.gone and routed.leg is None
    assert a.load == 0 and b.load == 0, (a.requests, b.requests)
