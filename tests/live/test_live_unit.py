"""live.migrate's state machine against fakes of the source's lease channel and of the router:
the stages it runs, what it sends the destination, and each way it ends."""

import asyncio
import random

import pytest

from vllm_ext.migration import live, protocol
from vllm_ext.migration.lease import ChannelError, MigrationLease

BS = 4


def lease(tokens, num_tokens, first_block=100):
    n = -(-num_tokens // BS)
    reply = protocol.MigrateLeaseReply(lease=random.randbytes(16).hex(), n=n, num_tokens=num_tokens,
                                       n_tokens=len(tokens), num_prompt_tokens=5, block_size=BS,
                                       prompt_hash="0" * 64, fingerprint="f" * 32, endpoint_id="e1",
                                       backend="gloo", lease_s=30.0)
    return MigrationLease(reply, list(range(first_block, first_block + n)), list(tokens))


class FakeSource:
    """The request grows by `per_stage` tokens between calls; faults by name."""

    host, port = "127.0.0.1", 9

    def __init__(self, tokens, per_stage=8, fail=()):
        self.tokens, self.per_stage, self.fail = list(tokens), per_stage, set(fail)
        self.calls, self.released, self.ended = [], [], 0

    def _grow(self):
        self.tokens += [7] * self.per_stage

    def precopy(self, mid):
        self.calls.append("precopy")
        if "precopy" in self.fail:
            raise ChannelError("refused")
        self._grow()
        return lease(self.tokens, (len(self.tokens) - 2) // BS * BS)

    def release(self, lease_id):
        self.released.append(lease_id)

    def stop(self, mid):
        self.calls.append("stop")
        if "stop" in self.fail:
            raise ChannelError("down")
        return "finished" not in self.fail

    def take(self, mid):
        self.calls.append("take")
        if "take" in self.fail:
            raise ChannelError("dead")
        return lease(self.tokens, len(self.tokens) - 1)

    def end(self, mid):
        self.ended += 1


class FakeDriver:
    def __init__(self, source, seen=None, resume_ok=True, load_ok=True):
        self.source, self.seen, self.resume_ok, self.load_ok = source, seen, resume_ok, load_ok
        self.loads, self.resumed, self.done = [], [], False

    def finished(self):
        return self.done

    async def load(self, destination, token_ids, params):
        self.loads.append((token_ids, params))
        return self.load_ok

    async def stop(self):
        return True

    def tokens(self):
        return list(self.source.tokens if self.seen is None else self.seen)

    async def resume(self, destination, params):
        self.resumed.append(params)
        return self.resume_ok


def run(source, driver, **kw):
    record = live.Record("ab" * 16, "cmpl-1", "A", "B")
    return asyncio.run(live.migrate(record, source, driver, next_migration_id="cd" * 16, **kw))


def test_precopy_stages_then_a_stop_that_moves_the_rest():
    src = FakeSource(list(range(3, 40)), per_stage=12)
    drv = FakeDriver(src)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert rec.outcome == live.Outcome.MOVED and src.calls == ["precopy"] * 3 + ["stop", "take"]
    assert [s.new_blocks for s in rec.stages] == [11, 3, 3]
    for tokens, params in drv.loads:  # each stage: whole blocks, plus the next token
        assert params["remote_num_tokens"] % BS == 0 and len(tokens) == params["remote_num_tokens"] + 1
        assert len(params["remote_block_ids"]) == params["remote_num_tokens"] // BS
    final = drv.resumed[0]
    assert final["remote_num_tokens"] == len(src.tokens) - 1 and final["migration_id"] == "cd" * 16
    assert rec.moved_tokens == len(src.tokens) - 1 and src.ended == 1


def test_a_stage_with_few_new_blocks_is_skipped_and_released():
    src = FakeSource(list(range(3, 40)), per_stage=1)
    drv = FakeDriver(src)
    rec = run(src, drv, max_stages=3, last_stage_max_blocks=2)
    assert len(rec.stages) == 1 and len(src.released) == 1 and rec.outcome == live.Outcome.MOVED


def test_no_precopy_is_stop_and_copy():
    src = FakeSource(list(range(3, 30)), fail={"precopy"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.stages == [] and drv.loads == [] and rec.outcome == live.Outcome.MOVED


def test_the_router_saw_fewer_tokens_than_the_source_computed():
    src = FakeSource(list(range(3, 30)), fail={"precopy"})
    seen = src.tokens[:20]
    drv = FakeDriver(src, seen=seen)
    rec = run(src, drv)
    assert drv.resumed[0]["remote_num_tokens"] == 20 and rec.moved_tokens == 20


def test_a_dead_source_after_the_stop_is_recomputed():
    src = FakeSource(list(range(3, 30)), fail={"precopy", "take"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.RECOMPUTED and drv.resumed == [{"migration_id": "cd" * 16}]
    assert "no final lease" in rec.reason


def test_a_source_that_cannot_arm_keeps_the_request():
    src = FakeSource(list(range(3, 30)), fail={"stop"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.STAYED and drv.resumed == [] and src.ended == 1


def test_a_request_that_ended_first_finishes_where_it_was():
    src = FakeSource(list(range(3, 30)), fail={"finished"})
    drv = FakeDriver(src)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.FINISHED and drv.resumed == []


def test_a_destination_that_does_not_resume_fails_the_migration():
    src = FakeSource(list(range(3, 30)))
    drv = FakeDriver(src, resume_ok=False)
    rec = run(src, drv)
    assert rec.outcome == live.Outcome.FAILED and src.ended == 1


@pytest.mark.parametrize("theirs,ours,want", [([1, 2, 3, 4], [1, 2, 3, 4, 5], 4), ([1, 2, 9, 4], [1, 2, 3, 4], 2),
                                              ([1, 2, 3, 4, 5], [1, 2], 2)])
def test_agreed_tokens(theirs, ours, want):
    assert live.agreed_tokens(lease(theirs, len(theirs)), ours) == want
