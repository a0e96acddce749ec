"""What each leg of a request asks for, without I/O: which requests may move (and why not), the
first leg's and a resumed leg's bodies, and the output limit every leg carries."""

import random

import pytest

from vllm_ext.router import legs


@pytest.mark.parametrize("body,why", [
    ({"prompt": [1, 2], "n": 2}, "n > 1"),
    ({"prompt": [1, 2], "use_beam_search": True}, "beam search"),
    ({"prompt": [1, 2], "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": [1, 2], "presence_penalty": 0.1}, "presence_penalty"),
    ({"prompt": [1, 2], "bad_words": ["no such"]}, "bad_words match output tokens only"),
    ({"prompt": [1, 2], "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"messages": [], "prompt_logprobs": 0}, "prompt_logprobs"),
    ({"prompt": [1, 2], "response_format": {"type": "json_object"}}, "'response_format' is not carried"),
    ({"prompt": [[1, 2], [3]]}, "one prompt"),
    ({"prompt": [1, 2], "stop": 7}, "stop: expected"),
    ({"prompt": [1, 2], "max_tokens": "5"}, "max_tokens: expected an integer"),
    ({"messages": [], "min_tokens": 2.0}, "min_tokens: expected an integer"),
    ({"prompt": [1, 2], "echo": True}, "echo"),
    ({"messages": [], "echo": True}, "echo"),
    ({"prompt": [1, 2], "stream": True, "stream_options": "yes"}, "stream_options: expected an object"),
    ({"prompt": [1, 2], "stream": True, "stream_options": ["include_usage"]}, "stream_options: expected an object"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options without stream"),
    ({"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": "no"}}, "expected booleans"),
    ({"prompt": [1, 2], "stream": True, "stream_options": {"continuous_usage_stats": True}}, "usage once"),
])
def test_requests_that_cannot_move_say_why(body, why):
    assert why in legs.not_migratable(body, chat="messages" in body)


def test_requests_with_harmless_echo_or_stream_options_move():
    for body in ({"prompt": [1], "echo": False}, {"prompt": [1], "stream": True, "stream_options": None},
                 {"prompt": [1], "stream": True, "stream_options": {"include_usage": True}},
                 {"prompt": [1], "stream_options": {}}):
        assert legs.not_migratable(body, chat=False) is None


def resume_leg(body, chat, *args, **kwargs):
    """A resumed leg of a request whose first leg's instance has no generation-config limits."""
    return legs.resume_leg_body(body, legs.output_limit(body, chat), *args, **kwargs)


def test_chat_logprobs_cannot_move_but_completion_logprobs_can():
    assert "logprobs" in legs.not_migratable({"messages": [], "logprobs": True}, chat=True)
    assert legs.not_migratable({"prompt": "a b", "logprobs": 2, "stop": ["x"], "seed": 1, "temperature": 0},
                                  chat=False) is None


def test_a_seeded_request_moves_and_its_resumed_leg_says_how_many_tokens_it_sampled():
    body = {"prompt": [1, 2], "seed": 3, "temperature": 0.8, "max_tokens": 10}
    assert legs.not_migratable(body, chat=False) is None and legs.seeded_random(body)
    leg = resume_leg(body, False, [1, 2, 5, 6, 7], 3, {"migration_id": "ab" * 16})
    assert leg["seed"] == 3 and leg["temperature"] == 0.8 and leg["max_tokens"] == 7
    assert leg["kv_transfer_params"] == {"migration_id": "ab" * 16, "sampled_tokens": 3}
    # greedy (even with a seed) and unseeded requests have no stream to continue
    for other in ({"prompt": [1], "seed": 3, "temperature": 0}, {"prompt": [1], "temperature": 0.8}):
        assert not legs.seeded_random(other)
        assert resume_leg(other, False, [1, 5], 1, {"migration_id": "ab" * 16})[
            "kv_transfer_params"] == {"migration_id": "ab" * 16}
    assert legs.seeded_random({"prompt": [1], "seed": 0})  # the server's default temperature: random


def test_resumed_leg_continues_from_the_tokens_with_the_remaining_budget():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30,
            "min_tokens": 12, "temperature": 0, "stop": ["x"], "top_k": 5, "echo": True, "prompt_logprobs": 1,
            "priority": -3}
    leg = resume_leg(body, True, [1, 2, 3, 4, 5], 4, {"migration_id": "ab" * 16})
    assert leg["prompt"] == [1, 2, 3, 4, 5] and leg["max_tokens"] == 26 and leg["min_tokens"] == 8
    assert leg["top_k"] == 5 and leg["temperature"] == 0 and leg["return_token_ids"] is True and leg["stream"]
    assert leg["priority"] == -3  # under --scheduling-policy priority, it keeps its place on the destination
    assert "echo" not in leg and "prompt_logprobs" not in leg and "messages" not in leg
    assert leg["kv_transfer_params"] == {"migration_id": "ab" * 16}
    # completions without max_tokens, or null: vLLM's default of 16 counts the tokens already given
    assert resume_leg({"prompt": [1]}, False, [1, 9, 9], 2, None)["max_tokens"] == 14
    assert resume_leg({"prompt": [1], "max_tokens": None}, False, [1, 9, 9], 2, None)["max_tokens"] == 14
    # chat: a null max_completion_tokens falls back to max_tokens
    assert legs.max_new_tokens({"max_completion_tokens": None, "max_tokens": 20}, True) == 20
    first = legs.first_leg_body({"prompt": [1], "request_id": "r"}, {"migration_id": "cd" * 16})
    assert "request_id" not in first and first["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("stop", ["x", ["x", "", "yz"]])
def test_every_leg_carries_the_stop_strings_in_its_output(stop):
    """So that no backend holds back text that might begin one (a switch would lose it) and each
    ends its leg at the token that completes one: the router cuts them off itself, or keeps them
    as the client asked."""
    stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    for include in (None, False, True):
        body = {"prompt": [1], "stop": stop, **({} if include is None else {"include_stop_str_in_output": include})}
        assert legs.not_migratable(body, False) is None
        first = legs.first_leg_body(body, {"migration_id": "cd" * 16})
        resumed = resume_leg(body, False, [1, 2], 1, None)
        for leg in (first, resumed):
            assert (leg["stop"], leg["include_stop_str_in_output"]) == (stops, True), leg
    for body in ({"prompt": [1]}, {"prompt": [1], "stop": [], "include_stop_str_in_output": True}):
        for leg in (legs.first_leg_body(body, {"migration_id": "cd" * 16}), resume_leg(body, False, [1, 2], 1, None)):
            assert "stop" not in leg and "include_stop_str_in_output" not in leg, leg


def test_a_resumed_leg_of_a_request_without_a_limit_goes_on_to_the_models_length():
    # vLLM's /v1/completions reads a missing or null max_tokens as 16: the leg asks for the
    # destination's max_model_len, which vLLM clamps to what the prompt leaves
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": None}
    assert legs.max_new_tokens(chat, True) is None
    leg = resume_leg(chat, True, [1, 2, 3, 4, 5], 4, None, max_model_len=4096)
    assert leg["max_tokens"] == 4096 - 5 and "min_tokens" not in leg  # what the model's length leaves
    models = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]}
    assert legs.max_model_len(models, "m") == legs.max_model_len(models) == 4096
    assert legs.max_model_len(models, "other") is None and legs.max_model_len({"data": "x"}) is None
    # max_model_len unknown: the most any instance that can run the leg accepts
    assert resume_leg(chat, True, [1, 2, 3, 4, 5], 4, None)["max_tokens"] == 5
    leg = resume_leg(dict(chat, min_tokens=14), True, [1, 2, 3, 4, 5], 4, None)
    assert leg["max_tokens"] == 10 and leg["min_tokens"] == 10


