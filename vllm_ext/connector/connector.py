"""VllmExtConnector: vLLM's KV connector v1 over vllm-ext's MigrationEndpoint, for
prefill/decode disaggregation (the NIXL-style pull; see docs/connector.md).

A thin facade: the SCHEDULER instance delegates to a SchedulerHalf, the WORKER instance to a
WorkerHalf; each half gets values, not this object. Configuration
(`--kv-transfer-config '{"kv_connector": "VllmExtConnector", "kv_role": ..., "kv_connector_extra_config": {...}}'`;
every key is checked at start-up by settings.ConnectorSettings, which refuses unknown ones):

    backend          migration backend: "ipc", "nccl", "gloo" (default: ipc on GPU, gloo on CPU)
    backend_options  dict of that backend's options
    endpoint_host    address the MigrationEndpoint binds (default 127.0.0.1)
    lease_host       address the producer's lease channel binds and advertises (default 127.0.0.1)
    lease_port       its port (default 0: any free port)
    lease_s          how long a producer holds a finished request's blocks (default 30)
    max_leased_fraction  the share of a producer's cache that P/D leases may hold together (default
                     0.5): past it the oldest untaken leases end early, and a prefill that still
                     does not fit is answered without a lease (its decode side computes the prompt)
    pull_timeout_s   deadline of one pull on the consumer (default 10)
    connect_to       ["host:port", ...] producers' lease channels to connect to at start-up
    allowed_producers  ["host:port", ...] the only lease channels a consumer dials (default: connect_to)
    verify_kv        a producer digests the blocks it leases, a consumer checks its pulls against
                     them (a mismatch pulls once more, then fails the receive) (default true)
    load_whole_blocks  load only whole blocks before the last token, compute the rest (< 1 block)
                     here (default: on CPU, where vLLM 0.32's AMX attention fails a first step that
                     starts inside a block)
    load             "auto", "sync" or "async": when a consumer loads a P/D request's KV (inside
                     the step that schedules it, or while later steps run; scheduler/consumer.py)
    sync_load_timeout_s  deadline of a load inside a step (default 2 s on GPU, pull_timeout_s on CPU)

The deployment secret (VLLM_EXT_AUTH_SECRET or VLLM_EXT_AUTH_SECRET_FILE) must be set on every
instance. Failed receives follow vLLM's `kv_load_failure_policy` ("fail" or "recompute"): only
"recompute" never loses a request (a consumer with vLLM's default, "fail", warns at start-up).
"""

import logging
from typing import TYPE_CHECKING, Any, Optional, Tuple

from . import check_vllm_version, compat

check_vllm_version()  # before importing what another release may lack: one clear message

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402

from ..migration import auth  # noqa: E402
from . import groups as kv_groups  # noqa: E402
from .metadata import VllmExtMetadata, VllmExtWorkerMetadata  # noqa: E402
from .settings import ConnectorSettings  # noqa: E402
from .stats import VllmExtPromMetrics, VllmExtStats  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # releases before hit sources
    CacheHitSource = None

_HAS_TRANSFER_RESULTS = hasattr(KVConnectorBase_V1, "get_transfer_results")

try:  # a connector that says it moves each KV cache group keeps vLLM's hybrid KV cache manager on
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    _HMA = (SupportsHMA,)
except ImportError:  # releases without it: one group, always
    _HMA = ()


def deployment_secret() -> bytes:
    """The deployment's shared secret (VLLM_EXT_AUTH_SECRET, or the file VLLM_EXT_AUTH_SECRET_FILE
    names; read as the migration endpoints read it). The connector refuses to start without one:
    leases must not be readable by anyone who can reach the port."""
    secret = auth.deployment_secret()
    if secret is None:
        raise RuntimeError(f"VllmExtConnector needs the deployment secret on every instance: set {auth.ENV_SECRET} "
                           f"or {auth.ENV_SECRET_FILE}")
    return secret


