"""A request whose prompt ends inside a character (a move inside a held-back run) gets only its
new text from vLLM's fast detokenizer once the connector's plugin primed it
(vllm_ext/connector/detokenize.py): at random cut points of random multi-byte text, the text the
source emitted before the cut plus the text the destination emits after it equal the text of
one unmoved stream, with a byte-level tokenizer and with the real model's; the same for vLLM's
slow detokenizer (a Python tokenizer); a stop string begun in the client's text before a
resumed leg ends that leg at the token that completes it; and the router's text over a moved
request's legs, stop strings and min_tokens applied in chunks of several tokens, is the unmoved
request's."""

import os
import random
from types import SimpleNamespace

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from tokenizers.decoders import DecodeStream  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.engine.detokenizer import IncrementalDetokenizer  # noqa: E402

from vllm_ext import fleet  # noqa: E402
from vllm_ext.connector import detokenize, register  # noqa: E402
from vllm_ext.fleet import tokenizers  # noqa: E402

ALPHABET = "ab é\nçü中文日本語🙂👍🏽ok, ∑"  # 1- to 4-byte characters, and a multi-codepoint emoji
CUTS = 400


@pytest.fixture(scope="module", params=["byte_level", "smollm2"])
def tokenizer(request):
    if request.param == "byte_level":
        return tokenizers.byte_level()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fleet.real_model_folder(say=lambda message: None))


def _emitted(tok, ids):
    """The text one unmoved stream emits for `ids`, token by token (what the source sent)."""
    stream = DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(tok, token_id) or "" for token_id in ids)


def _cuts(tokenizer, seed):
    """(token ids of random multi-byte text, a cut point inside them), endlessly."""
    rng = random.Random(seed)
    while True:
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 60)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= 3:
            yield ids, rng.randint(1, len(ids) - 1)


def _resumed_text(tokenizer, prompt_ids, new_ids):
    """What vLLM's detokenizer emits for `new_ids` after a request whose prompt is `prompt_ids`."""
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), prompt_embeds=None,
                              sampling_params=SamplingParams(max_tokens=len(new_ids) + 1, skip_special_tokens=True))
    detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
    return "".join(detok.decode_next(token_id) for token_id in new_ids)


def test_the_primed_stream_continues_exactly_where_the_source_stopped(tokenizer):
    tok = tokenizer.backend_tokenizer
    cuts, native_wrong, inside = _cuts(tokenizer, seed=random.randrange(1 << 30)), 0, 0
    for _ in range(CUTS):
        ids, cut = next(cuts)
        want = _emitted(tok, ids)
        before = _emitted(tok, ids[:cut])
        inside += bool(detokenize.held_back(tok, ids[:cut], True))
        stream = detokenize.primed_stream(tok, ids[:cut], True) or DecodeStream(ids=ids[:cut], skip_special_tokens=True)
        assert before + "".join(stream.step(tok, t) or "" for t in ids[cut:]) == want, (ids, cut)
        native = DecodeStream(ids=ids[:cut], skip_special_tokens=True)
        native_wrong += before + "".join(native.step(tok, t) or "" for t in ids[cut:]) != want
    assert inside >= CUTS // 10, inside  # the cuts fell inside held-back runs often enough to test them
    assert native_wrong > 0  # vLLM's own priming gets these wrong: what install() fixes


