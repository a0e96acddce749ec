"""What the router does to the OpenAI streams it relays, without I/O: which requests it may
migrate (and why not), the body of each leg, reading a backend's chunks, writing the client's
(streamed or one answer), and the stop strings that straddle a hand-off.

Every migratable request is streamed from its backends (`return_token_ids`, usage), whatever
the client asked: the router must know each token id it relayed. The client gets its own
format: the router's request id, one role chunk (chat), token ids only if it asked, usage once
(prompt = its own prompt), and one finish.

Stop strings are the router's, not the backends' (they are not sent to them): a stop string
may straddle a hand-off, and a backend holds back the text that might begin one, which an
abort would lose. The router applies them as vLLM does: once past min_tokens tokens, the text
ends before the stop string (or after it, with include_stop_str_in_output), finish_reason
"stop", stop_reason the string, no token after the one that completes it (where the router can
tell which: ClientStream._find_stop), and text that may begin a stop string is held back until
it cannot.
"""

import json
import time
from bisect import bisect_left
from typing import Any, Dict, List, Optional

# Sampling fields a resumed leg carries over unchanged (they mean the same on the destination,
# where the tokens generated so far are part of the prompt).
CARRIED = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "logprobs",
           "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
           "repetition_penalty", "logit_bias", "allowed_token_ids", "user", "seed", "priority")
# Fields that only shape the first leg (the prompt, the client's own stream): not carried.
FIRST_LEG_ONLY = ("model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                  "min_tokens", "n", "echo", "return_token_ids", "kv_transfer_params", "prompt_logprobs",
                  "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                  "chat_template_kwargs", "request_id", "top_logprobs", "bad_words",
                  "frequency_penalty", "presence_penalty", "best_of", "use_beam_search", "stop")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions
# The chat delta fields of the reasoning a server's --reasoning-parser splits off the content
# (vLLM's name for it, then the name it had before).
REASONING_KEYS = ("reasoning", "reasoning_content")


