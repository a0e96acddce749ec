"""The demo's move, tried again with a new answer when the answer ended before the move switched
(a busy host: the engine runs ahead of the client); the demo itself runs in tests/e2e/test_demo.py."""

from vllm_ext.fleet import demo


def record(outcome):
    return {"tokens": 5, "gaps": [], "text": "", "record": {"outcome": outcome, "source": "a", "destination": "b"}}


def answers(*outcomes):
    calls = []

    def stream_and_move():
        calls.append(outcomes[len(calls)])
        return record(calls[-1])
    return stream_and_move, calls


def test_an_answer_that_ended_first_is_followed_by_a_new_one_until_one_moves(capsys):
    stream_and_move, calls = answers("finished", "finished", "moved")
    assert demo._move_until_it_switches(stream_and_move, attempts=3)["record"]["outcome"] == "moved"
    assert calls == ["finished", "finished", "moved"]
    out = capsys.readouterr().out
    assert "attempt 2 of 3" in out and "attempt 3 of 3" in out and "outcome moved" in out


def test_a_move_or_a_recompute_is_not_repeated_and_the_attempts_are_bounded():
    for outcome in ("moved", "recomputed"):
        stream_and_move, calls = answers(outcome, "moved")
        assert demo._move_until_it_switches(stream_and_move)["record"]["outcome"] == outcome
        assert calls == [outcome]
    stream_and_move, calls = answers(*["finished"] * 5)
    assert demo._move_until_it_switches(stream_and_move, attempts=3)["record"]["outcome"] == "finished"
    assert len(calls) == 3
