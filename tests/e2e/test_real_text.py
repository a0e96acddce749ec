"""The text users read, end to end: a request moved between instances gives the text of an
unmoved one, byte for byte, and so does P/D through the proxy.

Two models, each on two kv_both instances behind the router (live_cluster.py), one class each
(the first class's servers stop before the second's start):
  TestByteLevel   the byte-level tiny chat model (one token per byte, random weights): its
                  output is mostly bytes that are no character yet, so its streams hold text
                  back often; many moves by every way a request moves (pre-copy, stop-and-copy,
                  recompute, a drain, the balancer, a recovery after a cut connection and after
                  a killed instance), chosen to switch inside runs of held-back text;
  TestSlowDetokenizer  the tiny model with a Python byte tokenizer (vLLM's slow detokenizer
                  serves it): moves inside held-back runs;
  TestRealModel   SmolLM2-135M-Instruct in float32 (fleet.real_model_folder: a greedy oracle),
                  a handful of cases: P/D through the proxy (A prefills, B decodes) equal to a
                  single server, and moved chat and completions, streamed and not.
TestByteLevel and TestRealModel run on the CPU and, marked gpu, on one GPU (both instances on
it, float32): tools/gpu/connector-e2e.sh with TESTS=tests/e2e/test_real_text.py.

Where a request switched is known afterwards (its migration's stop_tokens); `held_back` says
whether the client's text then lacked bytes of its last tokens. Prompts and move points are
drawn from a fresh seed, printed with each test (VLLM_EXT_TEST_SEED replays one). Deadlines are
generous, never assertions on speed.
"""

import os
import random
import threading
import time

import pytest

from tests.e2e.live_cluster import Cuttable, Stream, admin, finish, pin_to, require_vllm, start_pair, start_router
from vllm_ext import fleet

require_vllm()

SEED = int(os.environ.get("VLLM_EXT_TEST_SEED") or random.randrange(1 << 30))
LEASE_S = 20.0
LETTERS = "abcdefghij klmnop"  # the prompts: 200 characters of these
MULTI_BYTE = "aé 中文 日本語 🙂 👍🏽 ∑ ok"
MOVES = ({}, {"stages": 0}, {"recompute": True})  # pre-copy (the router's stages), stop-and-copy, recompute
BYTE_MAX_TOKENS = 400  # the byte-level model: ~150 tokens a second a core; moves come at 15-80
REAL_MAX_TOKENS = 40  # the real model: ~18 tokens a second a core in float32
STRADDLE_TOKENS = 200  # the byte-level model's stop strings that straddle a switch: over a second of tokens


@pytest.fixture
def rng(request):
    seed = f"{SEED}-{request.node.name}"
    print(f"random seed {seed!r} (VLLM_EXT_TEST_SEED={SEED} replays it)")
    return random.Random(seed)


# ---- what the client reads -----------------------------------------------------------------------
def held_back(tokenizer, output_ids, k) -> bool:
    """Whether a stream that gave its first `k` output tokens had held back some of their text:
    their bytes end inside a character (the prompts hold whole characters)."""
    return k > 0 and tokenizer.decode(output_ids[:k], skip_special_tokens=True).endswith("\ufffd")


def held_points(tokenizer, output_ids, low, high):
    """The k in [low, high] at which a stream holds text back."""
    return [k for k in range(low, min(high, len(output_ids)) + 1) if held_back(tokenizer, output_ids, k)]


def body_of(path, content, max_tokens, **extra):
    """A greedy request (ignore_eos: it runs to max_tokens) for `path`, with token ids."""
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = content
    return body


USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def counts(usage):
    return {key: usage[key] for key in USAGE}


