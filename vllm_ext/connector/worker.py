"""The worker half of VllmExtConnector (one per worker process).

It wraps vLLM's KV cache views as one vllm_ext KVCache (layout `blocks`, or `mla` for an MLA
model's latent cache; no copy), serves it
through a MigrationEndpoint, and, on a consumer, hands each RecvJob to its Receiver
(receiver.py: the pull pipeline).

On a producer (gloo, nccl: serve="granted") the endpoint serves only the blocks of live leases:
granted when the worker learns of a lease (the step after it was made; reported back to the
scheduler, whose lease channel hands the lease out only then), revoked when the lease ended
(released after the consumer's pull, or expired: an acquire holds a lease past the pull's
deadline). ipc maps the whole cache: its authenticated peers are trusted with all of it.

Under tensor parallelism there is one WorkerHalf per TP rank, each with its own shard of the
cache (its KV heads) and its own endpoint; every rank gets the same metadata each step. A
consumer's rank r pulls from the producer's rank r at equal TP sizes, and gathers its heads
from the producer ranks that hold them at unequal ones (receiver.py); an MLA model's latent is
whole on every rank (replicated, no heads to split), so at unequal sizes a rank pulls it from one
producer rank (kv_params.source_ranks' first). vLLM counts a receive
done once every rank reported it, failed if any rank failed it.

Who calls what (vLLM, on the worker's thread): register_kv_caches once; per step
start_load_kv (with the step's metadata), get_transfer_results, get_stats.
"""

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .. import KVCache, ops
from ..lease.kv_params import PROTOCOL, instance_fingerprint
from ..migration import MigrationEndpoint, PeerDescriptor
from .metadata import VllmExtHandshake, VllmExtMetadata, VllmExtWorkerMetadata
from .receiver import Receiver, descriptor_from_fields  # noqa: F401 - the latter is part of this module's API
from .sampling import SeededStreams
from .stats import VllmExtStats

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

# Backends whose peers can be held to the granted blocks (ipc maps the whole cache).
GRANTED_BACKENDS = ("gloo", "nccl", "rayrpc")


def make_endpoint(cache: KVCache, backend: str, host: str, options: Dict[str, Any],
                  secret: bytes, serve: str = "all") -> MigrationEndpoint:
    """The one place the connector builds its MigrationEndpoint: authenticated with the
    deployment secret; `serve="granted"` on a producer of a backend that can check grants."""
    return MigrationEndpoint(cache, backend, host=host, secret=secret, serve=serve, **options)


def physical_order(t: torch.Tensor) -> str:
    """The order of [B, H, N, C] (an MLA cache: [B, N, C]) in memory, outermost first (vLLM's
    layout names without L)."""
    dims = "BHNC" if t.dim() == 4 else "BNC"
    return "".join(name for _, name in sorted(zip(t.stride(), dims), key=lambda x: -x[0]))


def wrap_kv_caches(kv_caches: Dict[str, torch.Tensor], mla: bool = False) -> Tuple[KVCache, List[str]]:
    """One KVCache over vLLM's per-layer views, in the dict's (model) order; layers that share
    a tensor (KV sharing) are moved once. Layout `blocks` ([num_blocks, H, block_size, C]), or,
    for an MLA model (`mla`: vLLM's model_config.use_mla), `mla`: one latent per token and no KV
    heads, from vLLM's [num_blocks, 1, block_size, C] view (0.32+) or its [num_blocks,
    block_size, C] tensor (earlier releases). Every layer must have the first one's shape (the
    layers of several KV cache groups share their tensors, one per layer slot: groups.py)."""
    names, layers, seen = [], [], set()
    want = "[num_blocks, block_size, C] (MLA)" if mla else "[num_blocks, H, block_size, C]"
    for name, t in kv_caches.items():
        if isinstance(t, torch.Tensor) and mla and t.dim() == 4 and t.shape[1] == 1:
            t = t.squeeze(1)  # a view: the latent's one "head"
        if not isinstance(t, torch.Tensor) or t.dim() != (3 if mla else 4):
            raise ValueError(f"kv_caches[{name!r}]: expected a {want} tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)} (Mamba or other state caches are not supported)")
        if layers and t.shape != layers[0].shape:
            raise ValueError(f"kv_caches[{name!r}]: shape {list(t.shape)} differs from kv_caches[{names[0]!r}]'s "
                             f"{list(layers[0].shape)}: layers of different KV geometry (a hybrid model whose layers "
                             "differ in KV heads or head size) are not supported")
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        names.append(name)
        layers.append(t)
    return KVCache.from_layers(layers, layout="mla" if mla else "blocks"), names