def not_migratable(body: Dict[str, Any], chat: bool) -> Optional[str]:
    """Why a request cannot move between instances (None: it can). It is then relayed as is, and
    its instance answers a malformed one."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        return "stream_options: expected an object"
    if opts and not body.get("stream"):
        return "stream_options without stream"
    if opts and any(opts.get(name) not in (None, True, False) for name in ("include_usage", "continuous_usage_stats")):
        return "stream_options: expected booleans"
    if opts and opts.get("continuous_usage_stats"):
        return "stream_options.continuous_usage_stats: the router sends usage once"
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if body.get(name) is not None and (not isinstance(body[name], int) or isinstance(body[name], bool)):
            return f"{name}: expected an integer"
    if body.get("echo"):
        # vLLM blanks an echoed prompt under return_token_ids (which every leg has) and counts its
        # tokens as output; a resumed leg's prompt is another
        return "echo is not carried across a hand-off"
    if body.get("n", 1) not in (1, None):
        return "n > 1"
    if body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "beam search / best_of"
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            return f"{name} counts output tokens only: on the destination they became prompt"
    if body.get("bad_words"):
        return "bad_words match output tokens only: on the destination they became prompt"
    if body.get("prompt_logprobs") is not None:
        # vLLM refuses them on a streamed request, and the router streams every leg it may move
        return "prompt_logprobs are given only to a request that is not streamed"
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        return "chat logprobs are not carried across a hand-off"
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str)
                                                                                        for x in stop))):
        return "stop: expected a string or a list of strings"
    for name in body:
        if name not in CARRIED and name not in FIRST_LEG_ONLY:
            return f"field {name!r} is not carried across a migration"
    if not chat and not isinstance(body.get("prompt"), (str, list)):
        return "prompt: one prompt (a string or a list of token ids) only"
    if not chat and isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
        return "prompt: one prompt only"
    return None


def seeded_random(body: Dict[str, Any]) -> bool:
    """A seed and a temperature above vLLM's greedy threshold (absent: the server's default,
    taken as random): its random stream must go on where it moves (connector/sampling.py)."""
    temperature = body.get("temperature")
    return body.get("seed") is not None and not (isinstance(temperature, (int, float)) and temperature < 1e-5)


def max_new_tokens(body: Dict[str, Any], chat: bool) -> Optional[int]:
    """The client's output limit (None: up to the model's length). As in vLLM, a null limit is
    an absent one: chat's max_completion_tokens falls back to max_tokens, completions' to 16."""
    if chat:
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    else:
        value = body.get("max_tokens")
        if value is None:
            value = DEFAULT_COMPLETION_MAX_TOKENS
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def max_model_len(models: Any, model: Optional[str] = None) -> Optional[int]:
    """The max_model_len of `model` (None: the first model) in an instance's /v1/models answer
    (None when it does not say)."""
    data = models.get("data") if isinstance(models, dict) else None
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and (model is None or card.get("id") == model):
            value = card.get("max_model_len")
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    return None


def first_leg_body(body: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    leg = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True,
               kv_transfer_params=params)
    leg.pop("request_id", None)
    leg.pop("stop", None)  # the router's (see above)
    return leg


def output_limit(body: Dict[str, Any], chat: bool, default_max_tokens: int = 0,
                 max_tokens_cap: int = 0) -> Optional[int]:
    """The output limit an instance's OpenAI server gives `body` (None: up to the model's
    length), as vLLM derives it: the client's (max_new_tokens), else the instance's default (its
    generation config's max_new_tokens), at most the instance's cap (0: none of either)."""
    limit = max_new_tokens(body, chat)
    if limit is None and default_max_tokens > 0:
        limit = default_max_tokens
    if max_tokens_cap > 0:
        limit = max_tokens_cap if limit is None else min(limit, max_tokens_cap)
    return limit


def resume_leg_body(body: Dict[str, Any], limit: Optional[int], token_ids: List[int], generated: int,
                    params: Optional[Dict[str, Any]], max_model_len: Optional[int] = None) -> Dict[str, Any]:
    """A /v1/completions body that continues the request from `token_ids` (prompt + the
    `generated` tokens the client got), under the output limit its first leg had (`limit`,
    output_limit; None: none).

    The leg asks for no more than the destination's `max_model_len` (from its /v1/models) leaves
    after `token_ids`: vLLM refuses more (0.26; later releases clamp it). A request without a
    limit goes on up to the model's length: the leg asks for all of that (vLLM's
    /v1/completions reads a missing or null max_tokens as 16); with `max_model_len` unknown, for
    len(token_ids) (the leg may then end "length" before the model's length)."""
    leg = {name: body[name] for name in CARRIED if name in body}
    leg.update(model=body.get("model"), prompt=list(token_ids), stream=True,
               stream_options={"include_usage": True}, return_token_ids=True)
    min_left = max(body["min_tokens"] - generated, 0) if body.get("min_tokens") else 0
    room = max_model_len - len(token_ids) if max_model_len else None  # what the model's length leaves
    if limit is not None:
        leg["max_tokens"] = max(min(limit - generated, room if room is not None else limit), 1)
    else:
        leg["max_tokens"] = max(room if room is not None else len(token_ids), min_left, 1)
    if body.get("min_tokens"):
        leg["min_tokens"] = min_left
    if params is not None and seeded_random(body):
        params = dict(params, sampled_tokens=generated)  # the destination's stream skips their draws
    if params is not None:
        leg["kv_transfer_params"] = params
    return leg


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

    def begin_leg(self) -> None:
        """A new leg starts: its text_offset (from 0, as each vLLM stream's) go on from the
        previous legs'. vLLM advances them by each token's string, not by the text: the base is
        where the last token's string ends (len(self.text) unless a token's string is not its
        text: a special token skipped, a character in several tokens)."""
        self._leg_offset = self._next_offset

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
        up to the one whose text completes the stop string; None (all of them) when its tokens'
        texts are unknown (several tokens, no logprobs that spell the text)."""
        if count + len(piece.token_ids) <= self.min_tokens:
            return None
        ends = _token_ends(piece, before)
        searched_from = before
        if count < self.min_tokens and ends is not None:
            searched_from = ends[self.min_tokens - count - 1]
        # the min_tokens-th token's end unknown: the whole piece is searched (the client then gets
        # all its tokens, more than min_tokens)
        best = None
        for stop in self.stops:
            at = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best[0] + len(best[1])):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop) if self.include_stop else at]
        self.finish_reason, self.stop_reason = "stop", stop
        return None if ends is None else bisect_left(ends, at + len(stop)) + 1

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
            logprobs = dict(logprobs, text_offset=[o + self._leg_offset for o in logprobs.get("text_offset") or []])
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