def answer(url, path, body):
    """The whole answer of `url` to `body` (not streamed): its one choice and its usage's counts."""
    status, out = fleet.post(url + path, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert status == 200, out
    return out["choices"][0], counts(out["usage"])


def text_of(choice):
    return choice["message"]["content"] if "message" in choice else choice["text"]


def switch_point(record, usage):
    """How many output tokens the client had when the source stopped (None: no stop)."""
    if not isinstance(record, dict) or not record.get("stop_tokens"):
        return None
    return record["stop_tokens"] - usage["prompt_tokens"]


def moved_or_ended(status, record, n_tokens, max_tokens):
    """A move that happened (KV moved, or recomputed as asked or with nothing to move), or one
    that came too late: the request had ended (on a busy host its last tokens may come in one
    burst; or it is between its last token and its end: "not started"). Anything else fails."""
    if (status == 404 and "no running request" in str(record)) or \
            (status == 409 and "has not started yet" in str(record)):
        assert n_tokens == max_tokens, record
        return False
    assert status == 200, record
    assert record["outcome"] in ("moved", "recomputed", "finished"), record
    return record["outcome"] != "finished"


def migrate(router, rid, **how):
    """POST /migrate, again while the router answers that it cannot move the request now (409:
    its destination's last poll saw a request waiting there, e.g. the previous test's resume)."""
    deadline = time.monotonic() + 30
    while True:
        status, record = admin(router, "/migrate", {"request_id": rid, **how})
        if status != 409 or "now" not in str(record) or time.monotonic() > deadline:
            return status, record
        time.sleep(0.05)


def move_streamed(cluster, path, body, k, router=None, **how):
    """`body` streamed through the router, moved once the client has `k` tokens; the stream
    and the migration's (status, record)."""
    router, results = router or cluster["router"], []

    def hook(rid):
        t = threading.Thread(target=lambda: results.append(migrate(router, rid, **how)), daemon=True)
        t.start()
        results.append(t)
    s = Stream(router.url, dict(body, stream_options={"include_usage": True}), path).at(k, hook)
    s.start()
    moves = finish([s], results)
    assert s.error is None, s.error
    if not moves:  # it ended before its k-th token (a stop string)
        return s, 404, "no running request: it ended first"
    (status, record), = moves
    return s, status, record


def move_unstreamed(cluster, path, body, k, **how):
    """`body` not streamed, through the router, moved once the router relayed `k` of its tokens
    (unless it ends first: 404); its (choice, usage) and the migration's (status, record)."""
    router, box = cluster["router"], {}
    t = threading.Thread(target=lambda: box.update(out=fleet.post(router.url + path, body)), daemon=True)
    t.start()
    deadline, status, record = time.monotonic() + 60, 404, "no running request: it ended before its move"
    while t.is_alive():
        running = [r for r in admin(router, "/requests")[1]["running"] if r["migratable"]]
        if running and running[0]["generated"] >= k:
            status, record = migrate(router, running[0]["request_id"], **how)
            break
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.005)
    t.join(fleet.REQUEST_TIMEOUT_S)
    code, out = box["out"]
    assert code == 200, out
    return out["choices"][0], counts(out["usage"]), status, record


def emitted_ends(tokenizer, output_ids):
    """Where the text a stream emitted ends after each of its tokens (held-back text is not
    emitted yet)."""
    from tokenizers.decoders import DecodeStream

    stream, ends, n = DecodeStream(skip_special_tokens=True), [], 0
    for token_id in output_ids:
        n += len(stream.step(tokenizer, token_id) or "")
        ends.append(n)
    return ends


def merged_logprobs(choices):
    """The completions logprobs of a stream's choices, as one answer's."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for choice in choices:
        for key in out:
            out[key] += (choice.get("logprobs") or {}).get(key) or []
    return out


def assert_same_logprobs(got, want, context):
    """Tokens and text offsets exactly; log probabilities to float32 rounding (a moved request's
    last tokens are computed by a prefill on the destination, the unmoved one's by decode
    steps). `want` is an unmoved answer, not streamed: its offsets go on by each token's string,
    and the router's do in a stream too, across legs (vLLM 0.32's streams write them so; vLLM
    0.26's start each chunk at the length of the text sent so far, so an unmoved 0.26 stream's
    depend on how its tokens were grouped into chunks, which a GPU makes several a chunk)."""
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"], context
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-3), context
    assert len(got["top_logprobs"]) == len(want["top_logprobs"]), context
    for i, (g, w) in enumerate(zip(got["top_logprobs"], want["top_logprobs"])):
        assert_same_top(g or {}, w or {}, f"top_logprobs[{i}] {g} != {w}: {context}")


def assert_same_top(got, want, context, tol=1e-3):
    """One position's top logprobs: the same candidates with the same values (to `tol`), but for
    a near tie at the cut. The destination's prefill rounds differently from the source's decode
    steps, so the candidates ranked last, with (nearly) equal log probabilities, may trade
    places: a candidate in one answer only is worth what the other answer's last one is. A dict
    keyed by token strings merges candidates that decode alike (bytes that are no character
    yet: U+FFFD), keeping the lowest-ranked one's value: a key both answers have may differ
    where one of them holds its answer's last value (a merged candidate traded at the cut)."""
    def at_cut(value, top):
        return bool(top) and value == pytest.approx(min(top.values()), abs=tol)

    if got.keys() == want.keys():
        assert got == pytest.approx(want, abs=tol), context
        return
    for key in got.keys() | want.keys():
        if key in got and key in want:
            assert got[key] == pytest.approx(want[key], abs=tol) or at_cut(got[key], got) \
                or at_cut(want[key], want), context
        elif key in want:
            assert at_cut(want[key], got), context
        else:
            assert at_cut(got[key], want), context