def descriptor_fields(desc: PeerDescriptor) -> Dict[str, Any]:
    return dataclasses.asdict(desc)


class WorkerHalf:
    """Args are values: the roles, the migration backend and its options, the host the
    endpoint binds, the deployment secret, pull timeout, and the static facts of the cache
    that go into the fingerprint (attention backend, vLLM's layout name, vLLM release)."""

    def __init__(self, *, is_producer: bool, is_consumer: bool, backend: Optional[str], endpoint_host: str,
                 endpoint_options: Dict[str, Any], secret: bytes, pull_timeout_s: float,
                 static_fields: Dict[str, Any], connect_to: List[str],
                 allowed_producers: Optional[List[str]] = None, verify_kv: bool = True,
                 tp_rank: int = 0, tp_size: int = 1, sync_load_timeout_s: Optional[float] = None,
                 mla: bool = False):
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: expected 0 to {tp_size - 1} (tp_size {tp_size}), got {tp_rank}")
        port = endpoint_options.get("port") or 0
        if tp_size > 1 and port:  # every rank's endpoint (and staging endpoint) would bind it
            raise ValueError(f"kv_connector_extra_config.backend_options.port: a fixed port ({port}) with "
                             f"tensor_parallel_size {tp_size}: each TP rank's endpoint needs a port of its own; "
                             "leave it out (0: any free port)")
        self.is_producer = is_producer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.mla = mla  # the model's attention is MLA: every rank holds the whole latent (layout mla)
        self.is_consumer = is_consumer
        self._backend = backend
        self._endpoint_host = endpoint_host
        self._endpoint_options = endpoint_options
        self._secret = secret
        self._static_fields = static_fields
        # producer: digest leased blocks when serving them; consumer: check pulls against them
        self.verify_kv = verify_kv
        self.cache: Optional[KVCache] = None
        self.endpoint: Optional[MigrationEndpoint] = None
        self.fingerprint_fields: Dict[str, Any] = {}
        self.fingerprint = ""
        # consumer: lease channels ("host:port") it dials, by default the connect_to entries
        self.receiver = Receiver(secret=secret, allowed=set(connect_to if allowed_producers is None
                                                            else allowed_producers),
                                 connect_to=connect_to, pull_timeout_s=pull_timeout_s, verify_kv=verify_kv,
                                 rank=tp_rank, ranks=tp_size, sync_timeout_s=sync_load_timeout_s)
        self.leased_blocks: Dict[str, List[int]] = {}  # producer: lease id -> blocks granted for it
        self._granted_now: List[str] = []  # producer: leases granted since the last worker metadata
        self._digests_now: Dict[str, List[int]] = {}  # producer: their digests (verify_kv)
        self._loaded_now: List[str] = []  # requests whose sync loads ended since the last worker metadata
        self._grants = False  # the endpoint serves only granted blocks
        # seeded requests' random streams (set with the KV caches: connector/sampling.py)
        self.seeded: Optional[SeededStreams] = None

    # ---- start-up ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self.cache, names = wrap_kv_caches(kv_caches, mla=self.mla)
        if self.verify_kv and self.cache.alignment < 4:
            raise ValueError(f"vllm-ext connector: verify_kv digests 32-bit words, and these KV caches are only "
                             f"{self.cache.alignment}-byte aligned ({self.cache.slice_nbytes}-byte blocks per layer); "
                             "set kv_connector_extra_config.verify_kv to false")
        first = self.cache.layers[0]
        backend = self._backend or ("ipc" if first.is_cuda else "gloo")
        self.fingerprint_fields = {
            **self._static_fields, "protocol": PROTOCOL, "migration_backend": backend,
            "dtype": str(first.dtype).replace("torch.", ""), "layer_shape": list(first.shape[1:]),
            "physical_order": physical_order(first), "kv_layout": self.cache.layout,
            "num_layers": len(names), "layer_names": names,
            "device_type": first.device.type, "tp_size": self.tp_size,
        }
        self.fingerprint = instance_fingerprint(self.fingerprint_fields)
        self._grants = self.is_producer and backend in GRANTED_BACKENDS
        self.endpoint = make_endpoint(self.cache, backend, self._endpoint_host, self._endpoint_options, self._secret,
                                      serve="granted" if self._grants else "all")
        stream = torch.cuda.Stream(device=first.device) if first.is_cuda else None
        groups = self.fingerprint_fields.get("kv_cache_groups")
        logger.info("vllm-ext connector: %r serving %d layers [%s] over %s, fingerprint %s (TP rank %d of %d)%s",
                    self.cache, len(names), self.fingerprint_fields["physical_order"], backend, self.fingerprint,
                    self.tp_rank, self.tp_size, f"; KV cache groups {groups}" if groups else "")
        serve = "granted" if backend in GRANTED_BACKENDS else "all"  # a staging cache serves nothing it can refuse
        self.receiver.start(self.cache, self.endpoint, self.fingerprint_fields, stream,
                            make_endpoint=lambda cache: make_endpoint(cache, backend, self._endpoint_host,
                                                                      {**self._endpoint_options, "port": 0},
                                                                      self._secret, serve))

    def handshake(self) -> VllmExtHandshake:
        assert self.endpoint is not None
        return VllmExtHandshake(descriptor=descriptor_fields(self.endpoint.descriptor()),
                                fingerprint=self.fingerprint, fingerprint_fields=self.fingerprint_fields,
                                sampler=self.seeded.kind if self.seeded is not None else "")

    # ---- per step ------------------------------------------------------------------------
    def start_load_kv(self, meta: Optional[VllmExtMetadata]) -> None:
        if meta is None:
            return
        for lease_id, blocks in meta.new_leases.items():
            if self._grants:
                self.endpoint.grant(blocks)
            self.leased_blocks[lease_id] = list(blocks)
            self._granted_now.append(lease_id)
            if self.verify_kv and VllmExtWorkerMetadata is not None:
                skip = meta.digest_from.get(lease_id, 0)
                self._digests_now[lease_id] = ops.block_digests(self.cache, list(blocks[skip:]))
        for lease_id in meta.ended_leases:  # released or expired (its blocks may go back to vLLM this step)
            blocks = self.leased_blocks.pop(lease_id, None)
            if blocks is not None and self._grants:
                self.endpoint.revoke(blocks)
        self._loaded_now.extend(job.req_id for job in meta.recvs if job.sync)  # ended by the forward
        self.receiver.submit(meta.recvs, meta.releases)
        for req_id, n in meta.skip_draws.items():  # before this step samples
            if self.seeded is None or not self.seeded.skip(req_id, n):
                logger.warning("request %s: its seeded random stream cannot skip the %d draws made before it moved "
                               "here: it restarts", req_id, n)

    def build_worker_meta(self):
        """The leases granted and the sync loads ended since the last call (None when none, or on
        releases without worker metadata)."""
        granted, digests, loaded = self._granted_now, self._digests_now, self._loaded_now
        self._granted_now, self._digests_now, self._loaded_now = [], {}, []
        if not (granted or loaded) or VllmExtWorkerMetadata is None:
            return None
        return VllmExtWorkerMetadata(granted={self.tp_rank: granted} if granted else {},
                                     digests={self.tp_rank: digests} if digests else {}, loaded=loaded)

    def take_results(self, meta: Optional[VllmExtMetadata]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call; failed
        receives are in finished_recving too."""
        sending = set(meta.finished_sending) if meta is not None else set()
        done, failed = self.receiver.take_finished()
        return sending, done, failed

    def take_failed_blocks(self) -> Tuple[Set[int], Set[int]]:
        """(blocks of every failed load, blocks of failed sync loads) since the last call."""
        return self.receiver.take_failed_blocks()

    def get_stats(self) -> Optional[VllmExtStats]:
        return self.receiver.take_stats()

    # ---- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.receiver.shutdown()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
