"""What the router does to the OpenAI streams it relays, without I/O: which requests it may
migrate (and why not), the body of each leg, reading a backend's chunks, writing the client's
(streamed or one answer), and the stop strings that straddle a hand-off.

Every migratable request is streamed from its backends (`return_token_ids`, usage), whatever
the client asked: the router must know each token id it relayed. The client gets its own
format: the router's request id, one role chunk (chat), token ids only if it asked, usage once
(prompt = its own prompt), and one finish.

Stop strings are the router's, not the backends' (they are not sent to them): a stop string
may straddle a hand-off, and a backend holds back the text that might begin one, which an
abort would lose. The router applies them as vLLM does: the text ends before the stop string
(or after it, with include_stop_str_in_output), finish_reason "stop", stop_reason the string,
and text that may begin a stop string is held back until it cannot.
"""

import json
import time
from typing import Any, Dict, List, Optional

# Sampling fields a resumed leg carries over unchanged (they mean the same on the destination,
# where the tokens generated so far are part of the prompt).
CARRIED = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "logprobs",
           "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
           "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "user", "seed")
# Fields that only shape the first leg (the prompt, the client's own stream): not carried.
FIRST_LEG_ONLY = ("model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                  "min_tokens", "n", "echo", "return_token_ids", "kv_transfer_params", "prompt_logprobs",
                  "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                  "chat_template_kwargs", "request_id", "priority", "top_logprobs",
                  "frequency_penalty", "presence_penalty", "best_of", "use_beam_search", "stop")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions


def not_migratable(body: Dict[str, Any], chat: bool) -> Optional[str]:
    """Why a request cannot move between instances (None: it can)."""
    if body.get("n", 1) not in (1, None):
        return "n > 1"
    if body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "beam search / best_of"
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            return f"{name} counts output tokens only: on the destination they became prompt"
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
    """The client's output limit (None: up to the model's length)."""
    if chat:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        value = body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def first_leg_body(body: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    leg = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True,
               kv_transfer_params=params)
    leg.pop("request_id", None)
    leg.pop("stop", None)  # the router's (see above)
    return leg


def resume_leg_body(body: Dict[str, Any], chat: bool, token_ids: List[int], generated: int,
                    params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A /v1/completions body that continues the request from `token_ids` (prompt + the
    `generated` tokens the client got)."""
    leg = {name: body[name] for name in CARRIED if name in body}
    leg.update(model=body.get("model"), prompt=list(token_ids), stream=True,
               stream_options={"include_usage": True}, return_token_ids=True)
    limit = max_new_tokens(body, chat)
    if limit is not None:
        leg["max_tokens"] = max(limit - generated, 1)
    if body.get("min_tokens"):
        leg["min_tokens"] = max(body["min_tokens"] - generated, 0)
    if params is not None and seeded_random(body):
        params = dict(params, sampled_tokens=generated)  # the destination's stream skips their draws
    if params is not None:
        leg["kv_transfer_params"] = params
    return leg


class Piece:
    """What one backend chunk adds: text, token ids, logprobs (completions format), the finish."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "usage")

    def __init__(self):
        self.text = ""
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
            piece.text = (choice["delta"] or {}).get("content") or ""
        else:
            piece.text = choice.get("text") or ""
            if choice.get("prompt_token_ids") is not None:
                piece.prompt_token_ids = choice["prompt_token_ids"]
        piece.token_ids = list(choice.get("token_ids") or [])
        piece.logprobs = choice.get("logprobs")
        piece.finish_reason = choice.get("finish_reason")
        piece.stop_reason = choice.get("stop_reason")
    return piece


def _merge_logprobs(into: Optional[Dict[str, list]], more: Optional[Dict[str, list]], offset: int):
    if more is None:
        return into
    if into is None:
        into = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    into["text_offset"].extend(o + offset for o in more.get("text_offset") or [])
    for key in ("token_logprobs", "tokens", "top_logprobs"):
        into[key].extend(more.get(key) or [])
    return into


def stop_strings(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [x for x in stop or [] if x]


class ClientStream:
    """The client's view of one request: what it got so far, and its chunks in its format."""

    def __init__(self, request_id: str, chat: bool, model: str, want_ids: bool, want_usage: bool,
                 stops: Optional[List[str]] = None, include_stop: bool = False):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.want_ids, self.want_usage = want_ids, want_usage
        self.stops = list(stops or [])
        self.include_stop = include_stop
        # text that may begin a stop string is held back (as vLLM's detokenizer does)
        self._hold = 0 if include_stop or not self.stops else max(len(x) for x in self.stops) - 1
        self.created = int(time.time())
        self.text = ""  # the client's text: sent, and held back
        self._sent = 0
        self.token_ids: List[int] = []
        self.last_token_at: Optional[float] = None  # time.monotonic() of the last token taken
        self.last_gap_s: Optional[float] = None  # between the last two chunks with tokens
        self.prompt_token_ids: Optional[List[int]] = None
        self.logprobs = None
        self.finish_reason = None
        self.stop_reason = None
        self._started = False

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

    def _find_stop(self, searched_from: int) -> None:
        best = None
        for stop in self.stops:
            at = self.text.find(stop, max(0, searched_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[:at + len(stop) if self.include_stop else at]
            self.finish_reason, self.stop_reason = "stop", stop

    def add(self, piece: Piece) -> bytes:
        """Records what the client gets of `piece`; its chunk (b"" when nothing to send). After
        a finish (the backend's or a stop string's) nothing more is taken."""
        if self.finished:
            return b""
        before = len(self.text)
        self.text += piece.text
        self.token_ids.extend(piece.token_ids)
        if piece.token_ids:
            now = time.monotonic()
            if self.last_token_at is not None:
                self.last_gap_s = now - self.last_token_at
            self.last_token_at = now
        if not self.chat:
            self.logprobs = _merge_logprobs(self.logprobs, piece.logprobs, before)
        if self.stops and piece.text:
            self._find_stop(before)
        if not self.finished and piece.finish_reason is not None:
            self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
        upto = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        text, self._sent = self.text[self._sent:upto], max(self._sent, upto)
        if not text and not piece.token_ids and not self.finished:
            return b""
        out = self.start()
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": piece.logprobs, "finish_reason": self.finish_reason}
            if self.want_ids:
                choice["prompt_token_ids"] = None if self._started else self.prompt_token_ids
        if self.finished:
            choice["stop_reason"] = self.stop_reason
        if self.want_ids:
            choice["token_ids"] = piece.token_ids
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
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
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