def straddles(ends, start, end, at):
    """Whether a switch after `at` output tokens fell inside the text [start, end) (`ends`:
    emitted_ends of the output): the client had the token its first character came with, not
    the one that completes it."""
    began = next(j for j, e in enumerate(ends, 1) if e > start)
    completed = next(j for j, e in enumerate(ends, 1) if e >= end)
    return at is not None and began <= at < completed


def assert_stop_tokens(got_ids, want_ids, context):
    """The tokens up to the one that completes the stop string are the single instance's, and
    no more: also where the stop string straddled the switch (the router sends the destination
    the end of the client's text, and the connector's detokenizer ends the leg at that token,
    however many tokens a chunk of the destination holds)."""
    assert got_ids == want_ids, context


def stops_ended(url):
    """How many requests `url`'s engine ended on a stop string (vLLM's finished_reason "stop")."""
    return sum(value for key, value in fleet.metrics(url).items()
               if key.startswith("vllm:request_success_total{") and 'finished_reason="stop"' in key)


def move(cluster, path, body, k, streamed, **how):
    """`body` through the router, streamed or not, moved at its k-th token (move_streamed,
    move_unstreamed): the client's (text, token ids, usage counts) and the migration's (status,
    record)."""
    if streamed:
        s, status, record = move_streamed(cluster, path, body, k, **how)
        return (s.text, s.ids, s.usage), status, record
    got, usage, status, record = move_unstreamed(cluster, path, body, k, **how)
    return (text_of(got), got["token_ids"], usage), status, record


def assert_same_text(got_text, got_ids, want, context):
    """The client's text and tokens are the unmoved request's (`want`: a single instance's
    choice); the message says where they part."""
    want_text = text_of(want)
    if got_text != want_text:
        i = next((j for j, (a, b) in enumerate(zip(got_text, want_text)) if a != b), min(len(got_text),
                                                                                         len(want_text)))
        raise AssertionError(f"{context}: the text parts at character {i} of {len(want_text)}: "
                             f"{got_text[max(0, i - 20):i + 40]!r} for {want_text[max(0, i - 20):i + 40]!r}")
    assert got_ids == want["token_ids"], context


# ---- the byte-level tiny model -----------------------------------------------------------------------
def letters(rng, n=200):
    return "".join(rng.choice(LETTERS) for _ in range(n))


def multi_byte(rng, n=60):
    return "".join(rng.choice(LETTERS + MULTI_BYTE) for _ in range(n))


# Each class runs on each device of fleet.DEVICES: the CPU, and one GPU (marked gpu; both
# instances share it, ipc). Both models are served in float32 there too: greedy oracles.
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
FLOAT32 = ("--dtype", "float32")


@pytest.fixture(scope="class", params=DEVICES)
def tiny(request, tmp_path_factory):
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"text-byte-level-{device.name}")
    fleet.write_chat_model(work / "model")
    yield from start_pair(work, work / "model", lease_s=LEASE_S, device=device, extra_args=(
        "--max-model-len", str(fleet.models.CHAT_MODEL_MAX_POSITIONS), *FLOAT32))


@pytest.fixture(scope="class")
def tokenizer(tiny):
    from vllm_ext.fleet import tokenizers

    return tokenizers.load(tiny["model"])


def started_streams(router, cases, paths):
    """Streams of each case's body (held_case's first item) through `router`, each begun once
    the one before has its first token."""
    out = []
    for case, path in zip(cases, paths):
        s = Stream(router.url, dict(case[0], stream_options={"include_usage": True}), path)
        s.start()
        assert s.first.wait(60), "no first token in 60 s"
        out.append(s)
    return out


def held_case(tiny, tokenizer, rng, path, content, low=15, high=80, max_tokens=BYTE_MAX_TOKENS):
    """A request for `path` whose unmoved stream holds text back somewhere in its tokens
    [low, high] (a search over prompts drawn by `content(rng)`): its body, a single instance's
    answer (choice, usage counts) and those points."""
    for _ in range(20):
        body = body_of(path, content(rng), max_tokens)
        want, usage = answer(tiny["A"].url, path, body)
        points = held_points(tokenizer, want["token_ids"], low, high)
        if points:
            return body, want, usage, points
    raise AssertionError(f"no held-back text in tokens {low}-{high} of 20 answers: the model writes ASCII")


