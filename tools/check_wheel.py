#!/usr/bin/env python3
"""Checks a built vllm-ext wheel against the build that was asked for.

Runs in the Docker `build` stage, in CI, and after `make wheel RUNNER=host`. Each check prints
one line, `ok` or `FAIL` with the values involved; the exit status is 1 when any check failed.

Checks:
  size       the wheel is within a size budget (MAX_WHEEL_MIB, set from measurement).
  contents   exactly one shared library, vllm_ext/libvllm_ext.so, and the build-info record.
  build-info vllm_ext/_build_info.json matches the declared build (device, CUDA version, arch
             list, and version / git revision when given), and the file name's local version
             tag (+cu130, +cpu) agrees with it.
  links      the library needs nothing beyond glibc (libc, libm and its stub libraries),
             libstdc++, libgcc_s and the dynamic loader; in particular no libcudart (it is
             linked statically) and no libcuda (reached through the runtime at run time).
  sass       (CUDA builds) `cuobjdump --list-elf` shows machine code for every declared arch
             and for no other arch.
  ptx        (CUDA builds) `cuobjdump --list-ptx` shows PTX exactly for the archs declared
             with +PTX.

Needs only Python 3.8+, readelf or objdump (binutils), and cuobjdump for CUDA builds (named by
$CUOBJDUMP, else found on PATH, in $CUDA_HOME/bin, /usr/local/cuda/bin, or this Python's
nvidia/cu*/bin from PyPI's nvidia-cuda-cuobjdump).

Example:
  tools/check_wheel.py dist/vllm_ext-0.1.0+cu130-py3-none-linux_x86_64.whl \\
      --target-device cuda --cuda-version 13.0 --arch-list "8.0 9.0a 12.0+PTX"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from typing import Dict, List, Optional, Set, Tuple

# Budget for the wheel file. Measured with CUDA 13.0: 0.46 MiB for the default six-arch list,
# 0.36 MiB for one arch. 2 MiB leaves room for the kernels to grow several times over, not for
# device debug code (-G) or a second copy of the kernels. Raise it deliberately, with a reason.
MAX_WHEEL_MIB = 2.0

LIBRARY = "vllm_ext/libvllm_ext.so"
BUILD_INFO = "vllm_ext/_build_info.json"

# DT_NEEDED entries a portable wheel may carry. libdl, libpthread and librt are parts of glibc
# (empty stubs since glibc 2.34) that static cudart asks for.
ALLOWED_NEEDED = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libstdc++.so.6",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}

ARCH_RE = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


class Arch:
    """One TORCH_CUDA_ARCH_LIST entry: `9.0`, `9.0a`, `10.0f`, `12.0+PTX`."""

    def __init__(self, text: str):
        match = ARCH_RE.match(text)
        if match is None:
            raise ValueError(
                f"arch list: entry {text!r} is not MAJOR.MINOR with an optional a/f suffix "
                "and optional +PTX (e.g. 9.0, 9.0a, 12.0+PTX)"
            )
        major, minor, suffix, ptx = match.groups()
        self.text = text
        self.number = f"{major}{minor}"
        self.suffix = suffix
        self.ptx = bool(ptx)

    def sass_names(self) -> Set[str]:
        """Names cuobjdump may give this arch's cubin. Family-specific (`f`) code is listed
        under the plain arch name by cuobjdump 13.x."""
        names = {f"sm_{self.number}{self.suffix}"}
        if self.suffix == "f":
            names.add(f"sm_{self.number}")
        return names


def split_arch_list(text: str) -> List[str]:
    """TORCH_CUDA_ARCH_LIST is separated by spaces or semicolons."""
    return [part for part in re.split(r"[\s;]+", text.strip()) if part]


class Report:
    def __init__(self) -> None:
        self.failures = 0

    def check(self, name: str, passed: bool, detail: str) -> bool:
        print(f"{'ok  ' if passed else 'FAIL'} {name:<10} {detail}", flush=True)
        if not passed:
            self.failures += 1
        return passed


def find_tool(name: str, env_var: Optional[str] = None) -> Optional[str]:
    if env_var and os.environ.get(env_var):
        return os.environ[env_var]
    found = shutil.which(name)
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    # PyPI's nvidia-cuda-* wheels put the toolkit in site-packages/nvidia/cu<major>/.
    nvidia = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    if os.path.isdir(nvidia):
        roots += sorted(os.path.join(nvidia, d) for d in os.listdir(nvidia) if d.startswith("cu"))
    for root in roots:
        if root and os.access(os.path.join(root, "bin", name), os.X_OK):
            return os.path.join(root, "bin", name)
    return None


def run(cmd: List[str]) -> Tuple[int, str]:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def needed_libraries(library: str) -> Tuple[Optional[List[str]], str]:
    """DT_NEEDED entries via readelf -d, else objdump -p. Returns (names, tool) or (None, why)."""
    readelf = shutil.which("readelf")
    if readelf:
        code, out = run([readelf, "-d", library])
        if code == 0:
            return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out), "readelf -d"
    objdump = shutil.which("objdump")
    if objdump:
        code, out = run([objdump, "-p", library])
        if code == 0:
            return re.findall(r"^\s*NEEDED\s+(\S+)", out, re.MULTILINE), "objdump -p"
    return None, "neither readelf nor objdump is installed (binutils)"


def cuobjdump_archs(cuobjdump: str, flag: str, library: str) -> Tuple[Optional[Set[str]], str]:
    """Arch names (sm_90a, ...) of the ELF or PTX entries cuobjdump lists."""
    code, out = run([cuobjdump, flag, library])
    if code != 0 and "does not contain device code" in out:
        return set(), ""
    if code != 0:
        return None, f"{cuobjdump} {flag} failed ({code}): {out.strip()}"
    return set(re.findall(r"\.(sm_\d+[a-z]?)\.(?:cubin|ptx)\b", out)), ""


def local_version_tag(wheel_name: str) -> Optional[str]:
    # vllm_ext-0.1.0+cu130-py3-none-linux_x86_64.whl -> "cu130"
    match = re.match(r"^[^-]+-[^-+]+\+([^-]+)-", wheel_name)
    return match.group(1) if match else None


def expected_tag(target_device: str, cuda_version: str) -> str:
    if target_device == "cpu":
        return "cpu"
    major, minor = cuda_version.split(".")[:2]
    return f"cu{major}{minor}"


def check_wheel(args: argparse.Namespace) -> int:
    report = Report()
    wheel = args.wheel
    name = os.path.basename(wheel)

    declared = [Arch(text) for text in split_arch_list(args.arch_list)]
    if args.target_device == "cuda" and not declared:
        print("check_wheel.py: --arch-list is empty for a CUDA build", file=sys.stderr)
        return 2

    size_mib = os.path.getsize(wheel) / 2**20
    report.check("size", size_mib <= args.max_size_mib, f"{size_mib:.2f} MiB (budget {args.max_size_mib} MiB)")

    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        members = archive.namelist()
        shared = sorted(m for m in members if re.search(r"\.so(\.\d+)*$", m))
        report.check("contents", shared == [LIBRARY], f"shared libraries: {shared or 'none'}")
        if BUILD_INFO not in members:
            report.check("build-info", False, f"{BUILD_INFO} is missing")
            info: Dict[str, object] = {}
        else:
            info = json.loads(archive.read(BUILD_INFO))
        if LIBRARY in members:
            library = archive.extract(LIBRARY, tmp)
        else:
            library = None

        if info:
            expected: Dict[str, object] = {
                "target_device": args.target_device,
                "cuda_version": args.cuda_version if args.target_device == "cuda" else None,
                "arch_list": [arch.text for arch in declared],
            }
            if args.version:
                expected["version"] = args.version
            if args.git_revision:
                expected["git_revision"] = args.git_revision
            for key, want in expected.items():
                got = info.get(key)
                if key == "cuda_version" and want is None:
                    continue  # a CPU build may record the toolkit it saw, or nothing
                report.check("build-info", got == want, f"{key}: recorded {got!r}, declared {want!r}")
            tag = local_version_tag(name)
            want_tag = expected_tag(args.target_device, args.cuda_version)
            report.check("build-info", tag == want_tag, f"file name tag: +{tag}, declared +{want_tag}")

        if library is None:
            return finish(report)

        needed, tool = needed_libraries(library)
        if needed is None:
            report.check("links", False, tool)
        else:
            extra = sorted(set(needed) - ALLOWED_NEEDED)
            report.check(
                "links",
                not extra,
                f"{tool}: needs {', '.join(needed)}" + (f"; not allowed: {', '.join(extra)}" if extra else ""),
            )

        if args.target_device == "cuda":
            check_device_code(report, library, declared)
    return finish(report)


def check_device_code(report: Report, library: str, declared: List[Arch]) -> None:
    cuobjdump = find_tool("cuobjdump", "CUOBJDUMP")
    if cuobjdump is None:
        report.check(
            "sass",
            False,
            "cuobjdump not found ($CUOBJDUMP, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, site-packages/"
            "nvidia/cu*/bin); it ships with the CUDA toolkit and as PyPI's nvidia-cuda-cuobjdump",
        )
        return

    elf, error = cuobjdump_archs(cuobjdump, "--list-elf", library)
    if elf is None:
        report.check("sass", False, error)
    else:
        for arch in declared:
            found = arch.sass_names() & elf
            report.check(
                "sass",
                bool(found),
                f"{arch.text}: {'/'.join(sorted(arch.sass_names()))} "
                + ("present" if found else f"missing (library has {sorted(elf) or 'none'})"),
            )
        allowed = set().union(*(arch.sass_names() for arch in declared))
        undeclared = sorted(elf - allowed)
        report.check("sass", not undeclared, f"undeclared archs: {', '.join(undeclared) or 'none'}")

    ptx, error = cuobjdump_archs(cuobjdump, "--list-ptx", library)
    if ptx is None:
        report.check("ptx", False, error)
        return
    want = {f"sm_{arch.number}{arch.suffix}" for arch in declared if arch.ptx}
    report.check(
        "ptx",
        ptx == want,
        f"PTX for {', '.join(sorted(ptx)) or 'none'}; declared +PTX: {', '.join(sorted(want)) or 'none'}",
    )


def finish(report: Report) -> int:
    if report.failures:
        print(f"check_wheel: {report.failures} check(s) failed", flush=True)
        return 1
    print("check_wheel: all checks passed", flush=True)
    return 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("wheel", help="the .whl file")
    parser.add_argument("--target-device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cuda-version", default="13.0", help="MAJOR.MINOR, e.g. 13.0")
    parser.add_argument("--arch-list", default="", help='TORCH_CUDA_ARCH_LIST of the build, e.g. "9.0a 12.0+PTX"')
    parser.add_argument("--version", default="", help="expected package version (optional)")
    parser.add_argument("--git-revision", default="", help="expected git revision (optional)")
    parser.add_argument("--max-size-mib", type=float, default=MAX_WHEEL_MIB, help="wheel size budget (MiB)")
    args = parser.parse_args(argv)
    args.cuda_version = ".".join(args.cuda_version.split(".")[:2])
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.wheel):
        print(f"check_wheel.py: wheel: {args.wheel!r} is not a file", file=sys.stderr)
        return 2
    try:
        return check_wheel(args)
    except ValueError as error:
        print(f"check_wheel.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
