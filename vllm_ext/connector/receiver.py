"""A consumer's pull pipeline (the worker process): each RecvJob runs on a thread of its own
(with its own CUDA stream): describe the producer and connect to it when first seen, acquire the
lease, check that it holds the request's own tokens (the producer binds a lease to the tokens it
computed), pull, verify the blocks against the producer's digests, release the lease. Results
are taken at the next get_transfer_results. An acquire may wait, up to the job's deadline, for a
busy producer to serve the lease's blocks; each pull thread has its own lease connection to a
producer, so that one such wait holds no other job's lease requests back.

A consumer dials only producers on its allow-list; every job has a deadline counted from when it
was queued, and a producer that just failed a job is not dialled again for BACKOFF_S. At
start-up it connects to its connect_to producers ahead of the first pull, retrying while they
start (for CONNECT_AHEAD_S); those attempts hold no pull back.

A sync job (scheduler/consumer.py's rule) runs on the worker's thread, before the forward of the
step that scheduled its request, under a deadline of its own (`sync_timeout_s`: it holds the whole
step), and its pull's timeout is cut so that a backend that waits past it for a source that makes
progress (gloo, up to PULL_PATIENCE times) still ends by that deadline.

Where a load's time goes is recorded per phase (VllmExtStats.record_phases, PHASES): waiting on
the queue, describing and connecting a new producer, the lease acquire (a round trip to the
producer's scheduler, which answers once its worker serves the blocks), the pull, the digest
check, and the release. A pull checked against the producer's digests is vouched for by them: its
receive is reported at once and its release goes out on the release thread (no round trip on the
load's path). Without digests the release's answer is what vouches (the lease held through the
pull), so the receive waits for it.

Under tensor parallelism each TP rank's worker has a Receiver, which acquires and releases the
lease as rank r of `ranks` (the producer ends it once every rank released it). At equal TP sizes
rank r describes, connects to and pulls from the producer's rank r (its shard of every block).
At unequal sizes (a ShardRoute) it pulls the whole blocks of each producer rank holding some of
its heads into a staging cache of that rank's shard geometry (its own endpoint, serving nothing),
checks them against that rank's digests, and copies its heads into its cache with
ops.copy_blocks' head ranges; the heads must split evenly over both sides.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from .. import KVCache, ops
from ..lease import messages
from ..lease.channel import ChannelError, ChannelRefused, LeaseClient
from ..lease.kv_params import fingerprint_mismatch, instance_fields, shard_plan, source_ranks
from ..lease.messages import MAX_HOLD_S
from ..migration import MigrationEndpoint, MigrationError, PeerDescriptor
from ..migration.gloo import PATIENCE as GLOO_PATIENCE
from .metadata import RecvJob, ReleaseJob
from .stats import VllmExtStats

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

CHANNEL_TIMEOUT_S = 5.0
MAX_CONCURRENT_PULLS = 2
# Producers a consumer keeps lease connections to (their addresses come from requests): past
# this many connections (one per producer and thread), the least recently opened is closed.
MAX_PRODUCERS = 64
MAX_LEASE_CLIENTS = MAX_PRODUCERS * (MAX_CONCURRENT_PULLS + 2)  # the pull threads, the worker's, a dial's
# A producer that could not be reached (or whose endpoint failed a pull) is not dialled again
# for this long: jobs for it fail at once meanwhile.
BACKOFF_S = 5.0
# a load slower than this is logged with where its time went (queued, connect, lease, pull, release)
SLOW_LOAD_S = 1.0
# At start-up a consumer dials its connect_to producers until it is connected or this long has
# passed (servers of a deployment start together: a producer may take minutes to be ready).
CONNECT_AHEAD_S = 900.0
CONNECT_AHEAD_RETRY_S = (0.5, 5.0)  # the first wait between attempts, doubled up to the second
# A receive that failed before it released its lease releases it (for its rank) on a thread of
# its own, given up this long after the failure: the lease ends only once every rank released it.
RELEASE_WITHIN_S = 30.0
# How many times its timeout a backend's pull may run while its source makes progress (gloo
# follows it); the acquire holds the lease that long, so that it never ends under a pull.
PULL_PATIENCE = {"gloo": GLOO_PATIENCE}
# Blocks of a staging cache (unequal TP sizes): a pull moves this many at a time per source rank.
STAGING_BLOCKS = 16
# The phases of a load, in order, as its stats name them (VllmExtStats.record_phases).
PHASES = ("queued", "connect", "acquire", "pull", "verify", "release")


class TransferFailed(RuntimeError):
    """A receive failed for a reason worth one log line (the request is failed or recomputed)."""


def lease_index(job: RecvJob) -> List[int]:
    """The indices in the lease's blocks of the job's src_block_ids."""
    if job.lease_index is not None:
        return list(job.lease_index)
    return list(range(job.first_block, job.first_block + len(job.src_block_ids)))


def _left(deadline: float, cap: Optional[float] = None) -> float:
    """Seconds until `deadline` (at most `cap`); TransferFailed once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferFailed("the pull's deadline passed")
    return left if cap is None else min(left, cap)