class TestByteLevel:
    def test_moves_inside_held_back_runs_keep_the_text(self, tiny, tokenizer, rng):
        """The issue's reproduction: 200-character prompts, completions streamed, moved once the
        client has 15-80 tokens at a point where its stream held text back, by pre-copy,
        stop-and-copy and recompute: the text, token ids and usage are the unmoved request's.
        (Without the connector's detokenizer fix the text goes on with the whole prompt.)"""
        inside = []
        for i in range(12):  # six prompts, more until a switch fell inside held-back text
            if i >= 6 and any(inside):
                break
            body, want, want_usage, points = held_case(tiny, tokenizer, rng, "/v1/completions", letters)
            for how in (MOVES[i % 3], MOVES[(i + 1) % 3]):
                k = rng.choice(points)
                s, status, record = move_streamed(tiny, "/v1/completions", body, k, **how)
                context = f"moved at {k} ({how}): {record}"
                assert_same_text(s.text, s.ids, want, context)
                assert s.usage == want_usage and s.finish == want["finish_reason"], context
                if moved_or_ended(status, record, len(s.ids), BYTE_MAX_TOKENS):
                    inside.append(held_back(tokenizer, want["token_ids"], switch_point(record, want_usage)))
        # the oracle saw a switch inside held-back text (where a switch lands is the router's)
        assert any(inside), inside

    def test_chat_and_unstreamed_moves_keep_the_text(self, tiny, tokenizer, rng):
        """Chat streamed and not, completions not streamed, prompts with multi-byte characters:
        each moved at a point where its stream held text back."""
        cases = [("/v1/chat/completions", True), ("/v1/chat/completions", False), ("/v1/completions", False),
                 ("/v1/chat/completions", True)]
        for i, (path, streamed) in enumerate(cases):
            body, want, want_usage, points = held_case(tiny, tokenizer, rng, path, multi_byte)
            k = rng.choice(points)
            how = MOVES[i % 3]
            (text, ids, usage), status, record = move(tiny, path, body, k, streamed, **how)
            context = f"{path} {'streamed' if streamed else 'whole'}, moved at {k} ({how}): {record}"
            assert_same_text(text, ids, want, context)
            assert usage == want_usage, context
            moved_or_ended(status, record, len(ids), BYTE_MAX_TOKENS)

    def test_moves_at_the_first_token_and_near_the_end(self, tiny, tokenizer, rng):
        """A move right after the first token (stop-and-copy and recompute) and one a few tokens
        before the last (it may end first): the unmoved text."""
        body, want, want_usage, _ = held_case(tiny, tokenizer, rng, "/v1/completions", letters)
        for k, how in ((1, {"stages": 0}), (1, {"recompute": True}), (BYTE_MAX_TOKENS - 40, {"stages": 0})):
            s, status, record = move_streamed(tiny, "/v1/completions", body, k, **how)
            context = f"moved at {k} ({how}): {record}"
            assert_same_text(s.text, s.ids, want, context)
            assert s.usage == want_usage, context
            moved_or_ended(status, record, len(s.ids), BYTE_MAX_TOKENS)

    def test_stop_strings_min_tokens_and_logprobs_across_a_move(self, tiny, tokenizer, rng):
        """A stop string that the destination meets, min_tokens that mask its earlier matches
        (some on the source, some on the destination), completions logprobs (their tokens and
        text offsets), with or without the stop string in the output, moved inside held-back
        text: streamed and not, the router's answer is a single instance's (vLLM applying the
        stop string itself). (TestRealModel has one that straddles the switch.)

        The stop strings are 1-3 characters of the text, U+FFFD included (bytes that are no
        character), so earlier matches that min_tokens masks are common, and a chunk of several
        tokens may hold one: the router leaves those to the backend, which knows where the
        min_tokens-th token ends. The text they are drawn from is an answer under the same
        min_tokens: it masks </s>, which the random model writes now and then."""
        moved = []
        for i, streamed in enumerate((True, False, True)):
            body, _, _, _ = held_case(tiny, tokenizer, rng, "/v1/completions", multi_byte, 35, 75)
            m = rng.randrange(60, 100)  # the stop string begins in the text of the m-th token or after
            body = dict(body, min_tokens=rng.randrange(m - 10, m), logprobs=2)
            free, _ = answer(tiny["A"].url, "/v1/completions", body)
            at = emitted_ends(tokenizer, free["token_ids"])[m - 1]
            stop = free["text"][at:at + rng.randint(1, 3)]
            body = dict(body, stop=[stop], include_stop_str_in_output=i == 1)
            want, want_usage = answer(tiny["A"].url, "/v1/completions", body)
            assert want["finish_reason"] == "stop", (stop, want)
            # the stop string completes in the text of the n-th token; the move comes well before
            # (a busy host's moves take long), inside held-back text where there is some, by the
            # quicker switches (stop-and-copy, recompute)
            n = len(want["token_ids"])
            points = held_points(tokenizer, free["token_ids"], n - 60, n - 30) or [n - 45]
            k = rng.choice(points)
            how = MOVES[1 + i % 2]
            stops_before = {url: stops_ended(url) for url in (tiny["A"].url, tiny["B"].url)}
            if streamed:
                s, status, record = move_streamed(tiny, "/v1/completions", body, k, **how)
                got = {"text": s.text, "token_ids": s.ids, "finish_reason": s.finish,
                       "stop_reason": s.choices[-1].get("stop_reason"), "logprobs": merged_logprobs(s.choices)}
                usage = s.usage
            else:
                got, usage, status, record = move_unstreamed(tiny, "/v1/completions", body, k, **how)
            context = f"stop {stop!r} {body['min_tokens']=} moved at {k} ({how}): {record}"
            assert_same_text(got["text"], got["token_ids"], want, context)
            assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop), context
            moved.append(moved_or_ended(status, record, len(got["token_ids"]), len(got["token_ids"])))
            if moved[-1]:  # the destination's engine ended the leg on the stop string (the leg carries it)
                assert stops_ended(record["destination"]) > stops_before[record["destination"]], context
            assert_stop_tokens(got["token_ids"], want["token_ids"], context)
            assert counts(usage) == want_usage, context
            assert_same_logprobs(got["logprobs"], want["logprobs"], context)
        assert any(moved), "each request ended before its move"

    def test_a_stop_string_straddling_the_hand_off(self, tiny, tokenizer, rng):
        """A stop string that begins in the text the client has at the switch and ends in the
        destination's, for completions (logprobs too) and chat, streamed and not: the text,
        token ids, usage, finish and stop reason and logprobs are the unmoved request's, and the
        destination's engine ended the leg on the stop string itself (the router sent it the
        end of the client's text): without that the leg runs past the stop string and the
        router keeps every token of the chunk that completes it. Each case tries up to three
        moves until one switches inside the stop string."""
        cases = [("/v1/completions", True), ("/v1/completions", False), ("/v1/chat/completions", True),
                 ("/v1/chat/completions", False)]
        for i, (path, streamed) in enumerate(cases):
            tries, drawn = [], 0
            while len(tries) < 3 and drawn < 10:
                drawn += 1
                # one top logprob (greedy: the chosen token's): a random model's runners-up are near ties
                extra = {"logprobs": 1} if path == "/v1/completions" else {}
                body = body_of(path, letters(rng, 60), BYTE_MAX_TOKENS, **extra)
                free, _ = answer(tiny["A"].url, path, body)
                ends = emitted_ends(tokenizer, free["token_ids"])
                k = rng.randrange(15, 40)
                start, end = ends[k - 3], ends[k + STRADDLE_TOKENS]
                stop = text_of(free)[start:end]
                if not stop or text_of(free).find(stop) != start:
                    continue  # the text repeats itself: another prompt
                stopped = dict(body, stop=[stop])
                want, want_usage = answer(tiny["A"].url, path, stopped)
                assert (want["finish_reason"], text_of(want)) == ("stop", text_of(free)[:start]), (stop, want)
                stops_before = {url: stops_ended(url) for url in (tiny["A"].url, tiny["B"].url)}
                how = MOVES[1 + (i + len(tries)) % 2]  # stop-and-copy or recompute: the quicker switches
                # asked once the client has the token the stop string's first character came with (in
                # a held-back run that is later than k): a GPU switches within a few tokens of the ask
                k = max(k, next(j for j, e in enumerate(ends, 1) if e > start))
                if streamed:
                    s, status, record = move_streamed(tiny, path, stopped, k, **how)
                    got = {"text": s.text, "token_ids": s.ids, "finish_reason": s.finish,
                           "stop_reason": s.choices[-1].get("stop_reason"), "logprobs": merged_logprobs(s.choices)}
                    usage = counts(s.usage)
                else:
                    got, usage, status, record = move_unstreamed(tiny, path, stopped, k, **how)
                context = f"{path} {'streamed' if streamed else 'whole'}, stop of {len(stop)} characters, " \
                          f"moved at {k} ({how}): {record}"
                assert text_of(got) == text_of(want), context
                assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop), context
                assert_stop_tokens(got["token_ids"], want["token_ids"], context)
                assert usage == want_usage, context
                if extra:
                    assert_same_logprobs(got["logprobs"], want["logprobs"], context)
                moved = moved_or_ended(status, record, len(got["token_ids"]), len(got["token_ids"]))
                at = switch_point(record, want_usage) if moved else None
                tries.append((k, at))
                if straddles(ends, start, end, at):
                    destination = record["destination"]
                    assert stops_ended(destination) > stops_before[destination], \
                        f"{context}: the destination did not end the leg on the stop string"
                    break
            else:
                raise AssertionError(f"{path}: no switch fell inside the stop string (move asked at, switch): {tries}")

    def test_requests_whose_text_a_move_would_change_stay_and_say_why(self, tiny, rng):
        """echo and chat logprobs are relayed as is (GET /requests lists them as not movable,
        with the reason): their text is a single instance's."""
        prompt = multi_byte(rng)
        cases = [("/v1/completions", body_of("/v1/completions", prompt, 200, echo=True), "echo"),
                 ("/v1/chat/completions", body_of("/v1/chat/completions", prompt, 200, logprobs=True,
                                                  top_logprobs=2), "logprobs")]
        del cases[0][1]["return_token_ids"]  # with it vLLM echoes no prompt text
        for path, body, why in cases:
            want, _ = answer(tiny["A"].url, path, body)
            s = Stream(tiny["router"].url, body, path)
            s.start()
            assert s.first.wait(60), "no first token in 60 s"
            seen = admin(tiny["router"], "/requests")[1]["running"]
            finish([s])
            assert s.error is None and s.text == text_of(want), (s.text, text_of(want))
            assert [r["migratable"] for r in seen] == [False] and why in seen[0]["why_not"], seen
            got, _ = answer(tiny["router"].url, path, body)
            assert text_of(got) == text_of(want)

    def test_a_drain_and_the_balancer_keep_the_text(self, tiny, tokenizer, rng):
        """Streams (chat and completions) begun on A, moved by a drain of A, then by the
        balancer of a second router: each client's text is the unmoved one's. The balancer
        moves as it sees fit, and on a busy host the streams may end first: up to three rounds
        of streams until it moved one."""
        paths = ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
        urls = [tiny["A"].url, tiny["B"].url]
        balancer = start_router(tiny["work"], "balancer", urls, [tiny["leases"][n] for n in "AB"], "--balance",
                                "--balance-threshold", "2", "--balance-interval-s", "0.1")
        try:
            for router, move in ((tiny["router"], "drain"), (balancer, "balance")):
                for _ in range(1 if move == "drain" else 3):
                    # longer for the balancer, which moves them one at a time as it sees fit
                    cases = [held_case(tiny, tokenizer, rng, path, multi_byte if i % 2 else letters,
                                       max_tokens=BYTE_MAX_TOKENS * (1 if move == "drain" else 2))
                             for i, path in enumerate(paths)]
                    scope = dict(tiny, router=router)
                    streams = pin_to(scope, router, "A", lambda r=router, c=cases: started_streams(r, c, paths), urls)
                    if move == "drain":
                        status, report = admin(router, "/drain", {"instance": tiny["A"].url})
                        admin(router, "/undrain", {"instance": tiny["A"].url})
                        assert status == 200 and report["left"] == [], report
                    finish(streams)
                    history = admin(router, "/requests")[1]["migrations"]
                    for s, path, (_, want, want_usage, _) in zip(streams, paths, cases):
                        moves = [m for m in history if m["request_id"] == s.rid]
                        assert s.error is None, s.error
                        assert_same_text(s.text, s.ids, want, f"{path} after a {move}: {moves}")
                        assert s.usage == want_usage
                    if any(m["outcome"] in ("moved", "recomputed") for m in history):
                        break
                assert any(m["outcome"] in ("moved", "recomputed") for m in history), \
                    (move, [(m["outcome"], m["reason"]) for m in history])
        finally:
            balancer.stop()

    def test_recovery_after_a_cut_connection_keeps_the_text(self, tiny, tokenizer, rng):
        """The router loses its connections to A (a proxy cuts them) while A streams a request,
        at a point where the stream held text back: B recomputes it from the router's tokens."""
        proxy = Cuttable(int(tiny["A"].url.rsplit(":", 1)[1]))
        proxy.start()
        urls = [proxy.url, tiny["B"].url]
        router = start_router(tiny["work"], "cut", urls, [tiny["leases"][n] for n in "AB"],
                              "--health-timeout-s", "2")
        try:
            for path in ("/v1/completions", "/v1/chat/completions"):
                proxy.restore()
                body, want, want_usage, points = held_case(tiny, tokenizer, rng, path, multi_byte)
                k = rng.choice(points)
                admin(router, "/drain", {"instance": tiny["B"].url, "timeout_s": 0})  # it begins on A
                s = Stream(router.url, dict(body, stream_options={"include_usage": True}), path)
                s.at(k, lambda rid: proxy.cut())
                s.start()
                s.first.wait(60)
                admin(router, "/undrain", {"instance": tiny["B"].url})
                finish([s])
                assert s.error is None, s.error
                assert_same_text(s.text, s.ids, want, f"{path}, its connection cut at {k}")
                assert s.usage == want_usage
        finally:
            router.stop()
            proxy.close()

    def test_recovery_after_an_instance_dies_keeps_the_text(self, tiny, tokenizer, rng):
        """B is killed while it streams a request, at a point where the stream held text back:
        A recomputes it from the router's tokens. (B stays dead: the class's last test.)"""
        body, want, want_usage, points = held_case(tiny, tokenizer, rng, "/v1/chat/completions", multi_byte)
        k = rng.choice(points)
        router, urls = tiny["router"], [tiny["A"].url, tiny["B"].url]
        s = pin_to(tiny, router, "B", lambda: started_streams(router, [(body,)], ["/v1/chat/completions"])[0], urls)
        s.at(k, lambda rid: tiny["B"].kill())
        finish([s])
        assert s.error is None, s.error
        assert_same_text(s.text, s.ids, want, f"its instance killed at {k}")
        assert s.usage == want_usage


