"""Spawned worker processes for the migration tests (no tests here).

A Worker is one process (spawn context) that owns KV caches and MigrationEndpoints and obeys
commands sent over a pipe: every call has a timeout, every stop checks the exit code, and a
survivor is killed. Cache contents are random bytes from a seed, so the parent can compute
the expected bytes of any block without asking (`expected_blocks`).
"""

import multiprocessing as mp
import os
import signal
import time
import traceback

import torch

SPAWN = mp.get_context("spawn")
CALL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0


def fill_cache(cache, seed: int) -> None:
    """Random bytes in every layer tensor (a function of the seed and the layer index)."""
    for i, layer in enumerate(cache.layers):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        data = torch.randint(0, 256, (layer.numel() * layer.element_size(),), generator=g,
                             dtype=torch.uint8)
        layer.view(-1).view(torch.uint8).copy_(data.to(layer.device))


def block_rows(cache, ids):
    """Rows [len(ids), block_nbytes] of the cache's blocks, on the CPU (wire format)."""
    from vllm_ext import ops

    rows = ops.gather_blocks(cache, list(ids))
    if rows.device.type == "cuda":
        torch.cuda.synchronize(rows.device)
    return rows.cpu()


def make_cache(spec):
    from vllm_ext import KVCache

    cache = KVCache.allocate(
        num_layers=spec["num_layers"], num_blocks=spec["num_blocks"],
        block_size=spec["block_size"], num_kv_heads=spec["num_kv_heads"],
        head_size=spec["head_size"], dtype=getattr(torch, spec["dtype"]),
        device=spec.get("device", "cpu"), layout=spec["layout"])
    fill_cache(cache, spec["seed"])
    return cache


def expected_blocks(spec, ids):
    """What a cache made by make_cache(spec) holds at blocks `ids`, computed on the CPU."""
    cpu_spec = dict(spec, device="cpu")
    return block_rows(make_cache(cpu_spec), ids)


class StallFaults:
    """The fault hooks of a test endpoint (vllm_ext.migration.base.Faults): the source pauses
    `seconds` before serving chunk `chunk` (an int), or at a named step ("connect"); the
    library's pull server (nccl) reads {chunk, microseconds} from `native_stall`."""

    def __init__(self):
        import ctypes

        self.native_stall = (ctypes.c_int64 * 2)(-1, 0)
        self.at = None

    def stall(self, chunk, seconds):
        self.at = None if chunk is None else (chunk, seconds)
        native = isinstance(chunk, int) and not isinstance(chunk, bool)
        self.native_stall[1] = int(seconds * 1e6) if native else 0
        self.native_stall[0] = chunk if native else -1

    def pause(self, step):
        if self.at is not None and step == self.at[0]:
            time.sleep(self.at[1])


class RemoteError(Exception):
    """An exception raised in the worker: `type_name`, message, and MigrationError fields."""

    def __init__(self, type_name, message, fields):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.fields = fields


def _worker_main(conn, device):
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    caches, endpoints = {}, {}
    while True:
        try:
            request_id, cmd, args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                for ep in endpoints.values():
                    ep.close()
                conn.send((request_id, "ok", None))
                return
            result = _run(cmd, args, caches, endpoints)
            conn.send((request_id, "ok", result))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            fields = {k: getattr(e, k, None) for k in ("remote_type", "dst_block_ids")}
            conn.send((request_id, "error",
                       (type(e).__name__, str(e), fields, traceback.format_exc())))