def _log_under_vllm() -> None:
    """In a vLLM process, the warnings of vllm-ext's own layers (the transport, the lease
    channel: loggers under "vllm_ext") print through vLLM's handlers, as the connector's do."""
    ours, theirs = logging.getLogger("vllm_ext"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.propagate = False


def max_leased_blocks(settings, vllm_config, kv_cache_config) -> Optional[int]:
    """max_leased_fraction of the cache's blocks (None when the engine did not say how many).
    `settings`: the ConnectorSettings, or a kv_connector_extra_config to parse."""
    if not isinstance(settings, ConnectorSettings):
        settings = ConnectorSettings.parse(settings)
    num_blocks = getattr(kv_cache_config, "num_blocks", None) or vllm_config.cache_config.num_gpu_blocks
    if not num_blocks:
        logger.warning("VllmExtConnector: the KV cache's size is unknown here: P/D leases are not bounded "
                       "(kv_connector_extra_config.max_leased_fraction is not applied)")
        return None
    return max(1, int(settings.max_leased_fraction * num_blocks))


def warn_if_requests_can_be_lost(config) -> None:
    """A consumer whose failed loads fail their requests (vLLM's default policy) loses a request
    whenever a producer is slow, busy, restarted or bounded; the connector cannot tell vLLM's
    default from a chosen "fail", so it says so once."""
    if config.is_kv_consumer and getattr(config, "kv_load_failure_policy", "fail") == "fail":
        logger.warning('VllmExtConnector: kv_load_failure_policy is "fail" (vLLM\'s default): a request whose KV '
                       "cannot be loaded (a busy or restarted producer, a lease expired or ended to make room) ends "
                       'with an error. Set "kv_load_failure_policy": "recompute" in --kv-transfer-config so that '
                       "such a request is computed here instead and never lost.")


class VllmExtConnector(KVConnectorBase_V1, *_HMA):
    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        # every key checked here, in both roles (vLLM builds the worker's before its compile warm-up)
        settings = ConnectorSettings.parse(config.kv_connector_extra_config,
                                           device_type=vllm_config.device_config.device_type)
        tp_rank, tp_size = _tensor_parallel(vllm_config.parallel_config, role)
        groups = kv_groups.of_config(kv_cache_config, vllm_config.cache_config.block_size)
        secret = deployment_secret()
        _log_under_vllm()
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerHalf

            policy = getattr(config, "kv_load_failure_policy", "fail")
            warn_if_requests_can_be_lost(config)
            self._scheduler = SchedulerHalf(
                is_producer=config.is_kv_producer, is_consumer=config.is_kv_consumer,
                block_size=vllm_config.cache_config.block_size, lease_s=settings.lease_s,
                lease_host=settings.lease_host, lease_port=settings.lease_port,
                secret=secret, failure_policy=policy,
                whole_blocks=load_whole_blocks(settings, config.kv_connector_extra_config,
                                               uses_mla(vllm_config) or groups.windowed),
                wait_for_grant=VllmExtWorkerMetadata is not None,
                async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
                max_tokens_limits=max_tokens_limits(vllm_config.model_config),
                max_leased_blocks=max_leased_blocks(settings, vllm_config, kv_cache_config)
                if config.is_kv_producer else None, load=settings.load, groups=groups)
        else:
            from .worker import WorkerHalf

            if config.is_kv_consumer and not settings.allowed_producers:
                logger.warning("VllmExtConnector: no producer is allowed (kv_connector_extra_config.connect_to and "
                               "allowed_producers are empty): every remote KV is computed here instead")
            self._worker = WorkerHalf(
                is_producer=config.is_kv_producer, is_consumer=config.is_kv_consumer,
                backend=settings.backend, endpoint_host=settings.endpoint_host,
                endpoint_options=dict(settings.backend_options), secret=secret,
                pull_timeout_s=settings.pull_timeout_s,
                static_fields={**_static_fields(vllm_config), **groups.fingerprint_fields()},
                connect_to=list(settings.connect_to), allowed_producers=list(settings.allowed_producers),
                verify_kv=settings.verify_kv, tp_rank=tp_rank, tp_size=tp_size,
                sync_load_timeout_s=settings.sync_load_timeout_s, mla=uses_mla(vllm_config))

    # ==== worker side =====================================================================
    def register_kv_caches(self, kv_caches):
        from .sampling import find

        self._worker.seeded = find(self._vllm_config)  # from the model runner on the call stack
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None

    def get_transfer_results(self, finished_req_ids):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving, failed = self._worker.take_results(self._meta())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids):
        sending, recving, _ = self._worker.take_results(self._meta())
        return sending or None, recving or None

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def get_block_ids_with_load_errors(self):
        blocks, sync = self._worker.take_failed_blocks()
        # 0.32+ learns of failed asynchronous loads from failed_recving; a failed sync load is
        # only ever invalid blocks
        return sync if _HAS_TRANSFER_RESULTS else blocks

    def get_kv_connector_stats(self):
        half = self._worker if self._worker is not None else self._scheduler
        return half.get_stats()

    def shutdown(self):
        for half in (self._worker, self._scheduler):
            if half is not None:
                half.shutdown()

    def _meta(self) -> Optional[VllmExtMetadata]:
        return self._connector_metadata if isinstance(self._connector_metadata, VllmExtMetadata) else None

    # ==== scheduler side ==================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, kv_groups.interleave(blocks.get_block_ids()),
                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):  # SupportsHMA: one table per group
        # through request_finished, with the tables interleaved (groups.py): what vLLM calls on a
        # connector without SupportsHMA, which a subclass may extend
        return self.request_finished(request, kv_groups.interleave(block_ids))

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata):
        self._scheduler.set_handshake(metadata)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_frees() if self._scheduler is not None else False

    def may_load_async(self, request) -> bool:  # vLLM 0.34+
        return self._scheduler.may_load_async(request.kv_transfer_params)

    # ==== class methods (also called in the API server) ====================================
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):  # vLLM 0.34+
        return compat.kv_cache_access(kv_transfer_config)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return VllmExtStats(data=data) if data is not None else VllmExtStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return VllmExtPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tensor_parallel(parallel, role) -> Tuple[int, int]:
    """(this worker's TP rank, the TP size); the scheduler's rank is 0. Every TP rank's worker
    moves its own shard of the KV heads; pipeline and context parallelism split the cache in
    ways the connector does not move, and are refused."""
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        value = getattr(parallel, name, 1)
        if value != 1:
            raise ValueError(f"VllmExtConnector: {name} {value}: only 1 is supported (tensor parallelism is: every "
                             "TP rank moves its own shard; run data-parallel ranks as independent instances)")
    size = parallel.tensor_parallel_size
    if role == KVConnectorRole.SCHEDULER or size == 1:
        return 0, size
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


