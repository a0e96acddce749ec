"""The OpenAI stream codec of the router, without I/O: reading a backend's chunks (Piece,
parse_chunk) and writing the client's, streamed or as one answer (ClientStream), across the
legs of a request (legs.py says what each leg asks for).

The client gets its own format: the router's request id, one role chunk (chat), token ids only
if it asked, usage once (prompt = its own prompt), and one finish.

Stop strings are the router's: a stop string may straddle a hand-off, and a backend holds back
the text that might begin one, which an abort would lose. So each leg carries them with
include_stop_str_in_output (legs.stop_fields): its backend holds nothing back, and ends the leg
at the token that completes one within the leg's own text (min_tokens applied), which the
router takes as it is. The router applies them itself too, as vLLM does, for one that begins in
an earlier leg's text: once past min_tokens tokens, the text ends before the stop string (or
after it, with include_stop_str_in_output), finish_reason "stop", stop_reason the string, no
token after the one that completes it (where the router can tell which:
ClientStream._find_stop), and text that may begin a stop string is held back until it cannot.
"""

import json
import time
from bisect import bisect_left
from typing import Any, Dict, List, Optional

# The chat delta fields of the reasoning a server's --reasoning-parser splits off the content
# (vLLM's name for it, then the name it had before).
REASONING_KEYS = ("reasoning", "reasoning_content")


class Piece:
    """What one backend chunk adds: text, token ids, logprobs (completions format), the finish."""

    __slots__ = ("text", "reasoning", "reasoning_key", "token_ids", "logprobs", "finish_reason", "stop_reason",
                 "prompt_token_ids", "usage")

    def __init__(self):
        self.text = ""
        self.reasoning = ""  # chat: the reasoning the server's parser split off (under reasoning_key)
        self.reasoning_key = ""
        self.token_ids: List[int] = []
        self.logprobs = None
        self.finish_reason = None
        self.stop_reason = None
        self.prompt_token_ids = None
        self.usage = None


def parse_chunk(data: Dict[str, Any]) -> Piece:
    """One `data:` object of a completions or chat stream (ValueError when malformed)."""
    piece = Piece()
    if not isinstance(data, dict):
        raise ValueError("a stream chunk is not an object")
    if isinstance(data.get("error"), dict):
        raise ValueError(f"the backend reported an error: {str(data['error'].get('message'))[:300]}")
    piece.usage = data.get("usage")
    piece.prompt_token_ids = data.get("prompt_token_ids")
    for choice in data.get("choices") or []:
        if choice.get("index", 0) != 0:
            raise ValueError("a stream chunk of another choice (n > 1)")
        if "delta" in choice:
            delta = choice["delta"] or {}
            piece.text = delta.get("content") or ""
            for key in REASONING_KEYS:
                if delta.get(key):
                    piece.reasoning, piece.reasoning_key = str(delta[key]), key
                    break
        else:
            piece.text = choice.get("text") or ""
            if choice.get("prompt_token_ids") is not None:
                piece.prompt_token_ids = choice["prompt_token_ids"]
        piece.token_ids = list(choice.get("token_ids") or [])
        piece.logprobs = choice.get("logprobs")
        piece.finish_reason = choice.get("finish_reason")
        piece.stop_reason = choice.get("stop_reason")
    return piece


LOGPROBS_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def _merge_logprobs(into: Optional[Dict[str, list]], more: Optional[Dict[str, list]]):
    if more is None:
        return into
    if into is None:
        into = {key: [] for key in LOGPROBS_KEYS}
    for key in LOGPROBS_KEYS:
        into[key].extend(more.get(key) or [])
    return into


def _token_ends(piece: Piece, start: int) -> Optional[List[int]]:
    """Where each of `piece`'s tokens ends in the client's text (its text starts at `start`):
    known for one token, or for several when its logprobs' tokens spell its text; else None."""
    if len(piece.token_ids) == 1:
        return [start + len(piece.text)]
    tokens = piece.logprobs.get("tokens") if isinstance(piece.logprobs, dict) else None
    if not piece.token_ids or not isinstance(tokens, list) or len(tokens) != len(piece.token_ids) \
            or not all(isinstance(t, str) for t in tokens) or "".join(tokens) != piece.text:
        return None
    ends = []
    for token in tokens:
        start += len(token)
        ends.append(start)
    return ends


