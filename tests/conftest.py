"""Hardware markers: `gpu` tests need one CUDA GPU and a CUDA build, `multi_gpu` two GPUs with
peer access. Without them the tests are skipped with the reason; they never pass silently.
Tests live by area (ops/, migration/, e2e/, build/, docs/); their shared code in helpers/,
imported as `tests.helpers.<module>`."""

import pytest
import torch


def _gpu_state():
    try:
        from vllm_ext import _lib

        built = _lib.built_with_cuda()
    except ImportError as e:  # the library itself is missing: that is a failure, not a skip
        raise pytest.UsageError(f"vllm_ext is not built: {e}") from e
    if not built:
        return 0, "vllm-ext was built without CUDA (VLLM_EXT_TARGET_DEVICE=cpu)"
    if not torch.cuda.is_available():
        return 0, f"no CUDA GPU visible to torch {torch.__version__}"
    return torch.cuda.device_count(), None


def pytest_collection_modifyitems(config, items):
    count, reason = _gpu_state()
    for item in items:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=reason or f"needs 2 GPUs, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason=reason))