def uses_mla(vllm_config) -> bool:
    """Whether the model's attention is MLA (one latent KV per token, replicated on every TP
    rank), as vLLM's model config says on every supported release (NixlConnector asks the same)."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def load_whole_blocks(settings, extra_config, every_token: bool) -> bool:
    """Whether a consumer loads only whole blocks (kv_connector_extra_config.load_whole_blocks).
    Its CPU default exists for vLLM 0.32's AMX attention of dense models. `every_token`: loads
    stop only before the last token unless the setting is given, for
    - an MLA model: vLLM 0.32's CPU MLA prefill over loaded context (which a server with prefix
      caching and chunked prefill off runs for nothing else) gave other tokens than a single
      instance from the first one on, where a decode over the loaded KV gave its first tokens;
    - a sliding window under the hybrid KV cache manager (groups.py): the producer keeps the
      window of the prompt's last token, and a load that stopped blocks earlier would need blocks
      before it (the load fails, and D computes the prompt)."""
    if every_token and "load_whole_blocks" not in (extra_config or {}):
        return False
    return settings.load_whole_blocks


def max_tokens_limits(model) -> Tuple[int, int]:
    """(default, cap) of the output limit vLLM's OpenAI server applies (0: none), as its serving
    classes derive them: the default limits a request that sets none (the generation config's
    max_new_tokens, overrides included), the cap every request (with generation_config "auto" or
    "vllm", --override-generation-config's max_new_tokens; with a folder, its default). The
    router carries them across a move (a resumed leg always sets its limit)."""
    try:
        default = model.get_diff_sampling_param().get("max_tokens")
        if model.generation_config not in ("auto", "vllm"):
            cap = default
        else:
            cap = (getattr(model, "override_generation_config", None) or {}).get("max_new_tokens")
    except Exception as e:  # noqa: BLE001 - an unreadable generation config: the router keeps the request's own limit
        logger.warning("VllmExtConnector: the generation config's output limits are unknown (%s: %s)",
                       type(e).__name__, e)
        return 0, 0
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0  # type: ignore[return-value]
                 for v in (default, cap))


def _static_fields(vllm_config) -> dict:
    """What the fingerprint takes from vLLM's config: the release, the attention backend, the
    resolved layout and the model's KV geometry (MLA or KV heads)."""
    import vllm

    backends = set()
    try:
        try:
            from vllm.model_executor.layers.attention.attention import Attention
        except ImportError:  # releases that keep it in vllm.attention.layer
            from vllm.attention.layer import Attention

        try:
            from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        except ImportError:  # releases that keep MLA elsewhere (the tensors still decide)
            MLAAttention = Attention
        for layer in vllm_config.compilation_config.static_forward_context.values():
            if isinstance(layer, (Attention, MLAAttention)):
                backends.add(layer.get_attn_backend().get_name())
    except Exception:  # noqa: BLE001 - older releases keep the layer elsewhere; the tensors still decide
        pass
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    mla = uses_mla(vllm_config)
    return {
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
        "attn_backend": sorted(backends),
        "kv_cache_layout": getattr(cache, "kv_cache_layout", None),
        "cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "mla": mla,
        "num_kv_heads": 1 if mla else model.get_total_num_kv_heads(),  # MLA: one latent, on every rank
        "head_size": model.get_head_size(),
    }
