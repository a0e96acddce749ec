"""Backends by name. A backend's module is imported only when that backend is asked for, so
importing vllm_ext.migration never imports ray or loads NCCL."""

import importlib
from typing import Dict, Tuple, Type

from .base import MigrationBackend

# name -> (module, class)
_BACKENDS: Dict[str, Tuple[str, str]] = {
    "ipc": ("vllm_ext.migration.ipc", "IpcBackend"),
    "nccl": ("vllm_ext.migration.nccl", "NcclBackend"),
    "gloo": ("vllm_ext.migration.gloo", "GlooBackend"),
    "rayrpc": ("vllm_ext.migration.rayrpc", "RayRpcBackend"),
}

BACKEND_NAMES = tuple(_BACKENDS)


def get_backend_class(name: str) -> Type[MigrationBackend]:
    """The class of backend `name`; ValueError for an unknown name."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; known: {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


def available_backends() -> Dict[str, str]:
    """name -> "" when usable in this process, else why not (imports each backend module)."""
    result = {}
    for name in _BACKENDS:
        try:
            ok, why = get_backend_class(name).is_available()
        except ImportError as e:
            ok, why = False, f"import failed: {e}"
        result[name] = "" if ok else why
    return result
