"""The package's tiers point one way (docs/design.md):

    router/ (aiohttp) ──► lease/ ◄── connector/ (vllm)
                            │            │
                            ▼            ▼
          migration/{control,protocol,auth,timing} ◄── migration/ (endpoint, backends)
                                                          │
                                                          ▼
                                             ops / cache / _lib ──► csrc/

RULES is the one table of what each part may not import (vllm_ext modules and third-party
packages alike, at any depth of a file: lazy imports count); besides it: no import cycle
inside vllm_ext, and only _lib.py and _nccl_lib.py load shared libraries."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_ext

PACKAGE = Path(vllm_ext.__file__).resolve().parent
BACKENDS = ("ipc", "nccl", "gloo", "rayrpc")
TRANSPORT_CONTRACT = ("vllm_ext.migration.control", "vllm_ext.migration.protocol", "vllm_ext.migration.auth",
                      "vllm_ext.migration.timing")
# (the modules a rule is about: a package or module prefix, what they must not import, why);
# "=name": that module itself (a package's __init__), not what lies under it
RULES = [
    ("vllm_ext.migration", ("vllm_ext.lease", "vllm_ext.connector", "vllm_ext.router", "vllm_ext.fleet", "vllm",
                            "aiohttp"),
     "the transport knows no vLLM, no HTTP and no lease"),
    ("vllm_ext.migration.protocol", ("vllm_ext",), "the endpoint's wire format stands alone"),
    *[(f"vllm_ext.migration.{b}", ("vllm_ext.migration.endpoint", "=vllm_ext.migration"), "backends sit below the "
       "endpoint") for b in BACKENDS],
    ("vllm_ext.lease", ("torch", "vllm", "aiohttp", "vllm_ext.connector", "vllm_ext.router", "vllm_ext.ops",
                        "vllm_ext.cache", "vllm_ext._lib", "vllm_ext.fleet", "ALL_MIGRATION_BUT_CONTRACT"),
     "the instance/front contract stands on the transport's contract only"),
    ("vllm_ext.connector", ("vllm_ext.router", "vllm_ext.fleet", "aiohttp"), "the connector never imports the fronts"),
    ("vllm_ext.router", ("vllm_ext.connector", "vllm_ext.migration.endpoint", "vllm_ext.ops", "vllm_ext.cache",
                         "vllm_ext._lib", "vllm_ext.fleet", "torch", "vllm"),
     "the fronts load neither torch nor vLLM"),
    ("vllm_ext.proxy", ("vllm_ext.connector", "vllm_ext.migration.endpoint", "vllm_ext.ops", "vllm_ext.cache",
                        "torch", "vllm"), "the P/D proxy is a front"),
    ("vllm_ext", ("vllm",), "only the connector imports vllm"),
    ("vllm_ext", ("aiohttp",), "only the fronts import aiohttp"),
]
# who may, where the last two rules say nobody may
ALLOWED = {"vllm": ("vllm_ext.connector",), "aiohttp": ("vllm_ext.router", "vllm_ext.proxy", "vllm_ext.router.http")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _third_party(path: Path):
    """The top-level names of the packages outside vllm_ext that `path` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"vllm_ext"}


def _imports(path: Path):
    """Every vllm_ext module `path` imports, at any depth of the file (lazy imports count)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vllm_ext"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("vllm_ext"):
                continue
            submodules = [f"{target}.{a.name}" for a in node.names
                          if (PACKAGE.parent / Path(*f"{target}.{a.name}".split("."))).with_suffix(".py").exists()]
            # `from . import protocol` imports that module; `from .base import X` imports .base
            found.update(submodules if len(submodules) == len(node.names) else [target] + submodules)
    return found - {name}


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in modules} for m, p in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    # Importing a submodule runs its parents' __init__: those edges are implied, not listed.
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(owner: str, forbidden, reason: str):
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = []
    for name, path in sorted(modules.items()):
        if not _within(name, owner):
            continue
        ours, theirs = _imports(path), _third_party(path)
        for target in forbidden:
            if target == "ALL_MIGRATION_BUT_CONTRACT":
                bad = {m for m in ours if _within(m, "vllm_ext.migration") and m not in TRANSPORT_CONTRACT}
            elif target.startswith("="):
                bad = {m for m in ours if m == target[1:]}
            elif target.startswith("vllm_ext"):
                bad = {m for m in ours if _within(m, target) and not _within(m, owner)}
            else:
                allowed = ALLOWED.get(target, ()) if owner == "vllm_ext" else ()
                bad = {target} if target in theirs and not any(_within(name, a) for a in allowed) else set()
            out += [f"{name} imports {b} ({reason})" for b in sorted(bad)]
    return out


@pytest.mark.parametrize("owner,forbidden,reason", RULES, ids=[f"{r[0]}:{r[2][:30]}" for r in RULES])
def test_tiers_point_one_way(owner, forbidden, reason):
    assert _violations(owner, forbidden, reason) == []


def test_the_rules_can_fail():
    """The checker finds a forbidden import where there is one (a rule the tree breaks on purpose)."""
    assert _violations("vllm_ext.connector", ("vllm",), "probe")
    assert _violations("vllm_ext.router", ("aiohttp",), "probe")
    assert _violations("vllm_ext.lease", ("vllm_ext.migration",), "probe")


def test_only_the_two_loaders_load_shared_libraries():
    loaders = {"_lib.py", "_nccl_lib.py"}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name not in loaders:
            assert "CDLL" not in text and "LoadLibrary" not in text and "dlopen" not in text, path


def test_the_fronts_and_the_contract_load_no_endpoint_torch_or_vllm():
    """At run time too: importing the router, the P/D proxy and the lease channel (the fronts'
    start-up) loads neither torch nor vLLM nor the transport's endpoint."""
    code = ("import sys, vllm_ext.router.app, vllm_ext.router.pd, vllm_ext.lease\n"
            "print(' '.join(m for m in ('torch', 'vllm', 'vllm_ext.migration.endpoint', 'vllm_ext.ops') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if "No module named 'aiohttp'" in out.stderr:
        pytest.skip("the fronts need aiohttp (requirements-test.txt)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [], out.stdout
