"""Builds vllm-ext: CMake + Ninja compile csrc/ into vllm_ext/libvllm_ext.so (C ABI, no torch).

Knobs (environment variables), each printed with the value chosen:
  VLLM_EXT_TARGET_DEVICE  cuda | cpu (default: cuda when nvcc is found, else cpu)
  TORCH_CUDA_ARCH_LIST    e.g. "8.0 9.0a 12.0+PTX" (default below)
  MAX_JOBS                parallel compile jobs (default: from cores and available memory)
  NVCC_THREADS            archs one nvcc compiles in parallel (default: from the same budget)
  CMAKE_BUILD_TYPE        Release (default) | Debug | RelWithDebInfo
  VERBOSE=1               show every compiler command
  VLLM_EXT_GIT_REVISION   recorded revision when there is no .git (Docker builds)
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "8.0 8.6 8.9 9.0 10.0 12.0+PTX"
GIB = 1 << 30
NVCC_GIB_PER_JOB = 5  # peak memory of one nvcc process, with margin (flash-attn, sgl-kernel)


_KNOB_LINES = []


def say(msg):
    """Records a knob's chosen value; the build prints them all when it starts compiling."""
    _KNOB_LINES.append(f"vllm-ext build: {msg}")


def tool(name):
    """A build tool from this Python's environment first (pip's cmake/ninja), else PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def base_version():
    text = (ROOT / "vllm_ext" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def find_nvcc():
    for candidate in (
        os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return f"{match.group(1)}.{match.group(2)}"


def target_device(nvcc):
    value = os.environ.get("VLLM_EXT_TARGET_DEVICE", "").strip().lower()
    if value:
        if value not in ("cuda", "cpu"):
            raise SystemExit(f"VLLM_EXT_TARGET_DEVICE must be 'cuda' or 'cpu', not {value!r}")
        if value == "cuda" and nvcc is None:
            raise SystemExit("VLLM_EXT_TARGET_DEVICE=cuda but nvcc was not found "
                             "(set CUDA_HOME or put nvcc on PATH)")
        say(f"VLLM_EXT_TARGET_DEVICE={value}")
        return value
    if nvcc:
        say(f"VLLM_EXT_TARGET_DEVICE=cuda (default: nvcc found at {nvcc})")
        return "cuda"
    say("VLLM_EXT_TARGET_DEVICE=cpu (default: nvcc not found, building the CPU library only)")
    return "cpu"


def parse_arch_list(text):
    """'8.0 9.0a 12.0+PTX' -> (['8.0', '9.0a', '12.0+PTX'], gencode flags, 'sm_80 ...')."""
    entries = [e for e in re.split(r"[\s;,]+", text.strip()) if e]
    if not entries:
        raise SystemExit("TORCH_CUDA_ARCH_LIST is empty")
    gencode, names = [], []
    for entry in entries:
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", entry)
        if not match:
            raise SystemExit(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r} "
                             "(expected entries like 8.0, 9.0a, 12.0+PTX)")
        num = f"{match.group(1)}{match.group(2)}{match.group(3)}"
        codes = [f"sm_{num}"]
        names.append(f"sm_{num}")
        if match.group(4):
            codes.append(f"compute_{num}")
            names.append(f"compute_{num}")
        gencode.append(f"-gencode=arch=compute_{num},code=[{','.join(codes)}]")
    return entries, " ".join(gencode), " ".join(names)


def check_archs_supported(nvcc, names):
    out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)
    if out.returncode != 0:
        return
    known = set(out.stdout.split())
    # --list-gpu-code names the base archs only: sm_90 stands for sm_90a and sm_90f too.
    missing = [n for n in names.split() if n.startswith("sm_") and n.rstrip("af") not in known]
    if missing:
        raise SystemExit(f"TORCH_CUDA_ARCH_LIST: {nvcc} cannot build {', '.join(missing)}; "
                         f"it supports {' '.join(sorted(known))}")


def available_memory_bytes():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def parallelism(num_archs):
    cores = os.cpu_count() or 1
    budget = max(1, min(cores, available_memory_bytes() // (NVCC_GIB_PER_JOB * GIB)))
    why = f"{cores} cores, {available_memory_bytes() / GIB:.0f} GiB available, "
    why += f"{NVCC_GIB_PER_JOB} GiB per nvcc"
    if os.environ.get("MAX_JOBS"):
        max_jobs = int(os.environ["MAX_JOBS"])
        say(f"MAX_JOBS={max_jobs} (from the environment)")
    else:
        max_jobs = budget
        say(f"MAX_JOBS={max_jobs} (default: {why})")
    if os.environ.get("NVCC_THREADS"):
        nvcc_threads = int(os.environ["NVCC_THREADS"])
        say(f"NVCC_THREADS={nvcc_threads} (from the environment)")
    else:
        # One .cu file: its nvcc may use the whole budget, one thread per arch at most.
        nvcc_threads = max(1, min(num_archs, budget))
        say(f"NVCC_THREADS={nvcc_threads} (default: {why}, {num_archs} archs)")
    return max_jobs, nvcc_threads


def git_revision():
    if os.environ.get("VLLM_EXT_GIT_REVISION"):
        return os.environ["VLLM_EXT_GIT_REVISION"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class BuildConfig:
    """Every knob, resolved once: both the version string and the build need it."""

    def __init__(self):
        self.nvcc = find_nvcc()
        self.device = target_device(self.nvcc)
        self.cuda_version = nvcc_version(self.nvcc) if self.device == "cuda" else None
        if self.device == "cuda":
            arch_text = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
            source = "from the environment" if os.environ.get("TORCH_CUDA_ARCH_LIST") else "default"
            self.arch_list, self.gencode, self.arch_names = parse_arch_list(arch_text)
            check_archs_supported(self.nvcc, self.arch_names)
            say(f"TORCH_CUDA_ARCH_LIST={' '.join(self.arch_list)} ({source}) -> {self.arch_names}")
        else:
            self.arch_list, self.gencode, self.arch_names = [], "", ""
        self.max_jobs, self.nvcc_threads = parallelism(max(1, len(self.arch_list)))
        self.build_type = os.environ.get("CMAKE_BUILD_TYPE") or "Release"
        say(f"CMAKE_BUILD_TYPE={self.build_type}")
        self.verbose = os.environ.get("VERBOSE", "") not in ("", "0")
        say(f"VERBOSE={int(self.verbose)}")
        local = "cu" + self.cuda_version.replace(".", "") if self.cuda_version else "cpu"
        self.version = f"{base_version()}+{local}"

    def build_info(self):
        return {
            "version": self.version,
            "git_revision": git_revision(),
            "cuda_version": self.cuda_version,
            "arch_list": self.arch_list,
            "cuda_archs": self.arch_names.split(),
            "target_device": self.device,
            "build_type": self.build_type,
        }


CONFIG = BuildConfig()


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname):
        # A plain shared library loaded by ctypes, not a Python extension module.
        return os.path.join(*fullname.split(".")[:-1], "libvllm_ext.so")

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / f"cmake-{CONFIG.device}"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-S{ROOT}", f"-B{build_dir}", "-GNinja",
            f"-DCMAKE_BUILD_TYPE={CONFIG.build_type}",
            f"-DVLLM_EXT_TARGET_DEVICE={CONFIG.device}",
            f"-DVLLM_EXT_OUTPUT_DIR={out_dir}",
            f"-DNVCC_THREADS={CONFIG.nvcc_threads}",
        ]
        if CONFIG.device == "cuda":
            args += [f"-DCMAKE_CUDA_COMPILER={CONFIG.nvcc}",
                     f"-DVLLM_EXT_CUDA_GENCODE={CONFIG.gencode}",
                     f"-DVLLM_EXT_CUDA_ARCHS={CONFIG.arch_names}"]
        if shutil.which("ccache"):
            args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache",
                     "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        for line in _KNOB_LINES:
            print(line, file=sys.stderr, flush=True)
        cmake = tool("cmake") or "cmake"
        if tool("ninja"):
            args.append(f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}")
        subprocess.run([cmake, *args], check=True)
        build = [cmake, "--build", str(build_dir), "-j", str(CONFIG.max_jobs)]
        if CONFIG.verbose:
            build.append("--verbose")
        subprocess.run(build, check=True)
        info = json.dumps(CONFIG.build_info(), indent=2) + "\n"
        (out_dir / "_build_info.json").write_text(info)
        if getattr(self, "editable_mode", False) or self.inplace:
            # Editable installs copy only the library into the source tree; the record too.
            (ROOT / "vllm_ext" / "_build_info.json").write_text(info)
        print(f"vllm-ext build: built {out_dir / 'libvllm_ext.so'}", file=sys.stderr, flush=True)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the library has no Python ABI, so one wheel serves CPython 3.9+."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    name="vllm-ext",
    version=CONFIG.version,
    description="Fast, safe movement of paged KV-cache blocks for vLLM-style serving",
    packages=find_packages(include=["vllm_ext", "vllm_ext.*"]),
    package_data={"vllm_ext": ["py.typed"]},
    ext_modules=[Extension("vllm_ext.libvllm_ext", sources=[])],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": PlatformWheel},
    python_requires=">=3.9",
    install_requires=["torch>=2.1"],
    extras_require={"ray": ["ray>=2.9", "numpy"], "bench": ["matplotlib"]},
    # vLLM runs these in every process: registers VllmExtConnector (vllm_ext/connector)
    entry_points={"vllm.general_plugins": ["vllm_ext_connector = vllm_ext.connector:register"]},
    zip_safe=False,
)
