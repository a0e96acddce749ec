"""The router's OpenAI stream codec without I/O: backend chunks of both APIs, stop strings
across pieces (and across a hand-off), the client's chunks and its answer."""

import json

import pytest

from vllm_ext.router.openai import ClientStream, Piece, parse_chunk


def piece(text, ids, finish=None):
    p = Piece()
    p.text, p.token_ids, p.finish_reason = text, list(ids), finish
    return p


def events(data: bytes):
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


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


def logprobs(tokens, first_offset=0):
    """A completions stream chunk's logprobs as vLLM writes them: text_offset goes on within
    the stream by each token's string."""
    offsets = []
    for token in tokens:
        offsets.append(first_offset)
        first_offset += len(token)
    return {"text_offset": offsets, "token_logprobs": [-1.0] * len(tokens), "tokens": list(tokens),
            "top_logprobs": [None] * len(tokens)}


def test_completion_answer_merges_logprobs_with_offsets():
    c = ClientStream("cmpl-3", False, "m", want_ids=False, want_usage=True)
    a, b = piece("xy", [1]), piece("z", [2], finish="length")
    a.logprobs, b.logprobs = logprobs(["xy"]), logprobs(["z"], 2)
    b.logprobs["token_logprobs"] = [-2.0]
    c.begin_leg()
    c.add(a)
    c.add(b)
    lp = c.answer()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 2] and lp["token_logprobs"] == [-1.0, -2.0]


