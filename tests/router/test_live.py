"""live.migrate's state machine against fakes of the source's lease channel and of the router:
the stages it runs, what it sends the destination, and each way it ends."""

import asyncio
import random
import time

import pytest

from vllm_ext.lease import messages
from vllm_ext.lease.channel import ChannelError, ChannelRefused, MigrationLease
from vllm_ext.router import live

BS = 4


def lease(tokens, num_tokens, first_block=100):
    n = -(-num_tokens // BS)
    reply = messages.MigrateLeaseReply(lease=random.randbytes(16).hex(), n=n, num_tokens=num_tokens,
                                       n_tokens=len(tokens), num_prompt_tokens=5, block_size=BS,
                                       prompt_hash="0" * 64, fingerprint="f" * 32, endpoint_id="e1",
                                       backend="gloo", lease_s=30.0)
    return MigrationLease.of(reply, list(range(first_block, first_block + n)), list(tokens))


class FakeSource:
    """The request grows by `per_stage` tokens between calls; faults by name: "precopy" (every
    lease refused), "down" (the lease channel does not answer)."""

    host, port = "127.0.0.1", 9

    def __init__(self, tokens, per_stage=8, fail=()):
        self.tokens, self.per_stage, self.fail = list(tokens), per_stage, set(fail)
        self.calls, self.ended = [], 0

    def precopy(self, mid):
        self.calls.append("precopy")
        if "down" in self.fail:
            raise ChannelError("lease channel 127.0.0.1:9: timed out")
        if "precopy" in self.fail:
            raise ChannelRefused("lease channel 127.0.0.1:9 refused: no complete block yet", "ValueError")
        if "ended" in self.fail:
            raise ChannelRefused("lease channel 127.0.0.1:9 refused: the request ended here", "RequestEnded")
        self.tokens += [7] * self.per_stage
        # complete blocks of the tokens before the one being computed
        return lease(self.tokens, (len(self.tokens) - 2) // BS * BS)

    def end(self, mid):
        self.ended += 1


class FakeDriver:
    def __init__(self, source, seen=None, resume_ok=True, load_ok=True, running=True, refusal=None,
                 load_failed=False):
        self.source, self.seen, self.resume_ok, self.load_ok = source, seen, resume_ok, load_ok
        self.resume_load_failed = load_failed
        self.running, self.refusal = running, refusal
        self.loads, self.resumed, self.stops, self.done = [], [], 0, False
        self.last_token = None
        self.traced = None

    def finished(self):
        return self.done

    async def refuse(self, destination):
        return self.refusal

    async def load(self, destination, token_ids, params):
        self.loads.append((token_ids, params))
        return self.load_ok

    async def stop(self):
        self.stops += 1
        self.last_token = time.monotonic() - 0.25  # the client's last token came 250 ms before
        return self.running

    def tokens(self):
        return list(self.source.tokens if self.seen is None else self.seen)

    def last_token_at(self):
        return self.last_token

    async def resume(self, destination, params):
        self.resumed.append(params)
        return self.resume_ok

    async def resume_trace(self, destination):
        self.traced = destination
        return {"to_first_token_ms": 1.0}

    def load_failed(self):
        return self.resume_load_failed


def run(source, driver, **kw):
    record = live.Record("ab" * 16, "cmpl-1", "A", "B")
    return asyncio.run(live.migrate(record, source, driver, next_migration_id="cd" * 16, **kw))


def test_precopy_stages_then_a_final_lease_taken_while_it_runs():
    src = FakeSource(list(range(3, 40)), per_stage=12)
    drv = FakeDriver(src)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert rec.outcome == live.Outcome.MOVED and src.calls == ["precopy"] * 4 and drv.stops == 1
    assert [s.new_blocks for s in rec.stages] == [11, 3, 3]
    for tokens, params in drv.loads:  # each stage: whole blocks, plus the next token
        assert params["remote_num_tokens"] % BS == 0 and len(tokens) == params["remote_num_tokens"] + 1
        assert len(params["remote_block_ids"]) == params["remote_num_tokens"] // BS
    final = drv.resumed[0]  # the 4th lease's complete blocks; the destination computes the rest
    want = (len(src.tokens) - 2) // BS * BS
    assert final["remote_num_tokens"] == want and len(final["remote_block_ids"]) == want // BS
    assert final["migration_id"] == "cd" * 16 and final["sync_load"] is True
    assert rec.moved_tokens == want and rec.recomputed_tokens == len(src.tokens) - want == 5
    assert rec.stop_tokens == len(src.tokens) and src.ended == 1
    # the timings the admin API reports: every stage's two waits, the final lease's, the quiet
    # time before the stop (the fake client's last token came 250 ms before it)
    assert all(s.lease_ms >= 0 and s.load_ms >= 0 for s in rec.stages) and rec.final_lease_ms >= 0
    assert 250 <= rec.source_quiet_ms < 250 + 60e3
    out = rec.as_dict()
    assert out["stop_to_resume_ms"] >= 0 and out["source_quiet_ms"] == rec.source_quiet_ms
    assert set(out["stages"][0]) == {"blocks", "new_blocks", "lease_ms", "load_ms"}
    assert drv.traced == "B" and out["resume_spans"] == {"to_first_token_ms": 1.0}  # asked once it resumed


def test_a_stage_with_few_new_blocks_becomes_the_final_lease():
    src = FakeSource(list(range(3, 40)), per_stage=1)
    drv = FakeDriver(src)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert len(rec.stages) == 1 and src.calls == ["precopy"] * 2
    assert rec.outcome == live.Outcome.MOVED and drv.resumed[0]["remote_num_tokens"] == (len(src.tokens) - 2) // BS * BS


def test_no_precopy_is_stop_and_copy():
    src = FakeSource(list(range(3, 30)))
    drv = FakeDriver(src)
    rec = run(src, drv, max_stages=0)
    assert rec.mode == "stop_and_copy" and rec.stages == [] and drv.loads == [] and src.calls == ["precopy"]
    assert rec.outcome == live.Outcome.MOVED and rec.final_blocks == rec.moved_tokens // BS


def test_recompute_moves_no_kv():
    src = FakeSource(list(range(3, 30)))
    drv = FakeDriver(src)
    rec = run(src, drv, recompute=True)
    assert rec.mode == "recompute" and src.calls == [] and drv.resumed == [{"migration_id": "cd" * 16}]
    assert rec.outcome == live.Outcome.RECOMPUTED and rec.recomputed_tokens == len(src.tokens)


def test_the_router_saw_fewer_tokens_than_the_lease_covers():
    src = FakeSource(list(range(3, 30)))
    seen = src.tokens[:20]
    drv = FakeDriver(src, seen=seen)
    rec = run(src, drv, max_stages=0)
    # the destination computes at least the last token it was given
    assert drv.resumed[0]["remote_num_tokens"] == 19 and rec.moved_tokens == 19 and rec.recomputed_tokens == 1


def test_a_refused_final_lease_is_recomputed():
    src = FakeSource(list(range(3, 30)), fail={"precopy"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.RECOMPUTED and drv.resumed == [{"migration_id": "cd" * 16}]
    assert "no final lease" in rec.reason and "no complete block" in rec.reason and drv.stops == 1


def test_a_final_lease_refused_because_the_request_ended_lets_its_stream_finish():
    # the source ended it before the router relayed its last tokens: no stop, no recompute
    src = FakeSource(list(range(3, 30)), fail={"ended"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.FINISHED and rec.reason == live.ENDED_IN_ENGINE
    assert "engine" in rec.reason and "client gets the tokens still on their way" in rec.reason
    assert drv.stops == 0 and drv.resumed == [] and drv.loads == [] and src.ended == 1


def test_a_source_whose_lease_channel_does_not_answer_keeps_the_request():
    src = FakeSource(list(range(3, 30)), fail={"down"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.STAYED and drv.stops == 0 and drv.resumed == [] and src.ended == 1


def test_a_request_that_ended_first_finishes_where_it_was():
    src = FakeSource(list(range(3, 30)))
    drv = FakeDriver(src, running=False)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.FINISHED and drv.resumed == [] and src.ended == 1
    assert rec.reason == live.ENDED_AT_ROUTER  # never an empty reason: the answer says why


def test_a_request_that_ended_during_its_precopy_says_so():
    for fail, stages, why in (({"ended"}, 3, live.ENDED_IN_ENGINE), (set(), 0, live.ENDED_AT_ROUTER)):
        src = FakeSource(list(range(3, 30)), fail=fail)
        drv = FakeDriver(src)
        drv.done = not fail  # the router took its last token
        rec = run(src, drv, max_stages=stages)
        assert (rec.outcome, rec.reason) == (live.Outcome.FINISHED, why), (fail, stages, rec)
        assert drv.stops == 0 and drv.resumed == [] and src.ended == 1


def test_a_destination_that_does_not_resume_fails_the_migration():
    src = FakeSource(list(range(3, 30)))
    drv = FakeDriver(src, resume_ok=False)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.FAILED and src.ended == 1
    assert drv.traced is None and rec.resume_spans is None  # no resume to trace


def test_a_resume_whose_load_failed_is_recorded_as_recomputed():
    """The destination recomputed the final lease's blocks in place (its trace said the load
    failed): the request did resume, but nothing moved; the record says so."""
    src = FakeSource(list(range(3, 40)), per_stage=12)
    drv = FakeDriver(src, load_failed=True)
    rec = run(src, drv)
    assert "remote_lease" in drv.resumed[0]
    assert rec.outcome == live.Outcome.RECOMPUTED and rec.moved_tokens == 0 and "load of the final lease" in rec.reason
    assert rec.recomputed_tokens == rec.stop_tokens and src.ended == 1


@pytest.mark.parametrize("theirs,ours,want", [([1, 2, 3, 4], [1, 2, 3, 4, 5], 4), ([1, 2, 9, 4], [1, 2, 3, 4], 2),
                                              ([1, 2, 3, 4, 5], [1, 2], 2)])
def test_agreed_tokens(theirs, ours, want):
    assert live.agreed_tokens(lease(theirs, len(theirs)), ours) == want


def test_resume_spans_split_the_resume_at_the_destinations_times():
    trace = messages.MigrateTraceReply(arrival_s=100.004, seen_s=100.010, scheduled_s=100.0105, unsafe=False,
                                       settled=True, load_failed=False)
    assert live.resume_spans(100.0, trace, 100.025) == {
        "to_api_server_ms": 4.0, "to_scheduler_ms": 6.0, "to_scheduled_ms": 0.5, "to_first_token_ms": 14.5}
    # a resume that loaded KV: its first token also waited for the trace that vouches for the load
    assert live.resume_spans(100.0, trace, 100.025, 0.0003)["load_check_ms"] == 0.3


def test_a_destination_the_driver_refuses_leaves_the_request_where_it_is():
    src = FakeSource(list(range(3, 40)))
    drv = FakeDriver(src, refusal="its random stream would not go on there")
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.STAYED and rec.reason == "its random stream would not go on there"
    assert src.calls == [] and drv.loads == [] and drv.stops == 0 and drv.resumed == []


def test_a_request_refused_by_the_switch_stays_and_its_leases_end():
    """The driver is asked again before the stop: what the request showed during the pre-copy
    (a reasoning parser's output) may pin it where it is."""
    class Pinned(FakeDriver):
        async def refuse(self, destination):
            return "pinned meanwhile" if self.loads else None

    src = FakeSource(list(range(3, 40)), per_stage=12)
    drv = Pinned(src)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert rec.outcome == live.Outcome.STAYED and rec.reason == "pinned meanwhile"
    assert drv.loads and drv.stops == 0 and drv.resumed == [] and src.ended == 1


def test_a_failed_precopy_leaves_the_request_where_it_is():
    src = FakeSource(list(range(3, 40)), per_stage=12)
    drv = FakeDriver(src, load_ok=False)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert rec.outcome == live.Outcome.STAYED and rec.reason == "a pre-copy to the destination failed"
    assert len(drv.loads) == 1 and drv.stops == 0 and drv.resumed == [] and src.ended == 1
