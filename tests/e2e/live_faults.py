"""Test-only faults for the live-migration tests (served through kv_connector_module_path), each
while the file an environment variable names exists:

- VLLM_EXT_TEST_CORRUPT: a destination whose pulls return noise (every block it pulls is
  overwritten after the pull, before the digests are checked); the source's KV, which its
  request still decodes from until the switch, is left alone;
- VLLM_EXT_TEST_PULL_DELAY: a destination that waits that file's number of seconds before each
  pull (a slow destination: its source's lease expires meanwhile, or it is killed meanwhile:
  while it waits, the file's name plus "." and VLLM_EXT_TEST_SERVER plus ".waiting" exists);
- VLLM_EXT_TEST_UNSAFE_LOADS: a destination that reports a resume's failed load as unsafe, as an
  engine that schedules asynchronously does (a GPU's default; the CPU's engine does not): the
  router drops that leg and recomputes.

And one setting, VLLM_EXT_TEST_STEP_PAUSE_S: seconds the engine sleeps before each step's
scheduling. vLLM CPU's engine and worker processes spin while they wait for each other (its
shared-memory queues busy-loop for a second after each read), so on a 2-core host they keep both
cores and the API server process starves: a stream can stop for seconds while the engine steps on
(measured: 916 steps during one 4.8 s stall of a 1500-token stream; 4 of 6 streams stalled for
over a second) and then arrive in one burst, and a move the client triggers at its k-th token
finds the request ended. One millisecond a step leaves the API server a core (12 of 12 streams,
none stalled for more than 45 ms).
"""

import contextlib
import os
import time

import torch

from vllm_ext.connector.connector import VllmExtConnector


class LiveFaultConnector(VllmExtConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_pause_s = float(os.environ.get("VLLM_EXT_TEST_STEP_PAUSE_S", "0") or "0")
        sched = self._scheduler
        if sched is not None:
            asynchronous = sched.failed_load_is_unsafe

            def unsafe():
                path = os.environ.get("VLLM_EXT_TEST_UNSAFE_LOADS", "")
                return asynchronous() or bool(path and os.path.exists(path))
            sched.failed_load_is_unsafe = unsafe
        worker = self._worker
        if worker is None:
            return
        receiver = worker.receiver  # its receive and pull are looked up on the instance at each use
        receive, pull = receiver.receive, receiver.pull

        def slow_receive(job, deadline):
            path = os.environ.get("VLLM_EXT_TEST_PULL_DELAY", "")
            if path and os.path.exists(path):
                delay = float(open(path).read() or "0")
                waiting = f"{path}.{os.environ.get('VLLM_EXT_TEST_SERVER', '')}.waiting"
                open(waiting, "w").close()
                try:
                    time.sleep(delay)
                finally:  # the ranks of a TP > 1 server share the file: the first one back removes it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(waiting)
                deadline += delay
            receive(job, deadline)

        def corrupt_pull(peer, src, dst, deadline):
            stats = pull(peer, src, dst, deadline)
            path = os.environ.get("VLLM_EXT_TEST_CORRUPT", "")
            if path and os.path.exists(path):
                # on a GPU the noise goes on the pull's stream and is waited for, as the pull is:
                # the digests after it (on that stream) must see it
                stream = receiver.stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    g = torch.Generator().manual_seed(1234)
                    for layer in worker.cache.layers:
                        noise = torch.randn((len(dst), *layer.shape[1:]), generator=g) * 3
                        layer[dst] = noise.to(device=layer.device, dtype=layer.dtype)
                if stream is not None:
                    stream.synchronize()
            return stats

        receiver.receive = slow_receive
        receiver.pull = corrupt_pull

    def build_connector_meta(self, scheduler_output):
        if self._step_pause_s:
            time.sleep(self._step_pause_s)
        return super().build_connector_meta(scheduler_output)
