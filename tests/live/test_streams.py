"""The router's stream handling without I/O: which requests may move, the resumed leg's body,
stop strings across pieces (and across a hand-off), the client's chunks and its answer."""

import json

import pytest

from vllm_ext.router import streams
from vllm_ext.router.streams import ClientStream, Piece, parse_chunk


def piece(text, ids, finish=None):
    p = Piece()
    p.text, p.token_ids, p.finish_reason = text, list(ids), finish
    return p


def events(data: bytes):
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


@pytest.mark.parametrize("body,why", [
    ({"prompt": [1, 2], "n": 2}, "n > 1"),
    ({"prompt": [1, 2], "use_beam_search": True}, "beam search"),
    ({"prompt": [1, 2], "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": [1, 2], "presence_penalty": 0.1}, "presence_penalty"),
    ({"prompt": [1, 2], "response_format": {"type": "json_object"}}, "'response_format' is not carried"),
    ({"prompt": [[1, 2], [3]]}, "one prompt"),
    ({"prompt": [1, 2], "stop": 7}, "stop: expected"),
])
def test_requests_that_cannot_move_say_why(body, why):
    assert why in streams.not_migratable(body, chat=False)


def test_chat_logprobs_cannot_move_but_completion_logprobs_can():
    assert "logprobs" in streams.not_migratable({"messages": [], "logprobs": True}, chat=True)
    assert streams.not_migratable({"prompt": "a b", "logprobs": 2, "stop": ["x"], "seed": 1, "temperature": 0},
                                  chat=False) is None


def test_a_seeded_request_moves_and_its_resumed_leg_says_how_many_tokens_it_sampled():
    body = {"prompt": [1, 2], "seed": 3, "temperature": 0.8, "max_tokens": 10}
    assert streams.not_migratable(body, chat=False) is None and streams.seeded_random(body)
    leg = streams.resume_leg_body(body, False, [1, 2, 5, 6, 7], 3, {"migration_id": "ab" * 16})
    assert leg["seed"] == 3 and leg["temperature"] == 0.8 and leg["max_tokens"] == 7
    assert leg["kv_transfer_params"] == {"migration_id": "ab" * 16, "sampled_tokens": 3}
    # greedy (even with a seed) and unseeded requests have no stream to continue
    for other in ({"prompt": [1], "seed": 3, "temperature": 0}, {"prompt": [1], "temperature": 0.8}):
        assert not streams.seeded_random(other)
        assert streams.resume_leg_body(other, False, [1, 5], 1, {"migration_id": "ab" * 16})[
            "kv_transfer_params"] == {"migration_id": "ab" * 16}
    assert streams.seeded_random({"prompt": [1], "seed": 0})  # the server's default temperature: random


def test_resumed_leg_continues_from_the_tokens_with_the_remaining_budget():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30,
            "min_tokens": 12, "temperature": 0, "stop": ["x"], "top_k": 5, "echo": True, "prompt_logprobs": 1}
    leg = streams.resume_leg_body(body, True, [1, 2, 3, 4, 5], 4, {"migration_id": "ab" * 16})
    assert leg["prompt"] == [1, 2, 3, 4, 5] and leg["max_tokens"] == 26 and leg["min_tokens"] == 8
    assert leg["top_k"] == 5 and leg["temperature"] == 0 and leg["return_token_ids"] is True and leg["stream"]
    assert "stop" not in leg and "echo" not in leg and "prompt_logprobs" not in leg and "messages" not in leg
    assert leg["kv_transfer_params"] == {"migration_id": "ab" * 16}
    # completions without max_tokens: vLLM's default of 16 counts the tokens already given
    assert streams.resume_leg_body({"prompt": [1]}, False, [1, 9, 9], 2, None)["max_tokens"] == 14
    first = streams.first_leg_body({"prompt": [1], "stop": ["x"], "request_id": "r"}, {"migration_id": "cd" * 16})
    assert "stop" not in first and "request_id" not in first and first["stream_options"] == {"include_usage": True}