def _run(cmd, args, caches, endpoints):
    from vllm_ext.migration import MigrationEndpoint

    if cmd == "endpoint":  # (name, spec, backend, options) -> descriptor
        name, spec, backend, options = args
        if name in endpoints:  # left over from a failed test: replace it
            endpoints.pop(name).close()
        cache = make_cache(spec)
        ep = endpoints[name] = MigrationEndpoint(cache, backend=backend, **options)
        ep._context.faults = StallFaults()
        caches[name] = cache
        # Count the data paths the backend builds (the "connects" command reads it).
        ep.test_connects, connect = 0, ep.backend.connect

        def counted_connect(link, deadline):
            ep.test_connects += 1
            return connect(link, deadline)

        ep.backend.connect = counted_connect
        return ep.descriptor()
    if cmd == "connects":  # (name,) -> how many times the backend built a data path to a peer
        return endpoints[args[0]].test_connects
    if cmd == "connect":  # (name, descriptor, timeout) -> whether it built the data path
        name, desc, timeout = args
        return endpoints[name].connect(desc, timeout=timeout)
    if cmd == "disconnect":  # (name, descriptor, timeout) -> whether anything was held
        name, desc, timeout = args
        return endpoints[name].disconnect(desc, timeout=timeout)
    if cmd == "pull_and_disconnect":
        # (name, descriptor, src, dst, timeout, after_s, disconnect_timeout) -> a dict: a pull
        # runs on a thread; after_s into it, disconnect(descriptor) is called on this thread.
        import threading

        name, desc, src, dst, timeout, after_s, disconnect_timeout = args
        ep, out = endpoints[name], {}

        def pull():
            try:
                out["pull"] = ep.pull(desc, src, dst, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported
                out["pull"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=pull)
        thread.start()
        time.sleep(after_s)
        start = time.monotonic()
        try:
            out["disconnect"] = ep.disconnect(desc, timeout=disconnect_timeout)
        except Exception as e:  # noqa: BLE001 - reported
            out["disconnect"] = f"{type(e).__name__}: {e}"
        out["waited"] = time.monotonic() - start
        thread.join(timeout + 10)
        return out
    if cmd == "links":  # (name,) -> (peers with a link, pairs served to peers, pairs parked)
        ep = endpoints[args[0]]
        parked = ep.backend.parked_count() if hasattr(ep.backend, "parked_count") else 0
        return ep._destination.link_count(), ep._source.pair_count(), parked
    if cmd == "close":  # -> whether the endpoint existed
        ep = endpoints.pop(args[0], None)
        caches.pop(args[0], None)
        if ep is not None:
            ep.close()
        return ep is not None
    if cmd == "pull":  # (name, descriptor, src, dst, timeout) -> PullStats
        name, desc, src, dst, timeout = args
        return endpoints[name].pull(desc, src, dst, timeout=timeout)
    if cmd == "pull_after_write":  # (name, descriptor, src, dst, timeout, fill) -> PullStats
        # The current stream first sleeps (~0.1 s of GPU time), then writes `fill` into the dst
        # blocks; pull is called while that work is still queued.
        from vllm_ext import ops

        name, desc, src, dst, timeout, fill = args
        cache = caches[name]
        torch.cuda._sleep(200_000_000)
        rows = torch.full((len(dst), cache.block_nbytes), fill, dtype=torch.uint8, device=cache.device)
        ops.scatter_blocks(rows, cache, dst)
        return endpoints[name].pull(desc, src, dst, timeout=timeout)
    if cmd == "blocks":  # (name, ids) -> CPU rows
        name, ids = args
        return block_rows(caches[name], ids)
    if cmd == "stall":  # (name, chunk, seconds): the source pauses while serving that chunk
        name, chunk, seconds = args
        endpoints[name]._context.faults.stall(chunk, seconds)
        return None
    if cmd == "pid":
        return os.getpid()
    if cmd == "sleep":  # (seconds,): the harness's own tests
        time.sleep(args[0])
        return "slept"
    raise ValueError(f"unknown command {cmd!r}")


class Worker:
    """One worker process. Every request carries an id and a reply is matched to it: a reply
    that arrives after its caller gave up (a timeout, a failed test) is dropped, never taken
    as the answer to a later request. `healthy` is False while an abandoned request may still
    run; fixtures replace such a worker instead of queueing behind it."""

    def __init__(self, device="cpu", wait=True):
        self.device = device
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_worker_main, args=(child, device), daemon=True)
        self.proc.start()
        child.close()
        self._next_id = 0
        self._waiting = None  # id of the request result() waits for
        self._abandoned = set()  # ids sent whose replies nobody will read
        if wait:
            self.ready()

    def ready(self, timeout=START_TIMEOUT_S):
        """Waits until the process answers (start-up imports torch and the library)."""
        self.call("pid", timeout=timeout)
        return self

    @property
    def healthy(self):
        return self.proc.is_alive() and not self._abandoned and self._waiting is None

    def send(self, cmd, *args):
        """Starts a command; collect its result with result()."""
        if self._waiting is not None:  # the previous request's result was never collected
            self._abandoned.add(self._waiting)
        self._next_id += 1
        self._waiting = self._next_id
        self.conn.send((self._next_id, cmd, args))
        return self._next_id

    def result(self, timeout=CALL_TIMEOUT_S):
        """The reply to the last send(); TimeoutError after `timeout` seconds."""
        want = self._waiting
        if want is None:
            raise RuntimeError("result(): no request is outstanding")
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 or not self.conn.poll(remaining):
                self._abandoned.add(want)
                self._waiting = None
                raise TimeoutError(f"worker {self.proc.pid} ({self.device}): no answer within "
                                   f"{timeout} s")
            try:
                request_id, status, value = self.conn.recv()
            except EOFError:
                self._waiting = None
                raise EOFError(f"worker {self.proc.pid} ({self.device}) exited "
                               f"(code {self.proc.exitcode})") from None
            if request_id != want:  # the late answer to an abandoned request
                self._abandoned.discard(request_id)
                continue
            self._waiting = None
            if status == "error":
                type_name, message, fields, tb = value
                raise RemoteError(type_name, message + "\n" + tb, fields)
            return value

    def call(self, cmd, *args, timeout=CALL_TIMEOUT_S):
        self.send(cmd, *args)
        return self.result(timeout)

    def kill(self):
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout=30.0):
        """Asks the worker to exit; returns its exit code (a survivor is killed: -9)."""
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except (TimeoutError, EOFError, OSError, RemoteError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
        return self.proc.exitcode


def start_workers(devices, timeout=START_TIMEOUT_S):
    """Workers on `devices`, started in parallel (each start-up takes seconds)."""
    workers = [Worker(d, wait=False) for d in devices]
    try:
        for w in workers:
            w.ready(timeout)
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


def close_quietly(worker, *names, timeout=20.0):
    """Test clean-up: closes endpoints `names` without masking the test's own failure; a
    worker that does not answer is left unhealthy (its fixture replaces it)."""
    for name in names:
        if not worker.healthy:
            return
        try:
            worker.call("close", name, timeout=timeout)
        except (RemoteError, TimeoutError, EOFError, OSError):
            pass
