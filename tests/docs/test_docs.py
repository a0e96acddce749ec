"""Every ```python block of README.md and docs/*.md runs as written.

A block that needs more than this machine has says so in its first line, e.g.
`# requires: cuda`; it is skipped with that reason where the requirement is missing (and marked
`gpu` or `multi_gpu`, so the GPU suite runs it). Each block runs alone, in a fresh namespace.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The test image holds tests/ only: there the list is empty and the tests are skipped as empty.
DOC_FILES = [p for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))) if p.exists()]
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"#\s*requires:\s*(.+)")


def _gpus():
    import torch

    from vllm_ext import _lib

    return torch.cuda.device_count() if torch.cuda.is_available() and _lib.built_with_cuda() else 0


# requirement -> (pytest marker or None, why it is missing, or None when it is met)
REQUIREMENTS = {
    "cuda": lambda: ("gpu", None if _gpus() >= 1 else "needs a GPU and a CUDA build"),
    "2 gpus": lambda: ("multi_gpu", None if _gpus() >= 2 else "needs two GPUs"),
    "peer process": lambda: (None, "needs another serving instance's descriptor (peer_desc)"),
}
MARKERS = {"cuda": pytest.mark.gpu, "2 gpus": pytest.mark.multi_gpu}


def _blocks():
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            code = match.group(1)
            first = code.split("\n", 1)[0]
            needs = REQUIRES.fullmatch(first.strip())
            requirement = needs.group(1).strip() if needs else None
            marks = [MARKERS[requirement]] if requirement in MARKERS else []
            yield pytest.param(path, line, code, requirement, marks=marks,
                               id=f"{path.relative_to(ROOT)}:{line}")


BLOCKS = list(_blocks())


@pytest.mark.skipif(not DOC_FILES, reason="no README.md or docs/ here (the test image holds tests/ only)")
def test_docs_have_runnable_blocks():
    assert any(p.values[3] is None for p in BLOCKS), "no runnable Python block found in the docs"


@pytest.mark.parametrize("path, line, code, requirement", BLOCKS)
def test_python_block_runs(path, line, code, requirement):
    if requirement is not None:
        if requirement not in REQUIREMENTS:
            pytest.fail(f"{path.name}:{line}: unknown requirement {requirement!r}; "
                        f"known: {', '.join(REQUIREMENTS)}")
        _, missing = REQUIREMENTS[requirement]()
        if missing:
            pytest.skip(f"{path.name}:{line}: {missing}")
    exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), {"__name__": "__doc_block__"})


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    """Each relative link of README.md and docs/*.md names a file of the repository."""
    missing = [target for target in LINK.findall(path.read_text())
               if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{path.name}: links to missing files: {missing}"