def stop_strings(body: Dict[str, Any]) -> List[str]:
    """The client's stop strings (ClientStream applies them; no leg carries them)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [x for x in stop or [] if x]


class ClientStream:
    """The client's view of one request: what it got so far, and its chunks in its format."""

    def __init__(self, request_id: str, chat: bool, model: str, want_ids: bool, want_usage: bool,
                 stops: Optional[List[str]] = None, include_stop: bool = False, min_tokens: int = 0):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.want_ids, self.want_usage = want_ids, want_usage
        self.stops = list(stops or [])
        self.include_stop = include_stop
        self.min_tokens = min_tokens or 0  # stop strings count only once past this many tokens
        # text that may begin a stop string is held back (as vLLM's detokenizer does)
        self._hold = 0 if include_stop or not self.stops else max(len(x) for x in self.stops) - 1
        self.created = int(time.time())
        self.text = ""  # the client's text: sent, and held back
        self.reasoning, self.reasoning_key = "", ""  # chat: what the server's reasoning parser split off
        self._sent = 0
        self.token_ids: List[int] = []
        self.last_token_at: Optional[float] = None  # time.monotonic() of the last token taken
        self.last_gap_s: Optional[float] = None  # between the last two chunks with tokens
        self.prompt_token_ids: Optional[List[int]] = None
        self.logprobs = None
        self.finish_reason = None
        self.stop_reason = None
        self._started = False
        self._leg_offset = 0  # added to the current leg's text_offset (begin_leg)
        self._next_offset = 0  # the text_offset that follows the last token's
        self._leg_text = 0  # where the current leg's text begins in the client's

    def begin_leg(self) -> None:
        """A new leg starts: its text_offset (from 0, as each vLLM stream's) go on from the
        previous legs' (_offsets). They advance by each token's string, not by the text: the
        base is where the last token's string ends (len(self.text) unless a token's string is
        not its text: a special token skipped, a character in several tokens)."""
        self._leg_offset = self._next_offset
        self._leg_text = len(self.text)

    def _offsets(self, logprobs: Dict[str, Any]) -> List[int]:
        """The client's text_offset for a piece's tokens: from where the last token's string
        ended, on by each token's string. vLLM 0.32 writes them so in every chunk of a stream
        (its non-streamed answer's are the same); vLLM 0.26 starts each chunk at the length of
        the text it sent so far instead, so its offsets depend on how tokens were grouped into
        chunks (and on a leg's own text, not the client's). Without the tokens' strings, the
        leg's offsets shifted by where its first token began."""
        offsets, tokens = logprobs.get("text_offset") or [], logprobs.get("tokens")
        if not isinstance(tokens, list) or len(tokens) != len(offsets) or not all(isinstance(t, str) for t in tokens):
            return [o + self._leg_offset for o in offsets]
        out, at = [], self._next_offset
        for token in tokens:
            out.append(at)
            at += len(token)
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _chunk(self, choice: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> bytes:
        obj = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if extra:
            obj.update(extra)
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def start(self) -> bytes:
        """The first chunk of a chat stream (the role); b"" for completions."""
        if not self.chat or self._started:
            return b""
        self._started = True
        extra = {"prompt_token_ids": self.prompt_token_ids} if self.want_ids else None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, extra)

    def _find_stop(self, piece: Piece, before: int, count: int) -> Optional[int]:
        """Applies a stop string that `piece` (its text from `before`, after `count` tokens)
        completes, as vLLM's detokenizer does: only one that ends past the text of the
        min_tokens-th token, the one that ends first. How many of its tokens the client keeps:
        up to the one whose text completes the stop string; None (all of them) when that is its
        last (its backend ended the leg on the stop string) or its tokens' texts are unknown
        (several tokens, no logprobs that spell the text)."""
        if count + len(piece.token_ids) <= self.min_tokens:
            return None
        ends = _token_ends(piece, before)
        searched_from = before
        if count < self.min_tokens and ends is not None:
            searched_from = ends[self.min_tokens - count - 1]
        # the min_tokens-th token ends inside the piece, and where is unknown: a match there may lie
        # in the first min_tokens tokens' text. The backend knows (the leg carries the stop
        # strings, its share of min_tokens and, resumed, the text before it): its stop alone counts.
        searched = count >= self.min_tokens or ends is not None
        best = None
        for stop in self.stops if searched else ():
            at = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[0] + len(best[1])):
                best = (at, stop)
        ended = self._backend_stop(piece)
        if ended is not None and (best is None or best[0] >= self._leg_text):
            # the backend found it at its token, the piece's last (the router's own match goes
            # first only where it began in an earlier leg's text, which the backend never saw)
            best, ends = (len(self.text) - len(ended), ended), None
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop) if self.include_stop else at]
        self.finish_reason, self.stop_reason = "stop", stop
        return None if ends is None else bisect_left(ends, at + len(stop)) + 1

    def _backend_stop(self, piece: Piece) -> Optional[str]:
        """The client's stop string that `piece`'s backend ended its leg with (the leg carries
        them in the output: the client's text, `piece`'s included, ends with it; it may begin
        in an earlier piece's), or None."""
        stop = piece.stop_reason
        if piece.finish_reason == "stop" and isinstance(stop, str) and stop in self.stops and self.text.endswith(stop):
            return stop
        return None

    def add(self, piece: Piece) -> bytes:
        """Records what the client gets of `piece`; its chunk (b"" when nothing to send). After
        a finish (the backend's or a stop string's) nothing more is taken."""
        if self.finished:
            return b""
        before, count = len(self.text), len(self.token_ids)
        self.text += piece.text
        if piece.reasoning:
            self.reasoning += piece.reasoning
            self.reasoning_key = piece.reasoning_key
        token_ids, logprobs = piece.token_ids, piece.logprobs
        if not self.chat and isinstance(logprobs, dict):
            logprobs = dict(logprobs, text_offset=self._offsets(logprobs))
        kept = self._find_stop(piece, before, count) if self.stops and piece.text else None
        if kept is not None:
            token_ids = token_ids[:kept]
            if isinstance(logprobs, dict):
                logprobs = {key: value[:kept] if isinstance(value, list) else value for key, value in logprobs.items()}
        self.token_ids.extend(token_ids)
        if token_ids:
            now = time.monotonic()
            if self.last_token_at is not None:
                self.last_gap_s = now - self.last_token_at
            self.last_token_at = now
        if not self.chat and isinstance(logprobs, dict):
            self.logprobs = _merge_logprobs(self.logprobs, logprobs)
            offsets, tokens = logprobs["text_offset"], logprobs.get("tokens")
            if offsets and isinstance(tokens, list) and len(tokens) == len(offsets) and isinstance(tokens[-1], str):
                self._next_offset = offsets[-1] + len(tokens[-1])
        if not self.finished and piece.finish_reason is not None:
            self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
        upto = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        text, self._sent = self.text[self._sent:upto], max(self._sent, upto)
        if not text and not token_ids and not piece.reasoning and not self.finished:
            return b""
        out = self.start()
        if self.chat:
            delta = {"content": text}
            if piece.reasoning:
                delta[piece.reasoning_key] = piece.reasoning
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
            if self.want_ids:
                choice["prompt_token_ids"] = None if self._started else self.prompt_token_ids
        if self.finished:
            choice["stop_reason"] = self.stop_reason
        if self.want_ids:
            choice["token_ids"] = token_ids
        self._started = True
        return out + self._chunk(choice)

    def usage(self) -> Dict[str, int]:
        prompt = len(self.prompt_token_ids or [])
        return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                "total_tokens": prompt + len(self.token_ids)}

    def end(self) -> bytes:
        """The usage chunk (when asked) and [DONE]."""
        out = b""
        if self.want_usage:
            obj = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
            out += b"data: " + json.dumps(obj).encode() + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def answer(self) -> Dict[str, Any]:
        """The whole answer, for a client that did not stream."""
        if self.chat:
            message = {"role": "assistant", "content": self.text}
            if self.reasoning:
                message[self.reasoning_key] = self.reasoning
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        else:
            choice = {"index": 0, "text": self.text, "logprobs": self.logprobs, "finish_reason": self.finish_reason,
                      "stop_reason": self.stop_reason}
        if self.want_ids:
            choice["token_ids"] = self.token_ids
            if not self.chat:
                choice["prompt_token_ids"] = self.prompt_token_ids
        out = {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}
        if self.chat and self.want_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out
