"""A request whose prompt ends inside a character gets only its new text.

A moved request resumes on another instance with the client's prompt plus every token it got
so far as its prompt. When the move falls inside a run of tokens whose bytes are not yet a
whole UTF-8 character (an emoji, CJK, byte-fallback tokens), the source held that text back,
and the destination must emit it, completed, before anything else. vLLM's fast detokenizer
primes tokenizers' DecodeStream with the whole prompt; a stream primed on a prompt that ends
inside a character returns, at the step that completes it, the whole decoded text: the prompt
again and the answer from its start (seen in 143 of 500 random cut points of multi-byte text,
with SmolLM2's tokenizer; every one moved the client's text).

`install()` (run by the connector's `vllm.general_plugins` entry point in every vLLM process,
the API server's too) primes such a stream on the prompt without its trailing incomplete
tokens, then steps through them (they yield nothing): the step that completes the character
returns exactly the text the source held back. Other prompts keep vLLM's own stream. vLLM's
slow (Python) detokenizer, for tokenizers that are not `tokenizers`-backed, loses the same text
(it compares the length of the text with and without the new token): it is primed as a stream
that generated the prompt's last tokens would be (`slow_state`).

vLLM writes a logprob's token string from the token alone, and where that ends inside a
character, completes it from the request's last sampled tokens (not its prompt's). A resumed
leg's first tokens have none: a token that completes a character begun before the hand-off got
"" where the unmoved request's got the character. The router tells a resumed leg how many of its
prompt's tokens were generated (vllm_xargs GENERATED), and the patched logprobs processor looks
back at those as it would at sampled ones (`generated_context`).

A stop string may straddle a hand-off: it begins in the text the client already has and ends in
the destination's. vLLM looks for stop strings in a request's own output text only, so the
router sends a resumed leg the end of the client's text (`vllm_xargs`, key STOP_PREFIX: as many
characters as the longest stop string has, less one) and the patched detokenizer looks for stop
strings in that text followed by the leg's: the leg ends at the very token that completes one,
as the unmoved request does (its token ids, usage, logprobs and finish), not at a later one.
"""

import functools
import logging
from typing import List, Optional, Tuple

from ..lease.kv_params import XARG_GENERATED as GENERATED  # vllm_xargs keys the router writes
from ..lease.kv_params import XARG_STOP_PREFIX as STOP_PREFIX

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

WINDOW = 16  # tokens decoded before a point to tell whether the text there ends inside a character
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character
# vLLM's logprobs complete a token's character from at most this many sampled tokens before it
LOGPROB_CONTEXT = 4


def held_back(tokenizer, prompt_ids: List[int], skip_special_tokens: bool) -> int:
    """How many of the prompt's last tokens a stream that generated them still holds back: those
    after the last point where the text ends on a whole character (0: none). A DecodeStream
    holds text while it ends in U+FFFD (an incomplete character, but also invalid bytes, which
    no later token completes), so such a run can be any length."""
    def ends_inside(end: int) -> bool:
        window = list(prompt_ids[max(0, end - WINDOW):end])
        return tokenizer.decode(window, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT)

    if not ends_inside(len(prompt_ids)):
        return 0
    for end in range(len(prompt_ids) - 1, 0, -1):
        if not ends_inside(end):
            return len(prompt_ids) - end
    return 0  # nothing but such text: vLLM's priming