# ---- a tokenizer that vLLM detokenizes with its slow path --------------------------------------------
# A Python byte tokenizer (ByT5's) that decodes bytes that are no character yet to U+FFFD, as most
# do: not `tokenizers`-backed, so vLLM's slow incremental detokenizer serves it.
REPLACING_TOKENIZER = '''from transformers import ByT5Tokenizer


class ReplacingByteTokenizer(ByT5Tokenizer):
    def convert_tokens_to_string(self, tokens):
        data = b"".join(bytes([ord(t)]) if len(t) == 1 and ord(t) < 256 else t.encode() for t in tokens)
        return data.decode("utf-8", errors="replace")
'''
SLOW_MAX_POSITIONS = 1024


def write_python_tokenizer_model(path, seed=0):
    """The tiny random Llama with ReplacingByteTokenizer (the folder's own code: served with
    --trust-remote-code)."""
    import json

    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    config = dict(fleet.TINY, vocab_size=len(tokenizer), max_position_embeddings=SLOW_MAX_POSITIONS,
                  bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    fleet.models.random_llama(config, seed, "bfloat16").save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "tokenization_replacing.py").write_text(REPLACING_TOKENIZER)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="ReplacingByteTokenizer",
                    auto_map={"AutoTokenizer": ["tokenization_replacing.ReplacingByteTokenizer", None]})
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


