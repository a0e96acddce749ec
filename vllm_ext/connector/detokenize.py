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
returns exactly the text the source held back. Other prompts keep vLLM's own stream.
"""

import functools
import logging
from typing import List, Optional

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

WINDOW = 16  # tokens decoded before a point to tell whether the text there ends inside a character
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character


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


def install() -> bool:
    """Primes vLLM's fast incremental detokenizer as above, once per process; False where this
    vLLM has no such class (nothing is changed)."""
    try:
        from vllm.v1.engine import detokenizer
    except ImportError:
        return False
    cls = getattr(detokenizer, "FastIncrementalDetokenizer", None)
    if cls is None:
        return False
    if getattr(cls, "_vllm_ext_primed", False):
        return True
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, tokenizer, request, *args, **kwargs):
        original(self, tokenizer, request, *args, **kwargs)
        prompt_ids: Optional[List[int]] = getattr(request, "prompt_token_ids", None)
        inner = getattr(self, "tokenizer", None)
        if prompt_ids and inner is not None and hasattr(self, "stream"):
            try:
                stream = primed_stream(inner, prompt_ids, bool(getattr(self, "skip_special_tokens", True)))
            except Exception:  # noqa: BLE001 - vLLM's own stream stays; the text may repeat
                logger.exception("vllm-ext: priming the detokenizer of request %s failed",
                                 getattr(request, "request_id", "?"))
                stream = None
            if stream is not None:
                self.stream = stream

    cls.__init__ = __init__
    cls._vllm_ext_primed = True
    return True
