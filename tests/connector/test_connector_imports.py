"""Layering: vllm_ext, vllm_ext.migration and the proxy never import vllm (runs without vllm)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["vllm_ext", "vllm_ext.migration", "vllm_ext.connector",
                                    "vllm_ext.lease.kv_params", "vllm_ext.lease.channel", "vllm_ext.proxy"])
def test_module_does_not_import_vllm(module):
    if module == "vllm_ext.proxy":
        pytest.importorskip("aiohttp", reason="the proxy needs aiohttp (a vLLM dependency)")
    code = f"import sys, {module}; assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm.' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