@pytest.fixture(scope="class")
def python_tokenizer_pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("text-slow-detokenizer")
    model = write_python_tokenizer_model(work / "model")
    yield from start_pair(work, model, lease_s=LEASE_S, extra_args=(
        "--trust-remote-code", "--max-model-len", str(SLOW_MAX_POSITIONS), *FLOAT32))


class TestSlowDetokenizer:
    def test_moves_inside_held_back_runs_keep_the_text(self, python_tokenizer_pair, rng):
        """vLLM's slow detokenizer (a Python tokenizer) held text back too: requests moved inside
        such runs, streamed and not, keep the unmoved text (the connector primes it as a stream
        that generated the prompt's last tokens; vLLM's own priming drops the held-back text)."""
        from transformers import AutoTokenizer

        pair = python_tokenizer_pair
        assert any("Using a slow tokenizer" in log.read_text(errors="replace")
                   for log in pair["work"].glob("A*.log")), "A does not detokenize with vLLM's slow path"
        tokenizer = AutoTokenizer.from_pretrained(pair["model"], trust_remote_code=True)
        inside = []
        # three moves (streamed, whole, streamed), and more, up to eight, until one switched inside
        # a held-back run: the switch comes some tokens after the ask, and may pass the run
        for i in range(8):
            if i >= 3 and any(inside):
                break
            streamed = i % 2 == 0
            body, want, want_usage, points = held_case(pair, tokenizer, rng, "/v1/completions", letters,
                                                       max_tokens=BYTE_MAX_TOKENS // 2)
            k = rng.choice(points)
            how = MOVES[1 + i % 2]
            (text, ids, usage), status, record = move(pair, "/v1/completions", body, k, streamed, **how)
            context = f"{'streamed' if streamed else 'whole'}, moved at {k} ({how}): {record}"
            assert_same_text(text, ids, want, context)
            assert counts(usage) == want_usage, context
            if moved_or_ended(status, record, len(ids), BYTE_MAX_TOKENS // 2):
                inside.append(held_back(tokenizer, want["token_ids"], switch_point(record, want_usage)))
        assert any(inside), inside


# ---- the real model -------------------------------------------------------------------------------------
WORDS = ("the river carries light stone across quiet valleys where old towns keep their bells and "
         "markets open early under tall trees while travellers count coins and stories").split()
REAL_CHATS = ["What is the capital of France?", "Écris une phrase sur le café ☕ et les croissants 🥐.",
              "用中文介绍一下长城。", "Reply with five emoji about the sea 🌊🐟.", "日本の首都はどこですか？"]
REAL_PROMPTS = ["The three primary colours are", "Emoji story: 🐱🐶🌧️ then", "東京は日本の首都で、",
                "Once upon a time, in a village by the sea,"]


def long_text(rng, words=340):
    """English of over `words` tokens (each word is one)."""
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summarize this in one sentence:"


@pytest.fixture(scope="class", params=DEVICES)
def real(request, tmp_path_factory):
    device = fleet.DEVICES[request.param]
    work = tmp_path_factory.mktemp(f"text-real-{device.name}")
    yield from start_pair(work, fleet.real_model_folder(say=lambda message: None), lease_s=LEASE_S, proxy=True,
                          device=device, extra_args=FLOAT32)


def through(url, path, body, streamed):
    """A request to `url` (a server, the proxy, the router): (text, token ids, usage counts)."""
    if not streamed:
        choice, usage = answer(url, path, body)
        return text_of(choice), choice["token_ids"], usage
    s = Stream(url, dict(body, stream_options={"include_usage": True}), path)
    s.start()
    finish([s])
    assert s.error is None, s.error
    return s.text, s.ids, counts(s.usage)


def real_tokenizer(cluster):
    from vllm_ext.fleet import tokenizers

    return tokenizers.load(cluster["model"])


class TestRealModel:
    def test_pd_through_the_proxy_gives_a_single_servers_text(self, real, rng):
        """About ten chat and completion prompts (some over 300 tokens, some with emoji and CJK),
        streamed and not, through the proxy (A prefills, B decodes): a single server's text."""
        cases = [("/v1/chat/completions", c) for c in REAL_CHATS] + [("/v1/completions", p) for p in REAL_PROMPTS]
        cases += [("/v1/chat/completions", long_text(rng)), ("/v1/completions", long_text(rng))]
        transfers, long_prompts = fleet.metrics(real["B"].url).get("vllm:vllm_ext_transfers_total", 0), 0
        for i, (path, content) in enumerate(cases):
            body = body_of(path, content, 24)
            want, want_usage = answer(real["A"].url, path, body)
            text, ids, usage = through(real["proxy"].url, path, body, streamed=i % 2 == 1)
            assert_same_text(text, ids, want, f"{path} {content[:40]!r} through the proxy")
            assert usage == want_usage
            long_prompts += usage["prompt_tokens"] > 300
        # B pulled the KV of each prompt with a whole block before its last token (the long ones)
        assert long_prompts >= 2
        assert fleet.metrics(real["B"].url)["vllm:vllm_ext_transfers_total"] - transfers >= long_prompts

    def test_moved_chat_and_completions_keep_the_text(self, real, rng):
        """Streamed and whole chat and completions (emoji, CJK, a prompt over 300 tokens) moved
        at several points by pre-copy, stop-and-copy and recompute, inside held-back text where
        the answer has some: the unmoved text, token ids and usage."""
        tok = real_tokenizer(real)
        cases = [("/v1/chat/completions", True, REAL_CHATS[3], {}),
                 ("/v1/completions", False, long_text(rng), {}),
                 ("/v1/chat/completions", False, REAL_CHATS[2], {"recompute": True}),
                 ("/v1/completions", True, REAL_PROMPTS[1], {"stages": 0})]
        for path, streamed, content, how in cases:
            body = body_of(path, content, REAL_MAX_TOKENS)
            want, want_usage = answer(real["A"].url, path, body)
            k = rng.choice(held_points(tok, want["token_ids"], 2, 16) or range(2, 16))
            (text, ids, usage), status, record = move(real, path, body, k, streamed, **how)
            context = f"{path} {content[:40]!r} moved at {k} ({how}): {record}"
            assert_same_text(text, ids, want, context)
            assert usage == want_usage, context
            moved_or_ended(status, record, len(ids), REAL_MAX_TOKENS)

    def test_a_stop_string_straddling_the_hand_off(self, real, rng):
        """A stop string of some 30 tokens that begins just before the move: the switch falls
        inside it (tried up to three times), and the text ends where a single server's does."""
        tok, path = real_tokenizer(real), "/v1/completions"
        body = body_of(path, REAL_PROMPTS[3], 60)
        free, _ = answer(real["A"].url, path, body)
        ends = emitted_ends(tok, free["token_ids"])
        switches = []
        for _ in range(3):
            k = rng.randrange(4, 10)
            start, end = ends[k - 3], ends[k + 30]
            stop = free["text"][start:end]
            assert free["text"].find(stop) == start, "the output repeats itself: pick another prompt"
            stopped = dict(body, stop=[stop])
            want, want_usage = answer(real["A"].url, path, stopped)
            s, status, record = move_streamed(real, path, stopped, k, stages=0)
            context = f"stop {stop!r} moved at {k}: {record}"
            assert s.text == want["text"] == free["text"][:start], context
            assert (s.finish, s.choices[-1].get("stop_reason")) == ("stop", stop), context
            at = switch_point(record, want_usage) if moved_or_ended(status, record, len(s.ids), len(s.ids)) else None
            straddled = straddles(ends, start, end, at)
            assert_stop_tokens(s.ids, want["token_ids"], context)
            assert counts(s.usage) == want_usage, context
            switches.append((k, at))
            if straddled:
                return
        raise AssertionError(f"no switch fell inside the stop string (move asked at, switch): {switches}")
