#!/usr/bin/env python3
"""Checks that a vLLM OpenAI-compatible server answers: health, completions, a streamed chat completion.

Usage: serve_check.py URL MODEL [--steps health,completions,chat-stream,metrics] [--out FILE]
                       [--expect FILE] [--container NAME ...] [--metric [URL=]NAME ...]

Each step prints its wall time. `completions` sends PROMPTS greedily (temperature 0, ignore_eos,
MAX_TOKENS each) and records the texts and token ids; `chat-stream` streams one greedy chat
completion, checks the chunks form one message that ends with [DONE], and records the same.
`--out` writes both results as JSON and `--expect` fails unless they equal a file written
before (the same requests through P/D must give a single server's answers). `metrics` fails
unless each --metric's samples on a /metrics page (URL's, else the server's) sum to more than 0.
While it waits for health, a server container named with --container that stops fails the check
at once. Standard library only: it runs on the CI machine, outside the image.
Exit status 1 when a step fails, with the reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "vllm-ext moves paged KV cache blocks between instances.",
    "0123456789" * 12,
]
MAX_TOKENS = 16
CHAT_MESSAGES = [{"role": "user", "content": "Say something random, tiny model."}]
STEPS = ("health", "completions", "chat-stream", "metrics")


class CheckError(Exception):
    pass


def post(url: str, body: Dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise CheckError(f"POST {url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except OSError as e:
        raise CheckError(f"POST {url}: {e}") from None


def container_state(docker: str, name: str) -> str:
    proc = subprocess.run(
        [docker, "inspect", "--format", "{{.State.Status}} (exit code {{.State.ExitCode}})", name],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else f"unknown: {proc.stderr.strip()}"


def wait_health(url: str, timeout: float, containers: List[str], docker: str) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        for name in containers:
            state = container_state(docker, name)
            if not state.startswith("running"):
                raise CheckError(f"{url}/health: container {name} stopped before it was healthy: {state}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(1)
    raise CheckError(f"{url}/health: not healthy after {timeout:.0f} s (last: {last})")


# Greedy, the whole MAX_TOKENS, and the token ids beside the text (a random model's bytes are
# often not valid UTF-8: different tokens can decode to the same replacement characters).
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def completions(url: str, model: str, timeout: float) -> List[Dict]:
    results = []
    for i, prompt in enumerate(PROMPTS):
        t0 = time.monotonic()
        with post(f"{url}/v1/completions", dict(SAMPLING, model=model, prompt=prompt), timeout) as resp:
            out = json.load(resp)
        choice = out["choices"][0]
        token_ids = choice.get("token_ids")
        if not token_ids or len(token_ids) != MAX_TOKENS:
            raise CheckError(f"completion {i}: token_ids {token_ids}, expected {MAX_TOKENS} of them: {out}")
        results.append({"text": choice["text"], "token_ids": token_ids})
        print(f"  completion {i}: {len(token_ids)} tokens in {time.monotonic() - t0:.2f} s: {token_ids}")
    return results


def chat_stream(url: str, model: str, timeout: float) -> Dict:
    t0 = time.monotonic()
    body = dict(SAMPLING, model=model, messages=CHAT_MESSAGES, stream=True)
    chunks, parts, token_ids, done, first = 0, [], [], False, None
    with post(f"{url}/v1/chat/completions", body, timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            first = first if first is not None else time.monotonic() - t0
            for choice in event.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
                token_ids.extend(choice.get("token_ids") or [])
            chunks += 1
    if not done:
        raise CheckError(f"chat stream: ended after {chunks} chunks without [DONE]")
    if chunks < 2:
        raise CheckError(f"chat stream: {chunks} chunk(s), expected one per token")
    if len(token_ids) != MAX_TOKENS:
        raise CheckError(f"chat stream: {len(token_ids)} token ids in all chunks, expected {MAX_TOKENS}")
    print(f"  chat stream: {chunks} chunks, first after {first:.2f} s, all in {time.monotonic() - t0:.2f} s: "
          f"{token_ids}")
    return {"text": "".join(parts), "token_ids": token_ids}


def metric_total(url: str, name: str) -> float:
    """Sum of the samples of metric NAME (any labels) on URL/metrics."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            page = resp.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise CheckError(f"{url}/metrics: {e}") from None
    total, found = 0.0, False
    for line in page.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or sample.startswith(name + "{"):
            total += float(value)
            found = True
    if not found:
        raise CheckError(f"{url}/metrics: no metric {name}")
    return total


def check_metrics(url: str, metrics: List[str]) -> None:
    if not metrics:
        raise CheckError("metrics: no --metric given")
    for spec in metrics:
        where, sep, name = spec.rpartition("=")
        where = where.rstrip("/") if sep else url
        total = metric_total(where, name)
        print(f"  {name} at {where}: {total:g}")
        if total <= 0:
            raise CheckError(f"{where}/metrics: {name} is {total:g}, expected more than 0")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("model", help="served model name")
    parser.add_argument("--steps", default="health,completions,chat-stream",
                        help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--out", help="write the completions' texts to this JSON file")
    parser.add_argument("--expect", help="fail unless the completions' texts equal this JSON file's")
    parser.add_argument("--container", action="append", default=[], help="server container to watch while waiting")
    parser.add_argument("--docker", default="docker", help="Docker client (for --container)")
    parser.add_argument("--metric", action="append", default=[], metavar="[URL=]NAME",
                        help="for the metrics step: a metric that must sum to more than 0")
    args = parser.parse_args(argv)
    steps = args.steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {unknown}, expected some of {list(STEPS)}")
    url = args.url.rstrip("/")

    result: Dict[str, object] = {}
    try:
        for step in steps:
            t0 = time.monotonic()
            print(f"serve_check {url}: {step}", flush=True)
            if step == "health":
                wait_health(url, args.health_timeout, args.container, args.docker)
            elif step == "completions":
                result["completions"] = completions(url, args.model, args.timeout)
            elif step == "chat-stream":
                result["chat-stream"] = chat_stream(url, args.model, args.timeout)
            else:
                check_metrics(url, args.metric)
            print(f"  {step}: ok, {time.monotonic() - t0:.1f} s", flush=True)
        if args.expect:
            with open(args.expect) as f:
                expected = json.load(f)
            compared = sorted(set(expected) & set(result))
            if not compared:
                raise CheckError(f"--expect {args.expect}: no results in common with this run's steps")
            for key in compared:
                if result[key] != expected[key]:
                    raise CheckError(f"{key} differs from {args.expect}'s:\n  expected {expected[key]!r}\n"
                                     f"  got      {result[key]!r}")
            print(f"  {' and '.join(compared)} equal {args.expect}'s (greedy)")
    except CheckError as e:
        print(f"serve_check: FAIL: {e}", file=sys.stderr)
        return 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
