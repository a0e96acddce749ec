"""What the router asks of its backends for one request, without I/O: which requests may move
between instances (and why not), the body of a request's first leg and of a leg that resumes
it elsewhere, and the output limit every leg carries.

Every migratable request is streamed from its backends (`return_token_ids`, usage), whatever
the client asked: the router must know each token id it relayed (openai.py writes the client's
own format). The router applies the client's stop strings (openai.py); every leg carries them
too, with include_stop_str_in_output, so that its backend holds no text back (a switch would
lose it) and ends the leg at the very token that completes one. A resumed leg also gets the end
of the client's text (vllm_xargs STOP_PREFIX): the connector's detokenizer looks for stop
strings across it, so a stop string that straddles the hand-off ends the leg at its token too.
"""

from typing import Any, Dict, List, Optional

from ..lease.kv_params import XARG_GENERATED as GENERATED
from ..lease.kv_params import XARG_STOP_PREFIX as STOP_PREFIX
from .openai import stop_strings

# Sampling fields a resumed leg carries over unchanged (they mean the same on the destination,
# where the tokens generated so far are part of the prompt).
CARRIED = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "logprobs",
           "skip_special_tokens", "spaces_between_special_tokens",
           "repetition_penalty", "logit_bias", "allowed_token_ids", "user", "seed", "priority")
# Fields that only shape the first leg (the prompt, the client's own stream): not carried.
FIRST_LEG_ONLY = ("model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                  "min_tokens", "n", "echo", "return_token_ids", "kv_transfer_params", "prompt_logprobs",
                  "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                  "chat_template_kwargs", "request_id", "top_logprobs", "bad_words",
                  "frequency_penalty", "presence_penalty", "best_of", "use_beam_search")
# Fields the router applies itself (openai.py): each leg carries the values of stop_fields.
ROUTERS_OWN = ("stop", "include_stop_str_in_output")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions


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
        if name not in CARRIED and name not in FIRST_LEG_ONLY and name not in ROUTERS_OWN:
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


def stop_fields(body: Dict[str, Any]) -> Dict[str, Any]:
    """The stop fields of every leg of `body`: the client's stop strings, in the output (the
    router cuts them off unless the client asked otherwise), so that the backend holds back no
    text that might begin one (none when the client has none)."""
    stops = stop_strings(body)
    return {"stop": stops, "include_stop_str_in_output": True} if stops else {}


def first_leg_body(body: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    leg = dict(body, stream=True, stream_options={"include_usage": True}, return_token_ids=True,
               kv_transfer_params=params)
    leg.pop("request_id", None)
    for name in ROUTERS_OWN:
        leg.pop(name, None)
    leg.update(stop_fields(body))
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


def stop_prefix(body: Dict[str, Any], text: str) -> str:
    """The end of the client's `text` that a stop string of `body` may begin in and a resumed
    leg complete: as many characters as the longest has, less one."""
    longest = max((len(x) for x in stop_strings(body)), default=0)
    return text[max(0, len(text) - longest + 1):] if longest > 1 else ""


def resume_leg_body(body: Dict[str, Any], limit: Optional[int], token_ids: List[int], generated: int,
                    params: Optional[Dict[str, Any]], max_model_len: Optional[int] = None,
                    text: str = "") -> Dict[str, Any]:
    """A /v1/completions body that continues the request from `token_ids` (prompt + the
    `generated` tokens the client got), under the output limit its first leg had (`limit`,
    output_limit; None: none).

    The leg asks for no more than the destination's `max_model_len` (from its /v1/models) leaves
    after `token_ids`: vLLM refuses more (0.26; later releases clamp it). A request without a
    limit goes on up to the model's length: the leg asks for all of that (vLLM's
    /v1/completions reads a missing or null max_tokens as 16); with `max_model_len` unknown, for
    len(token_ids) (the leg may then end "length" before the model's length). `text`: the
    client's text so far, whose end (stop_prefix) the leg's stop strings are looked for across."""
    leg = {name: body[name] for name in CARRIED if name in body}
    leg.update(model=body.get("model"), prompt=list(token_ids), stream=True,
               stream_options={"include_usage": True}, return_token_ids=True, **stop_fields(body))
    min_left = max(body["min_tokens"] - generated, 0) if body.get("min_tokens") else 0
    room = max_model_len - len(token_ids) if max_model_len else None  # what the model's length leaves
    if limit is not None:
        leg["max_tokens"] = max(min(limit - generated, room if room is not None else limit), 1)
    else:
        leg["max_tokens"] = max(room if room is not None else len(token_ids), min_left, 1)
    if body.get("min_tokens"):
        leg["min_tokens"] = min_left
    before = stop_prefix(body, text)
    xargs = {**({STOP_PREFIX: before} if before else {}), **({GENERATED: generated} if generated else {})}
    if xargs:
        leg["vllm_xargs"] = xargs
    if params is not None and seeded_random(body):
        params = dict(params, sampled_tokens=generated)  # the destination's stream skips their draws
    if params is not None:
        leg["kv_transfer_params"] = params
    return leg
