"""Fakes and helpers the router's unit tests share: a backend's streamed answer (Response,
Content) that a test feeds event by event, a client (Out), fake vLLM servers on loopback
(backend, serving), a routed request on an instance (routed_on, take) and a destination's lease
channel (Control, describing_lease_servers for real ones)."""

import asyncio
import json
import socket

from aiohttp import web

from vllm_ext.router.state import Routed


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class Content:
    """A backend stream's body: events the test puts, and the wake-up a stop sets."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self._error = None

    async def readuntil(self, sep, **_):
        while self._error is None:
            try:
                return await asyncio.wait_for(self.events.get(), 0.01)
            except asyncio.TimeoutError:
                pass
        error, self._error = self._error, None
        raise error

    def set_exception(self, error):
        self._error = error

    def exception(self):
        return self._error


class Response:
    """A backend's answer, as the pump reads it (aiohttp's ClientResponse)."""

    def __init__(self):
        self.content, self.closed, self.released = Content(), False, False

    def close(self):
        self.closed = True

    def release(self):
        self.released = True


def take(routed, inst, response=None):
    """`routed`'s leg is now one on `inst` (its response a fake one unless given); that response."""
    from vllm_ext.router.state import Leg

    response = response or Response()
    routed.take(Leg(response, inst))
    return response


class Out:
    def __init__(self):
        self.chunks = []

    async def write(self, data):
        self.chunks.append(data)


def token_event(token_id, prompt=None, finish=None):
    choice = {"index": 0, "text": f" t{token_id}", "token_ids": [token_id], "logprobs": None, "finish_reason": finish}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return ("data: " + json.dumps({"id": "c", "choices": [choice]}) + "\n\n").encode()


def describing_lease_servers(secret: str, replies):
    """Real lease servers, one per (sampler, default_max_tokens, max_tokens_cap), answering
    lease.describe; `asked` lists the samplers of those asked."""
    from vllm_ext.lease import messages
    from vllm_ext.lease.channel import LeaseServer

    asked = []

    def serving(sampler, default, cap):
        def handler(request):
            asked.append(sampler)
            assert isinstance(request, messages.LeaseDescribe)
            return messages.LeaseDescribeReply({}, "0" * 32, {}, sampler, default, cap), b""
        return handler
    return [LeaseServer(secret.encode(), serving(*reply)) for reply in replies], asked


async def empty(request):
    return web.Response(text="")


async def serving(app):
    """`app` served on a free port of 127.0.0.1: (its runner, to clean up; its URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def backend(handler, metrics=empty):
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", empty)
    return await serving(app)


def routed_on(router, inst, tokens=(5, 6), rid="c"):
    from vllm_ext.router.openai import ClientStream

    client = ClientStream(rid, False, "m", want_ids=True, want_usage=False)
    client.prompt_token_ids = [1, 2]
    client.token_ids = list(tokens)
    routed = Routed(rid, {"model": "m", "prompt": [1, 2], "max_tokens": 9}, False, client)
    routed.instance = inst
    return routed


class Control:
    """A destination's lease channel whose every trace is `reply` (None: it does not answer)."""

    def __init__(self, reply):
        self.reply = reply

    def settled_trace(self, mid, wait_s):
        return self.trace(mid)

    def close(self):
        pass

    def trace(self, mid):
        from vllm_ext.lease.channel import ChannelError

        if self.reply is None:
            raise ChannelError("lease channel 127.0.0.1:10: no answer within 5 s")
        return self.reply


def events_of(text):
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