def test_vllms_detokenizer_resumes_exactly_once_the_plugin_is_registered(tokenizer):
    register()
    cuts = _cuts(tokenizer, seed=random.randrange(1 << 30))
    tok = tokenizer.backend_tokenizer
    for _ in range(CUTS // 4):
        ids, cut = next(cuts)
        assert _emitted(tok, ids[:cut]) + _resumed_text(tokenizer, ids[:cut], ids[cut:]) == _emitted(tok, ids)


def test_a_cut_in_a_long_run_of_broken_characters_resumes_exactly():
    """Bytes that no later token completes (invalid UTF-8: multi-byte text with tokens dropped,
    as a random byte-level model writes it) keep a stream's text held back for as long as it
    ends in U+FFFD, over any number of tokens: a cut anywhere in such a run resumes exactly."""
    tokenizer = tokenizers.byte_level()
    tok = tokenizer.backend_tokenizer
    rng = random.Random(random.randrange(1 << 30))
    longest, cuts = 0, 0
    # CUTS // 4 cuts, and more until one fell in a run longer than any character's bytes (a random
    # one does not always: 1 run in about 20 had none longer than 8 tokens)
    while cuts < CUTS // 4 or longest <= 8 and cuts < 4 * CUTS:
        cuts += 1
        ids = [t for t in tokenizer.encode("ok " + "中文日本語🙂👍🏽∑" * 6, add_special_tokens=False)
               if rng.random() < 0.8]
        cut = rng.randint(1, len(ids) - 1)
        held = detokenize.held_back(tok, ids[:cut], True)
        longest = max(longest, held)
        stream = detokenize.primed_stream(tok, ids[:cut], True) or DecodeStream(ids=ids[:cut], skip_special_tokens=True)
        assert _emitted(tok, ids[:cut]) + "".join(stream.step(tok, t) or "" for t in ids[cut:]) == _emitted(tok, ids), \
            (ids, cut)
    assert longest > 8, longest  # runs longer than any character's bytes were cut


def replacing_byte_tokenizer():
    """A Python (not `tokenizers`-backed) byte tokenizer, ByT5's, whose decode writes U+FFFD for
    bytes that are no character yet, as most do: vLLM detokenizes it with its slow path."""
    from transformers import ByT5Tokenizer

    class ReplacingByteTokenizer(ByT5Tokenizer):
        def convert_tokens_to_string(self, tokens):
            data = b"".join(bytes([ord(t)]) if len(t) == 1 and ord(t) < 256 else t.encode() for t in tokens)
            return data.decode("utf-8", errors="replace")

    return ReplacingByteTokenizer()


def _updated_text(tokenizer, prompt_ids, new_ids, **params):
    """What vLLM's detokenizer emits for `new_ids`, one update per token (as its engine's steps
    give them), after a request whose prompt is `prompt_ids`; and the detokenizer."""
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), prompt_embeds=None,
                              sampling_params=SamplingParams(max_tokens=len(new_ids) + 1, skip_special_tokens=True,
                                                             **params))
    detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
    for token_id in new_ids:
        detok.update([token_id], False)
    return detok.output_text


def test_vllms_slow_detokenizer_resumes_exactly_once_the_plugin_is_registered():
    """The slow path's own priming drops the text held back at the cut (its first step
    compares the length of the text with and without the new token)."""
    register()
    tokenizer = replacing_byte_tokenizer()
    assert type(IncrementalDetokenizer.from_new_request(tokenizer, SimpleNamespace(
        request_id="r", prompt_token_ids=[5], prompt_embeds=None, sampling_params=SamplingParams()))).__name__ \
        == "SlowIncrementalDetokenizer"
    rng, inside = random.Random(random.randrange(1 << 30)), 0
    start = tokenizer.encode("x", add_special_tokens=False)
    for _ in range(CUTS // 4):
        ids = tokenizer.encode("".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 30))),
                               add_special_tokens=False)
        cut = rng.randint(1, len(ids) - 1)
        inside += bool(detokenize.held_back(tokenizer, start + ids[:cut], True))
        want = _updated_text(tokenizer, start, ids)
        assert _updated_text(tokenizer, start, ids[:cut]) + _updated_text(tokenizer, start + ids[:cut], ids[cut:]) \
            == want, (ids, cut)
    assert inside >= CUTS // 40, inside