def test_logprobs_offsets_go_on_across_legs_streamed_and_in_the_answer():
    # each leg's offsets start at 0; the client's go on from where the last token's string ended
    # (a special token's string counts, though the text skips it: as one vLLM stream's would)
    c = ClientStream("cmpl-4", False, "m", want_ids=False, want_usage=True, stops=["QQQ"])
    c.begin_leg()
    first = [piece("ab", [1]), piece(" c", [2]), piece("", [3])]
    for p, lp in zip(first, (logprobs(["ab"]), logprobs([" c"], 2), logprobs(["<x>"], 4))):
        p.logprobs = lp
    out = b"".join(c.add(p) for p in first)
    c.begin_leg()  # a hand-off: the resumed leg's stream starts again at 0
    second = [piece("de", [4, 5]), piece("f", [6], finish="length")]
    second[0].logprobs, second[1].logprobs = logprobs(["d", "e"]), logprobs(["f"], 2)
    out += b"".join(c.add(p) for p in second) + c.end()
    streamed = [o for e in events(out) if e["choices"] and e["choices"][0]["logprobs"]
                for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == [0, 2, 4, 7, 8, 9]
    assert c.answer()["choices"][0]["logprobs"]["text_offset"] == [0, 2, 4, 7, 8, 9]
    assert c.text == "ab cdef"


def test_logprobs_offsets_follow_the_tokens_strings_however_a_backend_chunked_them():
    # a byte-level model: a character's bytes are tokens whose strings are "" (vLLM's), the
    # character comes with the last one. vLLM 0.26 starts each stream chunk's offsets at the
    # length of the text it sent so far, so they depend on how tokens were grouped in chunks;
    # the client's go on by each token's string (as vLLM 0.32's stream and every non-streamed
    # answer): the same for every grouping, and across a hand-off
    tokens, texts = ["a", "", "", "b", "", "c"], ["a", "", "é", "b", "", "çc"]
    want = [0, 1, 1, 1, 2, 2]
    for groups in ([[0], [1], [2], [3], [4], [5]], [[0, 1], [2, 3, 4], [5]], [[0], [1, 2, 3, 4, 5]]):
        for hand_off in range(len(groups)):
            c = ClientStream("cmpl-x", False, "m", want_ids=True, want_usage=False)
            streamed, leg_text = [], 0
            for g, group in enumerate(groups):
                if g in (0, hand_off):
                    c.begin_leg()
                    leg_text = 0
                p = piece("".join(texts[i] for i in group), group)
                p.logprobs = logprobs([tokens[i] for i in group], leg_text)  # vLLM 0.26's rule
                leg_text += len(p.text)
                streamed += [o for e in events(c.add(p)) for o in e["choices"][0]["logprobs"]["text_offset"]]
            assert streamed == want, (groups, hand_off)
            assert c.answer()["choices"][0]["logprobs"]["text_offset"] == want


def test_a_stop_string_counts_only_past_min_tokens():
    c = ClientStream("cmpl-5", False, "m", want_ids=True, want_usage=False, stops=["ab"], min_tokens=2)
    for text, ids in (("ab", [1]), ("c", [2]), ("ab", [3]), ("z", [4])):
        c.add(piece(text, ids))
    assert c.text == "abc" and c.token_ids == [1, 2, 3] and c.stop_reason == "ab"
    # one that ends in the min_tokens-th token's text does not count, one that ends after does
    # (the text searched starts in the earlier tokens', as vLLM's does)
    c = ClientStream("cmpl-6", False, "m", want_ids=False, want_usage=False, stops=["ab"], min_tokens=1)
    c.add(piece("ab", [1]))
    c.add(piece("xa", [2]))
    assert not c.finished
    c.add(piece("b", [3]))
    assert c.text == "abx" and c.finish_reason == "stop"
    # the min_tokens-th token inside a piece of several: its logprobs' tokens say where it ends
    c = ClientStream("cmpl-7", False, "m", want_ids=True, want_usage=False, stops=["ab"], min_tokens=2)
    p = piece("abab", [1, 2, 3])
    p.logprobs = logprobs(["a", "b", "ab"])
    c.add(p)
    assert c.text == "ab" and c.token_ids == [1, 2, 3] and c.finish_reason == "stop"
    assert ClientStream("x", False, "m", False, False).min_tokens == 0


def test_tokens_after_the_one_that_completes_a_stop_string_are_dropped():
    c = ClientStream("cmpl-8", False, "m", want_ids=True, want_usage=True, stops=["STOP"])
    p = piece("abSTOPcd", [1, 2, 3, 4])
    p.logprobs = logprobs(["ab", "ST", "OP", "cd"])
    evs = events(c.add(p))
    assert c.text == "ab" and c.token_ids == [1, 2, 3] and c.usage()["completion_tokens"] == 3
    assert evs[-1]["choices"][0]["token_ids"] == [1, 2, 3]
    assert evs[-1]["choices"][0]["logprobs"]["tokens"] == ["ab", "ST", "OP"]
    assert c.answer()["choices"][0]["logprobs"]["text_offset"] == [0, 2, 4]
    # without each token's text (no logprobs) the tokens of the piece stay: which one completed
    # the stop string is unknown
    c = ClientStream("cmpl-9", False, "m", want_ids=True, want_usage=True, stops=["STOP"])
    c.add(piece("abSTOPcd", [1, 2, 3, 4]))
    assert c.text == "ab" and c.token_ids == [1, 2, 3, 4]


def stopped(text, ids, stop):
    """A piece whose backend ended its leg on `stop` (legs carry the stop strings in the output)."""
    p = piece(text, ids, finish="stop")
    p.stop_reason = stop
    return p


def test_a_stop_string_the_backend_ended_on_keeps_each_token_up_to_it():
    # several tokens in one chunk (its API server fell behind its engine), no logprobs: the
    # backend ended the leg at the token that completes the stop string, its last
    for include in (False, True):
        c = ClientStream("cmpl-11", False, "m", want_ids=True, want_usage=True, stops=["ST", "xyz"],
                         include_stop=include)
        c.begin_leg()
        c.add(piece("ab", [1]))
        evs = events(c.add(stopped("cdST", [2, 3, 4], "ST")))
        assert c.text == ("abcdST" if include else "abcd") and c.token_ids == [1, 2, 3, 4]
        assert (c.finish_reason, c.stop_reason) == ("stop", "ST")
        assert evs[-1]["choices"][0]["stop_reason"] == "ST"


def test_the_backends_stop_string_applies_min_tokens_at_its_token():
    # min_tokens ends inside a chunk of several tokens: the router cannot tell where, the backend
    # can (an earlier match in the chunk lay in the first min_tokens tokens' text)
    c = ClientStream("cmpl-12", False, "m", want_ids=True, want_usage=False, stops=["a"], min_tokens=3)
    c.begin_leg()
    c.add(piece("xy", [1]))
    c.add(stopped("zaba", [2, 3, 4, 5], "a"))
    assert c.text == "xyzab" and c.token_ids == [1, 2, 3, 4, 5] and c.finish_reason == "stop"


def test_a_match_inside_the_min_tokens_of_a_chunk_of_several_is_the_backends_to_judge():
    # the 3rd token ends inside the chunk, where is unknown: its "a" lay in the first min_tokens
    # tokens' text, and the backend, which knows, went on; it ends the leg on a later one
    c = ClientStream("cmpl-14", False, "m", want_ids=True, want_usage=False, stops=["a"], min_tokens=3)
    c.begin_leg()
    c.add(piece("xy", [1]))
    c.add(piece("zab", [2, 3, 4]))
    assert not c.finished and c.token_ids == [1, 2, 3, 4]
    c.add(stopped("ca", [5, 6], "a"))
    assert c.text == "xyzabc" and c.token_ids == [1, 2, 3, 4, 5, 6] and c.stop_reason == "a"
    # the backend's stop string began in the chunk before (a held-back token gave no text)
    for include in (False, True):
        c = ClientStream("cmpl-15", False, "m", want_ids=True, want_usage=False, stops=["ab"], min_tokens=4,
                         include_stop=include)
        c.begin_leg()
        c.add(piece("x", [1]))
        c.add(piece("ya", [2, 3]))
        c.add(stopped("b", [4, 5], "ab"))
        assert c.text == ("xyab" if include else "xy") and c.token_ids == [1, 2, 3, 4, 5], include
        assert (c.finish_reason, c.stop_reason) == ("stop", "ab")


def test_a_stop_string_begun_in_the_last_leg_goes_before_the_backends():
    # the resumed leg's backend never saw the text before its prompt's end: a stop string that
    # straddles the hand-off is the router's, even where the backend ends on a later one
    c = ClientStream("cmpl-13", False, "m", want_ids=True, want_usage=False, stops=["STOP", "q"])
    c.begin_leg()
    c.add(piece("aST", [1]))
    c.begin_leg()
    c.add(stopped("OPbq", [2, 3, 4], "q"))
    assert c.text == "a" and c.stop_reason == "STOP" and c.token_ids == [1, 2, 3, 4]


def test_of_two_stop_strings_the_one_that_ends_first_stops():
    c = ClientStream("cmpl-10", False, "m", want_ids=False, want_usage=False, stops=["abc", "b"])
    c.add(piece("abc", [1]))
    assert c.text == "a" and c.stop_reason == "b"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_the_reasoning_a_servers_parser_splits_off_reaches_the_client(key):
    """A chat delta's reasoning (--reasoning-parser; its field by either of vLLM's names) is
    relayed in the client's delta, apart from the content, and kept in the whole answer."""
    def chunk(**delta):
        return {"id": "x", "choices": [{"index": 0, "delta": delta, "token_ids": [3]}]}

    think, plain = parse_chunk(chunk(**{key: "let me see", "content": None})), parse_chunk(chunk(content="4"))
    assert (think.reasoning, think.reasoning_key, think.text) == ("let me see", key, "")
    assert (plain.reasoning, plain.text) == ("", "4")
    c = ClientStream("r", True, "m", want_ids=False, want_usage=False)
    c.prompt_token_ids = [1]
    first, second = events(c.add(think)), events(c.add(plain))
    assert first[-1]["choices"][0]["delta"] == {"content": "", key: "let me see"}
    assert second[0]["choices"][0]["delta"] == {"content": "4"}
    message = c.answer()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4", key: "let me see"}
    assert c.token_ids == [3, 3]


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