@contextlib.contextmanager
def _held(lock: threading.Lock, deadline: float, what: str):
    """`lock`, waited for up to `deadline` (a sync load holds the worker's step meanwhile)."""
    if not lock.acquire(timeout=_left(deadline)):
        raise TransferFailed(f"the pull's deadline passed while {what}")
    try:
        yield
    finally:
        lock.release()


def _log_if_slow(job: RecvJob, marks: List[Tuple[str, float]]) -> None:
    """One log line for a load slower than SLOW_LOAD_S, with where its time went. `marks`:
    (the step just ended, monotonic time), the first being when the job was queued."""
    total = marks[-1][1] - marks[0][1]
    if total >= SLOW_LOAD_S:
        split = ", ".join(f"{name} {1e3 * (t - before):.0f} ms" for (_, before), (name, t) in zip(marks, marks[1:]))
        logger.info("request %s: loading %d blocks from %s:%d took %.2f s (%s)", job.req_id,
                    len(job.dst_block_ids), job.lease_host, job.lease_port, total, split)


def descriptor_from_fields(fields: Any) -> PeerDescriptor:
    """A producer's endpoint descriptor from its lease.describe reply."""
    if not isinstance(fields, dict):
        raise TransferFailed(f"the producer's descriptor is malformed: {type(fields).__name__}")
    known = {f.name for f in dataclasses.fields(PeerDescriptor)}
    try:
        return PeerDescriptor(**{k: v for k, v in fields.items() if k in known})
    except TypeError as e:
        raise TransferFailed(f"the producer's descriptor is malformed: {e}") from e


@dataclasses.dataclass
class ShardSource:
    """A producer rank holding some of this rank's KV heads (unequal TP sizes): its endpoint, and
    `count` heads from `src_first` of its shard, which go to `dst_first` of this rank's."""

    rank: int
    peer: PeerDescriptor
    src_first: int
    dst_first: int
    count: int


class Staging:
    """STAGING_BLOCKS blocks shaped like a producer rank's shard (`heads` KV heads, the rest as
    `like`, this rank's cache, in its physical order so that head ranges copy between them), and
    an endpoint (from `make_endpoint`) that pulls whole blocks into them; one pull at a time."""

    def __init__(self, like: KVCache, heads: int, make_endpoint: Callable[[KVCache], MigrationEndpoint]):
        layers = []
        for t in like.layers:  # vLLM's [num_blocks, H, block_size, C] views
            order = sorted(range(4), key=lambda d: -t.stride(d))  # outermost first
            shape = [STAGING_BLOCKS, heads, t.shape[2], t.shape[3]]
            backing = torch.zeros([shape[d] for d in order], dtype=t.dtype, device=t.device)
            layers.append(backing.permute([order.index(d) for d in range(4)]))
        self.cache = KVCache.from_layers(layers, layout="blocks")
        self.endpoint = make_endpoint(self.cache)
        self.lock = threading.Lock()
        self.connected: Set[str] = set()  # endpoint ids of the producer ranks connected

    def close(self) -> None:
        self.endpoint.close()


@dataclasses.dataclass
class ShardRoute:
    """How this rank loads from a producer of another TP size: each source's whole blocks into
    `staging`, then its heads into this rank's cache."""

    sources: List[ShardSource]
    staging: Staging


