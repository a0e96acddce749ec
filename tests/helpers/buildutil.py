"""Builds a variant of libvllm_ext (CPU-only, or other archs) straight from csrc/ with CMake,
and runs Python snippets against it in a subprocess (VLLM_EXT_LIBRARY picks the library)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the repository


def _tool(name):
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def build_variant(out_dir: Path, target: str, gencode: str = "", archs: str = "") -> Path:
    """-> path of the built libvllm_ext.so; skips when the source or the tools are absent."""
    if not (ROOT / "csrc" / "vllm_ext.h").exists():
        pytest.skip("the source tree (csrc/) is not here: testing an installed wheel")
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if not cmake or not ninja:
        pytest.skip("cmake and ninja are needed to build a library variant")
    args = [cmake, f"-S{ROOT}", f"-B{out_dir / 'build'}", "-GNinja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DVLLM_EXT_TARGET_DEVICE={target}", f"-DVLLM_EXT_OUTPUT_DIR={out_dir}"]
    if target == "cuda":
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        if not os.path.exists(nvcc):
            pytest.skip("nvcc is needed to build a CUDA library variant")
        args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DVLLM_EXT_CUDA_GENCODE={gencode}",
                 f"-DVLLM_EXT_CUDA_ARCHS={archs}"]
    subprocess.run(args, check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(out_dir / "build")], check=True, capture_output=True)
    lib = out_dir / "libvllm_ext.so"
    assert lib.exists()
    return lib


def run_python(code: str, env_extra: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