def test_the_output_limit_is_the_first_legs_as_vllm_derives_it_and_a_resumed_leg_keeps_it():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert legs.output_limit(chat, True) is None
    # no client limit: the instance's generation-config default; the cap bounds every request
    assert legs.output_limit(chat, True, default_max_tokens=300) == 300
    assert legs.output_limit(dict(chat, max_tokens=500), True, 300) == 500
    assert legs.output_limit(dict(chat, max_completion_tokens=500), True, 300, max_tokens_cap=200) == 200
    assert legs.output_limit(chat, True, 0, max_tokens_cap=200) == 200
    assert legs.output_limit(chat, True, 300, max_tokens_cap=200) == 200
    # completions: vLLM's 16 stands for a missing limit, so the default never applies
    assert legs.output_limit({"prompt": [1]}, False, 300) == 16
    assert legs.output_limit({"prompt": [1], "max_tokens": 40}, False, 300, 30) == 30
    # the resumed leg counts the tokens given against the first leg's limit, not the destination's
    leg = legs.resume_leg_body(chat, 300, [1, 2, 3, 4, 5], 4, None, max_model_len=4096)
    assert leg["max_tokens"] == 296
    # never more than the model's length leaves (vLLM 0.26 refuses more)
    assert legs.resume_leg_body(chat, 300, [1, 2, 3, 4, 5], 4, None, max_model_len=100)["max_tokens"] == 95


def test_a_resumed_leg_gets_the_end_of_the_clients_text_its_stop_strings_may_begin_in():
    """vllm_xargs STOP_PREFIX: as many characters as the longest stop string has, less one (the
    connector's detokenizer looks for stop strings across it); none without a stop string of
    two characters or more, nor on a first leg."""
    text = "".join(random.choice("ab中🙂 ") for _ in range(random.randrange(20, 40)))
    for stop, want in (("xyz", text[-2:]), (["q", "", "abcdef"], text[-5:]), ("x", None), ([], None), (None, None)):
        body = {"prompt": [1], "stop": stop}
        leg = legs.resume_leg_body(body, 16, [1, 2], 1, None, text=text)
        assert (leg.get("vllm_xargs") or {}).get(legs.STOP_PREFIX) == want, (stop, leg)
        assert "vllm_xargs" not in legs.first_leg_body(body, {"migration_id": "cd" * 16})
    assert legs.stop_prefix({"stop": "a" * 60}, "short") == "short"