class Receiver:
    """Args are values: the deployment secret, the producers it may dial ("host:port"), those
    it connects to at start-up, the pull's deadline, and whether pulls are checked against the
    producer's digests. `start` gives it the cache, the endpoint that pulls into it, this
    cache's fingerprint fields and the stream pulls run on (None on CPU).

    `receive` and `pull` are looked up on the instance at each use: a test-only fault connector
    may replace them on an instance (tests/e2e/live_faults.py), and read `stream`."""

    def __init__(self, *, secret: bytes, allowed: Set[str], connect_to: List[str], pull_timeout_s: float,
                 verify_kv: bool, rank: int = 0, ranks: int = 1, sync_timeout_s: Optional[float] = None):
        self._secret = secret
        self.rank, self.ranks = rank, ranks  # this worker's TP rank and the instance's TP size
        self._allowed = set(allowed)
        self._connect_to = list(connect_to)
        self.pull_timeout_s = pull_timeout_s
        # a sync load's deadline: it holds the worker's step (default: the pull's)
        self.sync_timeout_s = pull_timeout_s if sync_timeout_s is None else sync_timeout_s
        self.verify_kv = verify_kv
        self.cache: Optional[KVCache] = None
        self.endpoint: Optional[MigrationEndpoint] = None
        self.stream = None
        self._fingerprint_fields: Dict[str, Any] = {}
        self._make_endpoint: Optional[Callable[[KVCache], MigrationEndpoint]] = None
        self._staging: Dict[int, Staging] = {}  # a producer rank's head count -> its staging cache
        self._staging_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="vllm-ext-pull")
        # releases of failed receives: a producer slow to answer holds no pull back
        self._release_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-ext-release")
        self._lock = threading.Lock()  # results, clients, peers and back-off: pull threads + the worker thread
        self._done: Set[str] = set()  # receives reported (failed ones too)
        self._failed: Set[str] = set()
        self._failed_blocks: Set[int] = set()  # of every failed load
        self._sync_failed_blocks: Set[int] = set()  # of failed sync loads: always reported as invalid
        self._stats = VllmExtStats()
        self._clients: Dict[Tuple[str, int, int], LeaseClient] = {}  # (host, port, thread id) -> its connection
        # producer instance's endpoint id (its rank 0's, which requests name) -> its endpoint of this
        # rank (equal TP sizes) or the route to its ranks that hold this rank's heads
        self._peers: Dict[str, Union[PeerDescriptor, ShardRoute]] = {}
        self._endpoint_at: Dict[Tuple[str, int], str] = {}  # producer -> the instance endpoint id last connected there
        self._peer_locks: Dict[Tuple[str, int], threading.Lock] = {}
        self._backoff: Dict[Tuple[str, int], float] = {}  # producer -> monotonic time it may be dialled again

    def start(self, cache: KVCache, endpoint: MigrationEndpoint, fingerprint_fields: Dict[str, Any], stream,
              make_endpoint: Optional[Callable[[KVCache], MigrationEndpoint]] = None) -> None:
        """`make_endpoint`: an endpoint over a staging cache, serving none of its blocks (None: a
        producer of another TP size is refused)."""
        self.cache, self.endpoint, self.stream = cache, endpoint, stream
        self._fingerprint_fields = fingerprint_fields
        self._make_endpoint = make_endpoint
        for address in self._connect_to:
            threading.Thread(target=self._connect_ahead, args=(address,), name="vllm-ext-connect-ahead",
                             daemon=True).start()

    # ---- the worker's thread -------------------------------------------------------------
    def submit(self, jobs: List[RecvJob], releases: List[ReleaseJob]) -> None:
        """A step's jobs: a refused one fails at once, a sync one is loaded now (this step's
        forward reads its blocks; all of a step's under one deadline), the others on the pull
        threads."""
        now = time.monotonic()
        deadline, sync_deadline = now + self.pull_timeout_s, now + self.sync_timeout_s
        for job in jobs:
            if job.error is not None:
                self._finish(job, False, job.error)
            elif job.sync:
                self.receive(job, sync_deadline)
            else:
                self._pool.submit(self.receive, job, deadline)
        for release in releases:
            self._release_pool.submit(self._release_only, release)

    def take_finished(self) -> Tuple[Set[str], Set[str]]:
        """(finished_recving, failed_recving) since the last call; failed receives are in
        finished_recving too."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def take_failed_blocks(self) -> Tuple[Set[int], Set[int]]:
        """(blocks of every failed load, blocks of failed sync loads) since the last call."""
        with self._lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            sync, self._sync_failed_blocks = self._sync_failed_blocks, set()
        return blocks, sync

    def take_stats(self) -> Optional[VllmExtStats]:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, VllmExtStats()
        return stats

    @property
    def connected_endpoints(self) -> Tuple[str, ...]:
        """The endpoint ids of the producers connected, the oldest first."""
        with self._lock:
            return tuple(self._peers)

    @property
    def backoff(self) -> Dict[Tuple[str, int], float]:
        """The producers that failed a dial or a pull: (host, port) -> the monotonic time it may
        be dialled again."""
        with self._lock:
            return dict(self._backoff)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._release_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients = list(self._clients.values())
        for client in clients:
            client.close()
        for staging in self._staging.values():
            staging.close()
        self._staging = {}
        self.endpoint = None

    # ---- the pull threads ----------------------------------------------------------------
    def receive(self, job: RecvJob, deadline: float) -> None:
        """`deadline`: monotonic time by which the job is done, counted from when it was queued."""
        timeout = self.sync_timeout_s if job.sync else self.pull_timeout_s
        marks = [("", deadline - timeout), ("queued", time.monotonic())]  # (step ended, when)
        phases: Dict[str, float] = {}  # pull and verify: their attempts' sums
        client, acquired, pulling, released = None, False, False, False
        try:
            if time.monotonic() >= deadline:
                raise TransferFailed(f"the pull's deadline ({timeout:g} s) passed while it was queued")
            client = self._client(job.lease_host, job.lease_port)
            peer = self.connect_producer(job.lease_host, job.lease_port, job.endpoint_id, deadline)
            marks.append(("connect", time.monotonic()))
            try:  # the producer answers once its worker serves the blocks: a busy one takes a while
                lease_blocks, lease_tokens, lease_hash, digests = client.acquire(
                    job.lease, self._hold_s(peer, deadline), _left(deadline), job.num_tokens, job.prompt_hash,
                    self.rank, self.ranks)
            except ChannelRefused as refused:
                if refused.kind == messages.NotThisPrompt.__name__:  # the params (the client's) named a
                    # lease on other tokens, whose KV would be cached here under this request's block
                    # hashes: refused, and the lease freed (its own consumer never comes)
                    with self._lock:
                        self._stats.record_refusal()
                    self._release(client, job.lease)
                    released = True
                raise
            marks.append(("acquire", time.monotonic()))
            acquired = True
            # the producer checked it holds these tokens (a migration lease: maybe a prefix of
            # its own); what its reply says must agree, whatever the params (the client's) said
            if lease_tokens < job.num_tokens or (lease_tokens == job.num_tokens and lease_hash != job.prompt_hash):
                with self._lock:  # a producer that did not check: refused here as well
                    self._stats.record_refusal()
                raise TransferFailed(f"lease {job.lease[:8]}: it holds {lease_tokens} tokens of another prompt "
                                     f"(hash {lease_hash[:8]}), not this request's first {job.num_tokens} "
                                     f"(hash {job.prompt_hash[:8]}); refused before any pull")
            expected = job.src_block_ids
            index = lease_index(job)
            if max(index, default=-1) >= len(lease_blocks) or [lease_blocks[i] for i in index] != expected:
                raise TransferFailed(f"lease {job.lease[:8]}: kv_transfer_params.remote_block_ids differ from the "
                                     "lease's blocks")
            pulling = True
            pull_by = self._pull_deadline(peer, deadline) if job.sync else deadline
            if isinstance(peer, ShardRoute):
                nbytes, checked = self._pull_shards(peer, job, expected, digests, len(lease_blocks), index, pull_by,
                                                    phases)
            else:
                want = [digests[i] for i in index] if digests else []
                nbytes, checked = self._pull_checked(peer, job, expected, want, pull_by, phases)
            marks.append(("pull", time.monotonic()))
            acquired, released = False, True
            if checked:  # the digests vouch for the blocks: reported now, released off the load's path
                self._release_pool.submit(self._release_only, ReleaseJob(job.req_id, job.lease, job.lease_host,
                                                                         job.lease_port))
            else:
                if not self._release(client, job.lease):
                    raise TransferFailed(f"lease {job.lease[:8]}: the producer could not vouch for the blocks after "
                                         "the pull (its request was preempted meanwhile, or the release failed); "
                                         "not used")
                marks.append(("release", time.monotonic()))
            for (_, before), (name, t) in zip(marks, marks[1:]):
                if name in ("queued", "connect", "acquire", "release"):
                    phases[name] = t - before
            self._finish(job, True, nbytes=nbytes, seconds=marks[-1][1] - marks[1][1], phases=phases)
            _log_if_slow(job, marks)
        except BaseException as e:  # noqa: BLE001 - a receive must always be reported
            if pulling and self.stream is not None:
                # nothing of this pull may still write into the blocks once vLLM reuses them: the
                # endpoint has aborted the pair, what is left on the stream is local copies
                try:
                    self.stream.synchronize()
                except RuntimeError as sync_error:  # a broken device: the engine fails on its own
                    logger.error("request %s: synchronising the failed pull's stream: %s", job.req_id, sync_error)
            if isinstance(e, MigrationError):
                with self._lock:
                    self._peers.pop(job.endpoint_id, None)  # connect again next time (peer may have restarted)
                self._back_off(job.lease_host, job.lease_port)
            if not isinstance(e, (ChannelError, MigrationError, TransferFailed, ValueError, TypeError, OSError)):
                logger.exception("request %s: unexpected failure while receiving", job.req_id)
            self._finish(job, False, f"{type(e).__name__}: {e}")
            if not (acquired or released):  # failed before its acquire (or with no answer to it): this
                # rank's release, without which the producer holds the lease until its hold ends
                self._release_pool.submit(self._release_only, ReleaseJob(job.req_id, job.lease, job.lease_host,
                                                                         job.lease_port), time.monotonic())
        finally:
            if client is not None and acquired:
                self._release(client, job.lease)

    @staticmethod
    def _pull_deadline(peer: Union[PeerDescriptor, ShardRoute], deadline: float) -> float:
        """A sync load's pull deadline: a backend that waits up to PULL_PATIENCE times its
        timeout for a source that makes progress still ends by `deadline`."""
        backend = (peer.sources[0].peer if isinstance(peer, ShardRoute) else peer).backend
        now = time.monotonic()
        return now + (deadline - now) / PULL_PATIENCE.get(backend, 1.0)

    @staticmethod
    def _hold_s(peer: Union[PeerDescriptor, ShardRoute], deadline: float) -> float:
        """How long the acquire holds the lease: every pull starts before `deadline` and runs at
        most its backend's patience times what was left of it then, so all end within that
        patience times what is left now; then the release's CHANNEL_TIMEOUT_S."""
        backend = (peer.sources[0].peer if isinstance(peer, ShardRoute) else peer).backend
        return min(_left(deadline) * PULL_PATIENCE.get(backend, 1.0) + CHANNEL_TIMEOUT_S, MAX_HOLD_S)

    def _pull_checked(self, peer: PeerDescriptor, job: RecvJob, src: List[int], want: List[int],
                      deadline: float, phases: Dict[str, float]) -> Tuple[int, bool]:
        """The pull from the producer's rank of this rank's number, checked against its digests
        `want` (a mismatch pulls once more). Returns (the bytes pulled, whether checked)."""
        return self._verified(self.pull, peer, src, job.dst_block_ids, self.cache, deadline, want, job,
                              "the pulled blocks differ from the producer's digests", phases)

    def _verified(self, pull, peer: PeerDescriptor, src: List[int], dst: List[int], cache: KVCache,
                  deadline: float, want: List[int], job: RecvJob, what: str,
                  phases: Dict[str, float]) -> Tuple[int, bool]:
        """`pull(peer, src, dst, deadline)` into `cache`, then the digests of its blocks `dst`
        checked against `want` (none, or verify_kv off: unchecked, no digest pass): a mismatch is
        counted, logged and pulled once more, a second one fails the transfer (`what` says which
        blocks differ from which digests). Returns (the bytes pulled, whether checked); the time
        of the pulls and of the digest passes is added to `phases` ("pull", "verify")."""
        check = self.verify_kv and bool(want)
        for attempt in (1, 2):
            started = time.monotonic()
            stats = pull(peer, src, dst, deadline)
            pulled = time.monotonic()
            phases["pull"] = phases.get("pull", 0.0) + pulled - started
            if not check:
                return stats.nbytes, False
            same = self._digests(dst, cache) == want
            phases["verify"] = phases.get("verify", 0.0) + time.monotonic() - pulled
            if same:
                return stats.nbytes, True
            with self._lock:
                self._stats.record_mismatch()
            logger.warning("request %s: %s (attempt %d of 2)", job.req_id, what, attempt)
        raise TransferFailed(f"lease {job.lease[:8]}: {what} twice; not used")

    def pull(self, peer: PeerDescriptor, src: List[int], dst: List[int], deadline: float):
        return self._pull_into(self.endpoint, peer, src, dst, deadline)

    def _pull_into(self, endpoint: MigrationEndpoint, peer: PeerDescriptor, src: List[int], dst: List[int],
                   deadline: float):
        return self._on_stream(endpoint.pull, peer, src, dst, timeout=_left(deadline))

    def _on_stream(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the receiver's own stream (beside the engine's), finished
        before it returns; called directly where there is no stream (CPU)."""
        if self.stream is None:
            return fn(*args, **kwargs)
        with torch.cuda.stream(self.stream):
            out = fn(*args, **kwargs)
        self.stream.synchronize()
        return out

    def _digests(self, block_ids: List[int], cache: Optional[KVCache] = None) -> List[int]:
        cache = cache or self.cache
        if self.stream is None:
            return ops.block_digests(cache, block_ids)
        with torch.cuda.stream(self.stream):  # beside the engine's stream, not on it
            return ops.block_digests(cache, block_ids)

    def _pull_shards(self, route: ShardRoute, job: RecvJob, src: List[int], digests: List[int], n: int,
                     index: List[int], deadline: float, phases: Dict[str, float]) -> Tuple[int, bool]:
        """A pull from a producer of another TP size: per chunk of STAGING_BLOCKS blocks and per
        source rank, its whole blocks into the staging cache (checked against that rank's digests,
        the k-th `n` of `digests`, at the lease's blocks `index`; a mismatch pulls once more), then
        its heads into this rank's blocks. Returns (the bytes pulled, whether every chunk was
        checked)."""
        staging, nbytes, checked = route.staging, 0, True
        if not staging.lock.acquire(timeout=_left(deadline)):  # the other pull thread's, up to its deadline
            raise TransferFailed("the pull's deadline passed while another pull used the staging cache")
        try:
            for start in range(0, len(src), STAGING_BLOCKS):
                chunk, dst = src[start:start + STAGING_BLOCKS], job.dst_block_ids[start:start + STAGING_BLOCKS]
                rows = list(range(len(chunk)))
                for k, source in enumerate(route.sources):
                    want = [digests[k * n + i] for i in index[start:start + len(chunk)]] if digests else []
                    what = f"the blocks pulled from producer rank {source.rank} differ from its digests"
                    moved, verified = self._verified(functools.partial(self._pull_into, staging.endpoint),
                                                     source.peer, chunk, rows, staging.cache, deadline, want, job,
                                                     what, phases)
                    nbytes, checked = nbytes + moved, checked and verified
                    self._copy_heads(staging.cache, rows, dst, source)
        finally:
            staging.lock.release()
        return nbytes, checked and bool(src)

    def _copy_heads(self, staged: KVCache, rows: List[int], dst: List[int], source: ShardSource) -> None:
        self._on_stream(ops.copy_blocks, staged, rows, self.cache, dst,
                        src_heads=(source.src_first, source.count), dst_heads=(source.dst_first, source.count))

    def _finish(self, job: RecvJob, ok: bool, why: str = "", nbytes: int = 0, seconds: float = 0.0,
                phases: Optional[Dict[str, float]] = None) -> None:
        with self._lock:
            if not job.sync:  # vLLM waits for an asynchronous load's report; a sync load has none
                self._done.add(job.req_id)
            if ok:
                self._stats.record_transfer(nbytes, seconds, self.rank, sync=job.sync)
                self._stats.record_phases(phases or {})
            else:
                if job.sync:
                    self._sync_failed_blocks.update(job.dst_block_ids)
                else:
                    self._failed.add(job.req_id)
                self._failed_blocks.update(job.dst_block_ids)
                self._stats.record_failure(self.rank)
        if not ok:
            logger.warning("request %s: receiving its KV failed: %s", job.req_id, why)

    def _release(self, client: LeaseClient, lease: str, timeout: float = CHANNEL_TIMEOUT_S) -> bool:
        """Ends the lease; False when the producer says its blocks changed owner meanwhile (a
        running request's pre-copy, preempted), or when the release fails (the lease then
        expires by itself, and what was pulled cannot be vouched for)."""
        try:
            return client.release(lease, timeout, self.rank, self.ranks)
        except ChannelError as e:
            logger.warning("lease %s: release failed (it expires by itself): %s", lease[:8], e)
            return False

    def _release_only(self, job: ReleaseJob, since: Optional[float] = None) -> None:
        """A lease this instance will not pull (or whose receive failed at `since`): freed now
        rather than at its expiry, by an allowed producer even in back-off; given up
        RELEASE_WITHIN_S after `since`."""
        left = RELEASE_WITHIN_S if since is None else since + RELEASE_WITHIN_S - time.monotonic()
        try:
            if left <= 0:
                raise TransferFailed(f"not sent within {RELEASE_WITHIN_S:g} s")
            client = self._client(job.lease_host, job.lease_port, back_off=False)
        except TransferFailed as e:
            logger.warning("request %s: not releasing lease %s: %s", job.req_id, job.lease[:8], e)
            return
        self._release(client, job.lease, min(left, CHANNEL_TIMEOUT_S))

    # ---- producers: allow-list, back-off, lease clients, connected peers ----------------
    def _check_allowed(self, host: str, port: int, back_off: bool = True) -> None:
        """TransferFailed unless host:port is an allowed producer not in back-off (`back_off`
        false: in back-off or not, for a release)."""
        if f"{host}:{port}" not in self._allowed:
            raise TransferFailed(f"producer {host}:{port} is not in kv_connector_extra_config.allowed_producers "
                                 f"(default: connect_to); not dialled")
        if not back_off:
            return
        with self._lock:
            until = self._backoff.get((host, port), 0.0)
        if time.monotonic() < until:
            raise TransferFailed(f"producer {host}:{port} failed less than {BACKOFF_S:g} s ago; not dialled")

    def _back_off(self, host: str, port: int) -> None:
        with self._lock:
            self._backoff[(host, port)] = time.monotonic() + BACKOFF_S

    def _client(self, host: str, port: int, back_off: bool = True) -> LeaseClient:
        """This thread's lease connection to the producer (an acquire may wait on it); `back_off`
        false: one for a release, also while the producer is in back-off."""
        self._check_allowed(host, port, back_off)
        key = (host, port, threading.get_ident())
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                if len(self._clients) >= MAX_LEASE_CLIENTS:
                    oldest = next(iter(self._clients))
                    self._clients.pop(oldest).close()
                client = self._clients[key] = LeaseClient(self._secret, host, port)
                self._peer_locks.setdefault((host, port), threading.Lock())
            return client

    def connect_producer(self, host: str, port: int, endpoint_id: Optional[str], deadline: float,
                         back_off: bool = True) -> Union[PeerDescriptor, ShardRoute]:
        """The producer, checked against this cache and connected when first seen (the
        handshake: a layout mismatch is refused here, naming the fields): the descriptor of its
        rank of this rank's number at equal TP sizes, else the route to its ranks that hold this
        rank's heads. No `endpoint_id`: whichever instance is connected there already (a pull may
        have connected it before the start-up dial got through). A failure to reach it puts it in
        back-off unless `back_off` is false."""
        client = self._client(host, port)
        with _held(self._peer_locks[(host, port)], deadline, f"another pull connected to producer {host}:{port}"):
            known = endpoint_id or self._endpoint_at.get((host, port))
            peer = self._peers.get(known) if known else None
            if peer is not None:
                return peer

            def describe(rank: int):
                try:
                    return client.describe(_left(deadline, CHANNEL_TIMEOUT_S), rank=rank)
                except ChannelError:
                    if back_off:
                        self._back_off(host, port)
                    raise

            reply = describe(0)
            mine, theirs = self._fingerprint_fields, reply.fingerprint_fields
            diff = fingerprint_mismatch(instance_fields(mine), instance_fields(theirs))
            if diff:
                raise TransferFailed(f"producer {host}:{port} has an incompatible KV cache: {diff}")
            instance = reply.endpoint_id or descriptor_from_fields(reply.descriptor).endpoint_id
            if endpoint_id and instance != endpoint_id:
                raise TransferFailed(f"producer {host}:{port} serves endpoint {instance[:8]}, the request "
                                     f"names {endpoint_id[:8]} (the prefill instance restarted?)")
            def describe_rank(rank: int):  # every rank's reply must come from rank 0's instance
                described = describe(rank)
                if described.endpoint_id != instance:
                    raise TransferFailed(f"producer {host}:{port} rank {rank} belongs to instance "
                                         f"{described.endpoint_id[:8] or '(none)'}, rank 0 to {instance[:8]} (the "
                                         "prefill instance restarted between the two?)")
                return described

            producer_ranks = theirs.get("tp_size", 1)
            if not isinstance(producer_ranks, int) or isinstance(producer_ranks, bool) or producer_ranks < 1:
                raise TransferFailed(f"producer {host}:{port}: tp_size {producer_ranks!r} is not a TP size")
            started = time.perf_counter()
            try:
                if producer_ranks == self.ranks:
                    peer = self._connect_rank(describe_rank, reply, deadline, host, port)
                elif self.cache.layout == "mla":  # the latent is whole on every rank: one source rank
                    peer = self._connect_rank(describe_rank, reply, deadline, host, port,
                                              rank=source_ranks(self.rank, self.ranks, producer_ranks)[0])
                else:
                    peer = self._connect_shards(describe_rank, reply, producer_ranks, deadline, host, port)
            except MigrationError:
                if back_off:
                    self._back_off(host, port)
                raise
            logger.info("vllm-ext connector: connected to producer %s:%d (%s) in %.1f ms", host, port,
                        peer.short() if isinstance(peer, PeerDescriptor) else
                        f"TP {producer_ranks} -> {self.ranks}: rank {self.rank} gathers heads from ranks "
                        f"{[s.rank for s in peer.sources]}", 1e3 * (time.perf_counter() - started))
            with self._lock:
                if len(self._peers) >= MAX_PRODUCERS:  # endpoints of restarted producers
                    self._peers.pop(next(iter(self._peers)))
                self._peers[instance] = peer
                self._endpoint_at[(host, port)] = instance
            return peer

    def _connect_rank(self, describe, reply, deadline: float, host: str, port: int,
                      rank: Optional[int] = None) -> PeerDescriptor:
        """Equal TP sizes: the producer's rank of this rank's number, its shard laid out as ours.
        An MLA cache at unequal sizes: the producer's `rank`, whose latent is ours (replicated on
        every rank: only the TP sizes differ, and every block moves whole)."""
        rank = self.rank if rank is None else rank
        if rank:
            reply = describe(rank)
        mine, theirs = self._fingerprint_fields, reply.fingerprint_fields
        if mine.get("tp_size") != theirs.get("tp_size"):
            mine, theirs = ({k: v for k, v in f.items() if k != "tp_size"} for f in (mine, theirs))
        diff = fingerprint_mismatch(mine, theirs)
        if diff:
            raise TransferFailed(f"producer {host}:{port} has an incompatible KV cache: {diff}")
        peer = descriptor_from_fields(reply.descriptor)
        self.endpoint.connect(peer, timeout=_left(deadline))
        return peer

    def _connect_shards(self, describe, reply, producer_ranks: int, deadline: float, host: str,
                        port: int) -> ShardRoute:
        """Unequal TP sizes: the producer ranks holding this rank's heads, connected to the
        staging cache of their shard geometry."""
        heads = self._fingerprint_fields.get("num_kv_heads")
        try:
            if not isinstance(heads, int) or heads < 1:
                raise ValueError(f"num_kv_heads {heads!r}: unknown here")
            plan = shard_plan(heads, self.rank, self.ranks, producer_ranks)
        except ValueError as e:
            raise TransferFailed(f"producer {host}:{port} (TP {producer_ranks}, here {self.ranks}): {e}") from e
        if self._make_endpoint is None:
            raise TransferFailed(f"producer {host}:{port}: TP {producer_ranks}, here {self.ranks}: this receiver "
                                 "loads only from producers of its own TP size")
        theirs = heads // producer_ranks
        with self._staging_lock:  # producers of one shard geometry share a staging cache
            staging = self._staging.get(theirs)
            if staging is None:
                staging = self._staging[theirs] = Staging(self.cache, theirs, self._make_endpoint)
        sources = []
        for rank, src_first, dst_first, count in plan:
            described = reply if rank == 0 else describe(rank)
            shape = described.fingerprint_fields.get("layer_shape")
            diff = fingerprint_mismatch(instance_fields(self._fingerprint_fields),
                                        instance_fields(described.fingerprint_fields))
            if diff or not isinstance(shape, list) or shape[:1] != [theirs]:
                raise TransferFailed(f"producer {host}:{port} rank {rank} has an incompatible KV cache: "
                                     f"{diff or f'layer_shape {shape!r}, expected {theirs} heads'}")
            peer = descriptor_from_fields(described.descriptor)
            if peer.endpoint_id not in staging.connected:
                staging.endpoint.connect(peer, timeout=_left(deadline))
                staging.connected.add(peer.endpoint_id)
            sources.append(ShardSource(rank, peer, src_first, dst_first, count))
        return ShardRoute(sources, staging)

    def _connect_ahead(self, address: str) -> None:
        """Its own thread: connects to a connect_to producer before a pull needs it, trying again
        while the producer starts; a failure here puts it in no back-off (a pull dials it anew)."""
        host, _, port = address.rpartition(":")
        give_up = time.monotonic() + CONNECT_AHEAD_S
        wait, most = CONNECT_AHEAD_RETRY_S
        attempts = 0
        while self.endpoint is not None:
            attempts += 1
            try:
                self.connect_producer(host, int(port), None, time.monotonic() + max(self.pull_timeout_s, 10.0),
                                      back_off=False)
                return
            except (ChannelError, MigrationError, TransferFailed, ValueError, OSError) as e:
                if attempts == 1:
                    logger.info("vllm-ext connector: producer %s not ready yet (%s); trying again", address, e)
                if time.monotonic() + wait > give_up:
                    logger.warning("vllm-ext connector: connecting ahead to %s failed %d times in %g s (a pull "
                                   "dials it anew): %s", address, attempts, CONNECT_AHEAD_S, e)
                    return
            time.sleep(wait)
            wait = min(2 * wait, most)
