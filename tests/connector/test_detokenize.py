"""A request whose prompt ends inside a character (a move inside a held-back run) gets only its
new text from vLLM's fast detokenizer once the connector's plugin primed it
(vllm_ext/connector/detokenize.py): at random cut points of random multi-byte text, the text the
source emitted before the cut plus the text the destination emits after it equal the text of
one unmoved stream, with a byte-level tokenizer and with the real model's."""

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
    longest = 0
    for _ in range(CUTS // 4):
        ids = [t for t in tokenizer.encode("ok " + "中文日本語🙂👍🏽∑" * 6, add_special_tokens=False)
               if rng.random() < 0.8]
        cut = rng.randint(1, len(ids) - 1)
        held = detokenize.held_back(tok, ids[:cut], True)
        longest = max(longest, held)
        stream = detokenize.primed_stream(tok, ids[:cut], True) or DecodeStream(ids=ids[:cut], skip_special_tokens=True)
        assert _emitted(tok, ids[:cut]) + "".join(stream.step(tok, t) or "" for t in ids[cut:]) == _emitted(tok, ids), \
            (ids, cut)
    assert longest > 8, longest  # runs longer than any character's bytes were cut
