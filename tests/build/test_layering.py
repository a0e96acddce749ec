"""The package's layers point one way: no import cycle inside vllm_ext, protocol.py imports
nothing of the package, backends never import the endpoint, and only _lib.py and _nccl_lib.py
load shared libraries."""

import ast
from pathlib import Path

import vllm_ext

PACKAGE = Path(vllm_ext.__file__).resolve().parent
BACKENDS = ("ipc", "nccl", "gloo", "rayrpc")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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


def test_protocol_imports_nothing_of_the_package():
    assert _imports(PACKAGE / "migration" / "protocol.py") == set()


def test_backends_never_import_the_endpoint():
    for name in BACKENDS:
        imported = _imports(PACKAGE / "migration" / f"{name}.py")
        assert "vllm_ext.migration.endpoint" not in imported and "vllm_ext.migration" not in imported, name


def test_only_the_two_loaders_load_shared_libraries():
    loaders = {"_lib.py", "_nccl_lib.py"}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if path.name not in loaders:
            assert "CDLL" not in text and "LoadLibrary" not in text and "dlopen" not in text, path
