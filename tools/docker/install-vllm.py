"""install-vllm.py REQUIREMENTS OVERRIDES: what `pip-install -r REQUIREMENTS` would install, where
the vLLM release pinned there asks for a release the package index does not carry and OVERRIDES
pins another in its place (vLLM 0.34.0 pins flashinfer-python==0.7.3; PyPI has 0.7.2.post1
and 0.7.4). Runs inside a Docker build, with the venv's Python.

pip has no overrides, so: vLLM alone (--no-deps), then one pip run (one resolution) of every
other line of REQUIREMENTS and vLLM's own requirements (its METADATA, markers evaluated here),
each package OVERRIDES names pinned as OVERRIDES says instead. An override that replaces none of
vLLM's requirements stops the build (a stale file). `pip check` reports exactly the replaced
pins afterwards; .ci/docker-pipeline.sh accepts those and nothing else.
"""

import os
import subprocess
import sys
import tempfile
from importlib import metadata

# pip's own copy: `packaging` itself may not be installed before vLLM's requirements are
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def requirement_lines(path):
    """The lines of a requirements file that say something (comments and blanks dropped)."""
    with open(path) as f:
        return [line.split(" #")[0].strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def pip_install(*args):
    subprocess.run(["pip-install", *args], check=True)


def main(requirements, overrides_path):
    overrides = {canonicalize_name(Requirement(line).name): Requirement(line)
                 for line in requirement_lines(overrides_path)}
    vllm_lines, rest = [], []
    for line in requirement_lines(requirements):
        is_vllm = not line.startswith("-") and canonicalize_name(Requirement(line).name) == "vllm"
        (vllm_lines if is_vllm else rest).append(line)
    if len(vllm_lines) != 1:
        sys.exit(f"install-vllm: {requirements}: expected one vllm line, found {vllm_lines}")
    pip_install("--no-deps", vllm_lines[0])
    replaced = set()
    for text in metadata.requires("vllm") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        req.marker = None
        if name in overrides:
            print(f"install-vllm: {vllm_lines[0]} asks for {req}; installing {overrides[name]} ({overrides_path})")
            replaced.add(name)
            req = overrides[name]
        rest.append(str(req))
    stale = sorted(set(overrides) - replaced)
    if stale:
        sys.exit(f"install-vllm: {overrides_path} overrides {', '.join(stale)}, which {vllm_lines[0]} does not "
                 "require: remove it")
    # in REQUIREMENTS' folder, so that its `-r other.txt` lines resolve as pip would resolve them
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=os.path.dirname(os.path.abspath(requirements)),
                                     delete=False) as f:
        f.write("\n".join(rest) + "\n")
    try:
        pip_install("-r", f.name)
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
