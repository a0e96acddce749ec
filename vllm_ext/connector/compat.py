"""What differs between the vLLM releases the connector supports (0.26 to 0.34), in one place.

Each function answers one question the same way on every supported release; the rest of the
connector asks here instead of testing vLLM's version or attributes itself. Imports vLLM only
inside the functions that need it (this package must import without vLLM).

What 0.34 changed for a KV connector, against 0.33 (read in both wheels):
- the extensible KV cache (device virtual memory, on by default on CUDA) asks each connector
  how its workers reach the cache (`KVConnectorBase_V1.kv_cache_access`): legacy CUDA IPC,
  which the `ipc` backend uses, cannot export driver-mapped memory (`kv_cache_access`);
- `--max-num-inflight-kv-loads` queues requests that may load asynchronously apart, by
  `KVConnectorBase_V1.may_load_async` (`may_load_async`);
- model runner V1 is gone, and with it `VllmConfig.use_v2_model_runner`
  (`uses_v2_model_runner`);
- a request resumed after a preemption comes again in `scheduled_new_reqs`, with its whole
  block table; `CachedRequestData.resumed_req_ids` is gone (`resumed_req_ids`);
- `Request.prompt_token_ids` is a `TokenBuffer`, an int32 array whose slices are lists (what
  the connector does with token ids works on both: no shim).
"""

from typing import Any, Mapping, Optional, Set, Tuple

# Migration backends whose workers reach the cache through legacy CUDA IPC handles
# (cudaIpcGetMemHandle); None: the default, ipc on a GPU.
LEGACY_IPC_BACKENDS = (None, "ipc")


def release(version: Optional[str] = None) -> Optional[Tuple[int, int]]:
    """(major, minor) of a vLLM version string (default: the installed vLLM's), or None."""
    if version is None:
        import vllm

        version = vllm.__version__
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def kv_cache_access(kv_transfer_config):
    """vLLM 0.34+: how this connector's workers reach the device KV cache, as vLLM's
    `KVCacheAccess` flags. The `ipc` backend (the default on a GPU) maps the whole cache in the
    peer through legacy CUDA IPC, which vLLM's extensible KV cache cannot serve: LEGACY_IPC
    makes vLLM allocate the cache as before (and refuse --enable-extensible-kv-cache by name).
    nccl, gloo and rayrpc copy in this process: IN_PROCESS."""
    from vllm.config.kv_transfer import KVCacheAccess

    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    if extra.get("backend") in LEGACY_IPC_BACKENDS:
        return KVCacheAccess.LEGACY_IPC
    return KVCacheAccess.IN_PROCESS


def may_load_async(kv_transfer_params: Any, consumer=None) -> bool:
    """vLLM 0.34+: whether a request may load its KV asynchronously (vLLM then queues it
    apart under --max-num-inflight-kv-loads). `consumer`: the instance's Consumer, whose rule
    (`kv_connector_extra_config.load`, the producer's backend, `sync_load`) says which loads run
    inside the step that schedules them, like a local prefix hit, and must not hold other
    requests' asynchronous loads back; None (a producer alone): it loads nothing."""
    if consumer is None or not isinstance(kv_transfer_params, Mapping):
        return False
    return consumer.may_load_async(kv_transfer_params)


def uses_v2_model_runner(vllm_config) -> bool:
    """Whether the engine runs model runner V2 (0.34+: the only one; before, the config says)."""
    flag = getattr(vllm_config, "use_v2_model_runner", None)
    if flag is None:
        return (release() or (0, 0)) >= (0, 34)  # an unparsable version is refused before this
    return bool(flag)


def resumed_req_ids(cached_reqs) -> Set[str]:
    """The requests of `scheduled_cached_reqs` resumed after a preemption, whose new block ids
    replace their table instead of extending it (0.34+: none, they come as new requests)."""
    if cached_reqs is None:
        return set()
    resumed = getattr(cached_reqs, "resumed_req_ids", None)
    if resumed is not None:
        return set(resumed)
    flags = getattr(cached_reqs, "resumed_from_preemption", None) or []  # releases with a flag per request
    return {req_id for req_id, flag in zip(cached_reqs.req_ids, flags) if flag}
