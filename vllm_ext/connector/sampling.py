"""Seeded sampling across a migration: a request with a `seed` draws its random numbers from a
stream of its own, and once it moved, the destination must draw what the source would have
drawn next. vLLM samples in one of two ways:

- model runner V2 (the GPU default for dense models): Gumbel noise keyed by (seed, position of
  the token). A resumed request, its output so far now in its prompt, samples at the same
  positions: its stream goes on by itself.
- model runner V1 (CPU, and GPU models V2 does not run): one torch.Generator per request,
  seeded when the request reaches the runner and advanced by every token it samples. The
  destination's is fresh: it skips the draws of the tokens sampled before the move. CUDA: one
  add to the Philox offset, by what one call of vLLM's own sampler moves it. CPU: vLLM 0.32's
  sampler takes one 31-bit integer of the generator per token, so n of them in one call skip n
  tokens; that is checked once against vLLM's own call, and where it does not hold (another
  release or sampler), vLLM's call is replayed n times on a dummy row (milliseconds each).

Two instances continue each other's seeded requests when their `kind` strings are equal and
not empty (the router checks this before it moves one): the way, the device (V1 on CUDA: its
model, whose launch shape lays out the stream), the vLLM release, fp64 noise. vLLM gives a connector no handle on
its model runner: `find` takes the runner that registers the KV caches from the call stack.
"""

import logging
import sys
from typing import Callable, Dict, Optional

import torch

from .compat import uses_v2_model_runner

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# How far up the call stack register_kv_caches looks for the model runner (V1: its caller;
# V2: two frames up, through its connector wrapper).
MAX_FRAMES = 16


class SeededStreams:
    """Continues seeded requests' random streams on this instance.

    `kind`: how this instance draws them ("" when it does not know: it cannot continue a
    moved request's stream). `generator_of(req_id)`: the request's torch.Generator in the model
    runner, or None (V2: no per-request state). `draw(generator)`: one sampled token's draws.
    """

    def __init__(self, kind: str, generator_of: Optional[Callable[[str], Optional[torch.Generator]]] = None,
                 draw: Optional[Callable[[torch.Generator], None]] = None):
        self.kind = kind
        self._generator_of = generator_of
        self._draw = draw
        self._offset_per_draw: Dict[str, int] = {}  # CUDA device -> Philox offset one draw uses
        self._one_int_per_draw: Optional[bool] = None  # CPU: a draw takes what one randint takes

    @property
    def one_int_per_draw(self) -> Optional[bool]:
        """On a CPU generator: whether n tokens' draws are skipped as n 31-bit ints in one call
        (found at the first skip: None before, and on CUDA)."""
        return self._one_int_per_draw

    def skip(self, req_id: str, n: int) -> bool:
        """Advances `req_id`'s stream past `n` sampled tokens' draws (before its first sample
        here); False when this instance cannot."""
        if not self.kind:
            return False
        if self._generator_of is None:  # keyed by position: nothing to skip
            return True
        generator = self._generator_of(req_id)
        if generator is None:
            return False
        if generator.device.type == "cuda":
            generator.set_offset(generator.get_offset() + n * self._cuda_offset_per_draw(generator.device))
        elif self._cpu_draw_is_one_int():
            _ints(generator, n)
        else:
            for _ in range(n):
                self._draw(generator)
        return True

    def _cpu_draw_is_one_int(self) -> bool:
        # NOTE: replaying the sampler costs ~2 ms a token at a 128k vocabulary (its noise kernel
        # runs over the row); when one draw moves a CPU generator as one 31-bit randint does, and
        # k such ints in one call as k calls, n tokens are skipped by n ints in one call
        if self._one_int_per_draw is None:
            by_sampler, by_int, by_batch, by_ints = (torch.Generator() for _ in range(4))
            for g in (by_sampler, by_int, by_batch, by_ints):
                g.manual_seed(0x5EED)
            self._draw(by_sampler)
            _ints(by_int, 1)
            _ints(by_batch, 3)
            for _ in range(3):
                _ints(by_ints, 1)
            self._one_int_per_draw = (torch.equal(by_sampler.get_state(), by_int.get_state())
                                      and torch.equal(by_batch.get_state(), by_ints.get_state()))
        return self._one_int_per_draw

    def _cuda_offset_per_draw(self, device: torch.device) -> int:
        # NOTE: a CUDA generator's state is (seed, offset), and a draw of a fixed shape moves the
        # offset by a fixed amount: measured once on a scratch generator, then n draws are one add
        key = str(device)
        if key not in self._offset_per_draw:
            scratch = torch.Generator(device=device)
            scratch.manual_seed(0)
            before = scratch.get_offset()
            self._draw(scratch)
            self._offset_per_draw[key] = scratch.get_offset() - before
        return self._offset_per_draw[key]


def _ints(generator: torch.Generator, n: int) -> None:
    torch.randint(0, 2**31, (n,), generator=generator, dtype=torch.long)


def _runner_on_stack():
    """The model runner that is registering the KV caches: the nearest caller's `self` that
    has a sampler."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "sampler") and hasattr(owner, "execute_model"):
            return owner
        frame = frame.f_back
    return None


def find(vllm_config) -> SeededStreams:
    """Called from register_kv_caches: how this instance draws seeded requests' numbers, and
    the means to continue a moved one's stream."""
    import vllm

    runner = _runner_on_stack()
    sampler = getattr(runner, "sampler", None)
    tags = [vllm_config.device_config.device_type, ".".join(vllm.__version__.split(".")[:2])]
    if getattr(sampler, "use_fp64_gumbel", False) or getattr(getattr(sampler, "topk_topp_sampler", None),
                                                              "use_fp64_gumbel", False):
        tags.append("fp64")
    if uses_v2_model_runner(vllm_config):
        return SeededStreams(":".join(["position", *tags]))
    if vllm_config.device_config.device_type == "cuda":  # a CUDA generator's stream depends on the launch shape
        tags.append(torch.cuda.get_device_name().replace(":", " "))
    requests = getattr(runner, "requests", None)
    topk_topp = getattr(sampler, "topk_topp_sampler", None)
    if not isinstance(requests, dict) or not callable(topk_topp):
        logger.warning("vllm-ext connector: this vLLM's model runner was not found (%s): seeded requests moved here "
                       "would restart their random stream, so the router will not move them here",
                       type(runner).__name__ if runner is not None else "none on the call stack")
        return SeededStreams("")
    vocab = vllm_config.model_config.get_vocab_size()

    def generator_of(req_id: str) -> Optional[torch.Generator]:
        return getattr(requests.get(req_id), "generator", None)

    def draw(generator: torch.Generator) -> None:
        # the row vLLM's sampler draws for one request of a batch, through the same call
        logits = torch.zeros(1, vocab, dtype=torch.float32, device=generator.device)
        topk_topp(logits, {0: generator}, None, None)

    return SeededStreams(":".join(["generator", *tags]), generator_of, draw)