def primed_stream(tokenizer, prompt_ids: List[int], skip_special_tokens: bool):
    """A DecodeStream primed on the prompt whose first step returns only new text, or None when
    vLLM's own priming already does (the prompt ends on a whole character)."""
    import tokenizers.decoders  # looked up on the module, as vLLM does, so its shims apply

    held = held_back(tokenizer, prompt_ids, skip_special_tokens)
    if not held:
        return None
    clean, tail = list(prompt_ids[:-held]), list(prompt_ids[-held:])
    try:
        stream = tokenizers.decoders.DecodeStream(ids=clean, skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers release without prefill: step through the clean end instead
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in clean[-WINDOW:]:
            stream.step(tokenizer, token_id)
    for token_id in tail:
        stream.step(tokenizer, token_id)  # an incomplete character: nothing comes out
    return stream


def slow_state(tokenizer, prompt_ids: List[int], skip_special_tokens: bool,
               spaces_between_special_tokens: bool) -> Optional[Tuple[List[str], int, int]]:
    """The state of vLLM's slow incremental detokenizer (tokens, prefix offset, read offset) after
    a stream that generated the prompt's last tokens, or None where vLLM's own priming is that
    (the prompt ends on a whole character). Replayed from WINDOW tokens before the held-back run:
    the read offset stays where that run began, so the step that completes its character
    returns exactly the text the source held back."""
    # the names vLLM's detokenizer module uses (their own module moved between releases)
    from vllm.v1.engine.detokenizer import convert_prompt_ids_to_tokens, detokenize_incrementally

    held = held_back(tokenizer, prompt_ids, skip_special_tokens)
    if not held:
        return None
    start = max(0, len(prompt_ids) - held - WINDOW)
    tokens, prefix_offset, read_offset = convert_prompt_ids_to_tokens(tokenizer, list(prompt_ids[:start]),
                                                                      skip_special_tokens=skip_special_tokens)
    for end in range(start + 1, len(prompt_ids) + 1):
        new_tokens, _, prefix_offset, read_offset = detokenize_incrementally(
            tokenizer, list(prompt_ids[:end]), tokens, prefix_offset, read_offset,
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
        tokens.extend(new_tokens)
    return tokens, prefix_offset, read_offset


def stop_prefix(request) -> str:
    """The text before a resumed leg (its vllm_xargs' STOP_PREFIX; "" when none)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    value = extra.get(STOP_PREFIX) if isinstance(extra, dict) else None
    return value if isinstance(value, str) else ""


def generated_context(request) -> List[int]:
    """The tokens a resumed leg's logprobs look back at as sampled ones: its prompt's last
    generated tokens (vllm_xargs GENERATED), at most LOGPROB_CONTEXT ([] for another request)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    n = extra.get(GENERATED) if isinstance(extra, dict) else None
    prompt = getattr(request, "prompt_token_ids", None)
    if type(n) is not int or n <= 0 or not prompt:
        return []
    return [int(t) for t in prompt[-min(n, LOGPROB_CONTEXT, len(prompt)):]]


def _wrap_logprobs(cls) -> None:
    """A LogprobsProcessor made for a resumed leg takes the generated tokens before the hand-off
    as sampled ones where it looks back at its sampled tokens (not at its prompt logprobs), as
    the unmoved request's did."""
    make = cls.from_new_request.__func__

    @functools.wraps(make)
    def from_new_request(klass, tokenizer, request):
        processor = make(klass, tokenizer, request)
        try:
            before = generated_context(request)
            if before:
                processor._get_sampled_context_ids = _with_generated(processor, before)
        except Exception:  # noqa: BLE001 - vLLM's own strings stay
            logger.exception("vllm-ext: the logprobs context of request %s failed", getattr(request, "request_id", "?"))
        return processor

    cls.from_new_request = classmethod(from_new_request)


def _with_generated(processor, before: List[int]):
    """`processor`'s own _get_sampled_context_ids: its sampled logprobs' tokens follow `before`."""
    sampled = type(processor)._get_sampled_context_ids

    def context(logprobs_source, max_context: int = LOGPROB_CONTEXT) -> List[int]:
        ids = sampled(logprobs_source, max_context)
        if logprobs_source is None or logprobs_source is not processor.logprobs:
            return ids
        return (list(before) + list(ids))[-max_context:]

    return context


def _wrap_init(cls, prime) -> None:
    """Runs `prime(detokenizer, request)` after `cls.__init__`; a failure logs and keeps vLLM's state."""
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        request = args[-1] if args else kwargs.get("request")
        try:
            prime(self, request)
        except Exception:  # noqa: BLE001 - vLLM's own state stays; the text may repeat
            logger.exception("vllm-ext: priming the detokenizer of request %s failed",
                             getattr(request, "request_id", "?"))

    cls.__init__ = __init__


def _prime_fast(detok, request) -> None:
    prompt_ids: Optional[List[int]] = getattr(request, "prompt_token_ids", None)
    inner = getattr(detok, "tokenizer", None)
    if prompt_ids and inner is not None and hasattr(detok, "stream"):
        stream = primed_stream(inner, prompt_ids, bool(getattr(detok, "skip_special_tokens", True)))
        if stream is not None:
            detok.stream = stream


def _prime_slow(detok, request) -> None:
    prompt_ids: Optional[List[int]] = getattr(request, "prompt_token_ids", None)
    if prompt_ids and hasattr(detok, "tokens") and hasattr(detok, "read_offset"):
        state = slow_state(detok.tokenizer, prompt_ids, bool(detok.skip_special_tokens),
                           bool(detok.spaces_between_special_tokens))
        if state is not None:
            detok.tokens, detok.prefix_offset, detok.read_offset = state


def _take_stop_prefix(detok, request) -> None:
    detok._vllm_ext_stop_prefix = stop_prefix(request) if getattr(detok, "stop", None) else ""


def _wrap_update(cls) -> None:
    """Stop strings are looked for in the leg's STOP_PREFIX followed by its output text (the
    prefix is there only during the update)."""
    original = cls.update

    @functools.wraps(original)
    def update(self, new_token_ids, stop_terminated):
        before = getattr(self, "_vllm_ext_stop_prefix", "")
        if not before:
            return original(self, new_token_ids, stop_terminated)
        self.output_text = before + self.output_text
        try:
            return original(self, new_token_ids, stop_terminated)
        finally:
            self.output_text = self.output_text[len(before):]

    cls.update = update


def install() -> bool:
    """Patches vLLM's incremental detokenizers and its logprobs processor as above, once per
    process; False where this vLLM has no such detokenizers (nothing is changed)."""
    try:
        from vllm.v1.engine import detokenizer
    except ImportError:
        return False
    base = getattr(detokenizer, "BaseIncrementalDetokenizer", None)
    fast = getattr(detokenizer, "FastIncrementalDetokenizer", None)
    slow = getattr(detokenizer, "SlowIncrementalDetokenizer", None)
    if base is None or fast is None or slow is None:
        return False
    if getattr(base, "_vllm_ext_primed", False):
        return True
    _wrap_init(base, _take_stop_prefix)
    _wrap_update(base)
    _wrap_init(fast, _prime_fast)
    _wrap_init(slow, _prime_slow)
    base._vllm_ext_primed = True
    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        LogprobsProcessor = None
    # releases whose logprobs complete no character from context have nothing to emulate
    if LogprobsProcessor is not None and hasattr(LogprobsProcessor, "_get_sampled_context_ids"):
        _wrap_logprobs(LogprobsProcessor)
    return True