def test_stop_string_across_pieces_is_cut_and_never_sent_in_part():
    c = ClientStream("cmpl-1", False, "m", want_ids=True, want_usage=True, stops=["STOP"])
    sent = b""
    for text, ids in (("ab", [1]), ("cST", [2]), ("O", [3]), ("Pzz", [4]), ("more", [5])):
        sent += c.add(piece(text, ids))
    got = "".join(e["choices"][0]["text"] for e in events(sent))
    assert got == "abc" and c.text == "abc"
    assert c.finish_reason == "stop" and c.stop_reason == "STOP"
    assert c.token_ids == [1, 2, 3, 4]  # the token that completed the stop string counts; none after
    assert c.usage() == {"prompt_tokens": 0, "completion_tokens": 4, "total_tokens": 4}


def test_stop_string_included_when_asked_and_text_flushed_at_the_end():
    c = ClientStream("cmpl-1", False, "m", want_ids=False, want_usage=False, stops=["ST"], include_stop=True)
    c.add(piece("aS", [1]))
    c.add(piece("Tb", [2]))
    assert c.text == "aST" and c.finish_reason == "stop"
    c = ClientStream("cmpl-2", False, "m", want_ids=False, want_usage=False, stops=["LONGSTOP"])
    out = c.add(piece("abcdefgh", [1])) + c.add(piece("ij", [2], finish="length"))
    assert "".join(e["choices"][0]["text"] for e in events(out)) == "abcdefghij"
    assert c.finish_reason == "length"


def test_chat_chunks_have_one_role_the_routers_id_and_usage_once():
    c = ClientStream("chatcmpl-9", True, "m", want_ids=True, want_usage=True)
    c.prompt_token_ids = [7, 8]
    out = c.start() + c.add(piece(" a", [1])) + c.add(piece(" b", [2], finish="length")) + c.end()
    evs = events(out)
    assert [e["id"] for e in evs] == ["chatcmpl-9"] * 4
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert evs[0]["prompt_token_ids"] == [7, 8]
    assert [e["choices"][0]["delta"]["content"] for e in evs[1:3]] == [" a", " b"]
    assert evs[2]["choices"][0]["finish_reason"] == "length"
    assert evs[3]["choices"] == [] and evs[3]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                          "total_tokens": 4}
    assert out.endswith(b"data: [DONE]\n\n")
    answer = c.answer()
    assert answer["choices"][0]["message"]["content"] == " a b" and answer["object"] == "chat.completion"


def test_completion_answer_merges_logprobs_with_offsets():
    c = ClientStream("cmpl-3", False, "m", want_ids=False, want_usage=True)
    a, b = piece("xy", [1]), piece("z", [2], finish="length")
    a.logprobs = {"text_offset": [0], "token_logprobs": [-1.0], "tokens": ["xy"], "top_logprobs": [None]}
    b.logprobs = {"text_offset": [0], "token_logprobs": [-2.0], "tokens": ["z"], "top_logprobs": [None]}
    c.add(a)
    c.add(b)
    lp = c.answer()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 2] and lp["token_logprobs"] == [-1.0, -2.0]


def test_backend_chunks_of_both_apis_parse():
    p = parse_chunk({"choices": [{"index": 0, "text": " w5", "token_ids": [5], "prompt_token_ids": [1, 2],
                                  "finish_reason": None}]})
    assert (p.text, p.token_ids, p.prompt_token_ids) == (" w5", [5], [1, 2])
    p = parse_chunk({"prompt_token_ids": [3], "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [9],
                                                           "finish_reason": "stop", "stop_reason": 2}]})
    assert (p.text, p.token_ids, p.prompt_token_ids, p.finish_reason) == ("x", [9], [3], "stop")
    with pytest.raises(ValueError, match="another choice"):
        parse_chunk({"choices": [{"index": 1, "text": ""}]})
    with pytest.raises(ValueError, match="error"):
        parse_chunk({"error": {"message": "boom"}})