@pytest.mark.parametrize("tokenizer", ["byte_level", "smollm2"], indirect=True)
def test_a_stop_string_that_straddles_a_resume_ends_it_at_its_token(tokenizer):
    """A resumed leg given the client's text before it (vllm_xargs STOP_PREFIX, as the router
    sends) ends at the token that completes a stop string begun in that text, with the unmoved
    request's token ids (vLLM alone looks in the leg's own text only, and runs on)."""
    from vllm_ext.router import legs

    assert legs.STOP_PREFIX == detokenize.STOP_PREFIX
    register()
    tok = tokenizer.backend_tokenizer
    rng, checked = random.Random(random.randrange(1 << 30)), 0
    while checked < CUTS // 8:
        ids = tokenizer.encode("".join(rng.choice(ALPHABET) for _ in range(60)), add_special_tokens=False)
        text = _emitted(tok, ids)
        ends = [len(_emitted(tok, ids[:k])) for k in range(1, len(ids) + 1)]
        n = rng.randrange(len(ids) // 3, len(ids) - 2)  # the stop string completes in the n-th token's text
        if ends[n - 1] == ends[n - 2]:
            continue
        stop = text[max(0, ends[n - 1] - rng.randint(2, 8)):ends[n - 1]]
        if text.find(stop) != ends[n - 1] - len(stop):
            continue  # it occurs earlier: the unmoved request stops there
        began = next(k for k in range(1, n + 1) if ends[k - 1] > ends[n - 1] - len(stop))
        if began >= n:
            continue  # in one token's text: nothing to straddle
        cut = rng.randrange(began, n)  # the client has the stop string's first characters, not its last
        prompt = tokenizer.encode("q", add_special_tokens=False)
        sent = _emitted(tok, ids[:cut])
        for per_step in (1, 3):
            request = SimpleNamespace(request_id="r", prompt_token_ids=prompt + ids[:cut], prompt_embeds=None,
                                      sampling_params=SamplingParams(
                                          max_tokens=len(ids), skip_special_tokens=True, stop=[stop],
                                          include_stop_str_in_output=True,
                                          extra_args={legs.STOP_PREFIX: legs.stop_prefix({"stop": stop}, sent)}))
            detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
            rest, found = ids[cut:], None
            while rest and found is None:
                found = detok.update(rest[:per_step], False)
                rest = rest[per_step:]
            assert found == stop, (stop, sent, per_step)
            # several tokens in one step (speculative decoding): vLLM releases differ in whether
            # they drop those after the one that completes the stop string
            kept = detok.output_token_ids if per_step == 1 else detok.output_token_ids[:n - cut]
            assert kept == ids[cut:n], (stop, cut, n, per_step)
            assert sent + detok.output_text == text[:ends[n - 1]]
        checked += 1


def _leg(tokenizer, prompt_ids, new_ids, leg, chunk):
    """The router's pieces of a leg (`leg`: its body, legs.py) whose engine generates `new_ids`
    after `prompt_ids`, one token a step, its API server sending chunk() steps a chunk (it falls
    behind its engine); the leg ends where vLLM's detokenizer finds a stop string."""
    from vllm_ext.router.openai import Piece

    params = SamplingParams(max_tokens=len(new_ids) + 1, skip_special_tokens=True, stop=leg.get("stop"),
                            include_stop_str_in_output=bool(leg.get("include_stop_str_in_output")),
                            min_tokens=leg.get("min_tokens") or 0, extra_args=leg.get("vllm_xargs"))
    detok = IncrementalDetokenizer.from_new_request(tokenizer, SimpleNamespace(
        request_id="r", prompt_token_ids=list(prompt_ids), prompt_embeds=None, sampling_params=params))
    pieces, taken, stop = [], 0, None
    while taken < len(new_ids) and stop is None:
        piece, count = Piece(), len(detok.output_token_ids)
        for token_id in new_ids[taken:taken + chunk()]:
            taken += 1
            stop = detok.update([token_id], False)
            if stop is not None:
                piece.finish_reason, piece.stop_reason = "stop", stop
                break
        piece.token_ids = detok.output_token_ids[count:]
        piece.text = detok.get_next_output_text(stop is not None, delta=True)
        pieces.append(piece)
    return pieces, detok


def test_a_moved_requests_stop_strings_past_min_tokens_are_the_unmoved_ones():
    """The router's text over a request's legs, moved at a random point, with stop strings
    (U+FFFD, or 1-3 characters of the text) and min_tokens, its backends' API servers sending
    several tokens a chunk: the text and token ids of vLLM's unmoved request. A random
    byte-level model's text (bytes that are no character) spells no token's text, so where
    the min_tokens-th token ends in a chunk is the backend's to say: a match in the first
    min_tokens tokens' text does not stop the request, and one the backend ended on that began
    in the chunk before does."""
    from vllm_ext.router import legs
    from vllm_ext.router.openai import ClientStream

    register()
    tokenizer = tokenizers.byte_level()
    rng = random.Random(random.randrange(1 << 30))
    alphabet = [tokenizer.encode(ch, add_special_tokens=False) for ch in ALPHABET]
    prompt = tokenizer.encode("q é中", add_special_tokens=False)
    masked = 0

    def chunk():  # steps a backend's chunk holds
        return rng.choice([1, 2, 3, 5])

    for _ in range(CUTS // 2):
        # multi-byte characters with bytes dropped: text full of U+FFFD
        out = [t for ch in rng.choices(alphabet, k=60) for t in ch if rng.random() < 0.8][:100]
        text = _emitted(tokenizer.backend_tokenizer, prompt + out)[len(_emitted(tokenizer.backend_tokenizer, prompt)):]
        stop = detokenize.REPLACEMENT if rng.random() < 0.5 or len(text) < 8 else \
            text[rng.randrange(len(text) // 2, len(text) - 3):][:rng.randint(1, 3)]
        include = rng.random() < 0.5
        body = {"stop": [stop], "min_tokens": rng.randrange(10, len(out) // 2), "max_tokens": len(out),
                "include_stop_str_in_output": include}
        unmoved, want = _leg(tokenizer, prompt, out, dict(body), lambda: 1)
        masked += stop in (want.output_text[:-len(stop)] if include else want.output_text)
        client = ClientStream("r", False, "m", want_ids=True, want_usage=False, stops=[stop], include_stop=include,
                              min_tokens=body["min_tokens"])
        switch = rng.randrange(1, len(out))  # the client's tokens when the source stops
        client.begin_leg()
        for piece in _leg(tokenizer, prompt, out, legs.first_leg_body(body, {}), chunk)[0]:
            if len(client.token_ids) >= switch or client.finished:
                break
            client.add(piece)
        if not client.finished:
            given = len(client.token_ids)
            leg = legs.resume_leg_body(body, len(out), prompt + out[:given], given, None, text=client.text)
            client.begin_leg()
            for piece in _leg(tokenizer, prompt + out[:given], out[given:], leg, chunk)[0]:
                client.add(piece)
        context = (stop, body, switch)
        assert client.text == want.output_text, context
        assert client.token_ids == want.output_token_ids, context
        assert client.stop_reason == unmoved[-1].stop_reason, context
    assert masked >= CUTS // 20, masked  # min_tokens masked earlier matches often enough to test them


def test_a_resumed_legs_logprobs_complete_a_character_begun_before_it():
    """vLLM completes a logprob's token string from the request's sampled tokens only: a resumed
    leg whose first token completes a character begun before the hand-off (in its prompt) got "",
    where the unmoved request got the character. With the router's GENERATED count the patched
    processor looks back at those prompt tokens as at sampled ones."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    assert detokenize.install()
    tokenizer = tokenizers.byte_level()
    for text in ("ok 中", "ok 🙂", "ok ږ"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt, last = ids[:-1], ids[-1]  # the hand-off falls before the character's last byte
        alone = tokenizer.decode([last])
        assert alone.endswith(detokenize.REPLACEMENT), alone

        def processor(xargs, prompt=prompt):
            params = SamplingParams(max_tokens=4, logprobs=1, extra_args=xargs)
            request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=params)
            return LogprobsProcessor.from_new_request(tokenizer, request)

        assert processor(None)._verify_tokens([alone], [last]) == [""]  # vLLM's own: no sampled context
        char = text[-1]
        assert processor({detokenize.GENERATED: len(char.encode()) - 1})._verify_tokens([alone], [last]) == [char]
        assert processor({detokenize.GENERATED: 9})._verify_tokens([alone], [last]) == [char]
        # prompt logprobs look back at the prompt alone, as vLLM's own
        resumed = processor({detokenize.GENERATED: 9})
        assert resumed._get_sampled_context_ids(resumed.prompt_logprobs) == \
            LogprobsProcessor._get_sampled_context_ids(resumed.prompt_logprobs)
        assert resumed._get_sampled_context_ids([{t: None} for t in (7, 8)]) == [7, 8]
