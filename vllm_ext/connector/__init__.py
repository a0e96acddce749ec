"""vLLM KV connector for prefill/decode disaggregation over vllm-ext (the only package of
vllm-ext that imports vllm, and only when used).

    --kv-transfer-config '{"kv_connector": "VllmExtConnector", "kv_role": "kv_producer"}'

works once vllm-ext is installed (the `vllm.general_plugins` entry point runs `register`), and
so does `"kv_connector_module_path": "vllm_ext.connector.connector"`. See docs/connector.md.
"""

from .compat import release as _release

SUPPORTED = ((0, 26), (0, 34))  # vLLM releases, inclusive (what differs between them: compat.py)
CONNECTOR_NAME = "VllmExtConnector"


def check_vllm_version(version=None) -> None:
    """RuntimeError naming the release and the supported range unless vLLM's is supported."""
    if version is None:
        import vllm

        version = vllm.__version__
    release = _release(version)
    low, high = SUPPORTED
    if release is None or not low <= release <= high:
        raise RuntimeError(f"vllm-ext's VllmExtConnector supports vLLM {low[0]}.{low[1]} to {high[0]}.{high[1]}; "
                           f"this is vLLM {version}")


def declare_environment() -> None:
    """vLLM warns of every VLLM_* variable it does not know ("Unknown vLLM environment variable
    detected"), which reads as if vllm-ext's own (VLLM_EXT_AUTH_SECRET, ...) were ignored: they
    are declared to it here, before it checks (its plugins load as it parses its arguments)."""
    import functools
    import os

    try:
        from vllm import envs
    except ImportError:
        return
    known = getattr(envs, "environment_variables", None)
    if isinstance(known, dict):
        for name in os.environ:
            if name.startswith("VLLM_EXT_"):
                known.setdefault(name, functools.partial(os.environ.get, name))


def register() -> None:
    """The `vllm.general_plugins` entry point: registers VllmExtConnector with vLLM's factory
    (idempotent; every vLLM process calls it). Never fails a vLLM that does not use it."""
    import logging

    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    from .detokenize import install

    install()  # a moved request's text goes on where the client's stopped (detokenize.py)
    declare_environment()
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_ext.connector.connector", CONNECTOR_NAME)
    except ValueError:  # registered meanwhile (or by an older copy): fine
        logging.getLogger(__name__).debug("%s already registered", CONNECTOR_NAME)
