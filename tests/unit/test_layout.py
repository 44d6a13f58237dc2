"""The layout docs/design.md ("Layers") promises, checked on the source: no import circle
(imports made only for type checking count), no layer importing one above it, the daemon's
side never importing the command side, a small package root, and small units."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "acpfs"

# each layer and the layers it may import (besides itself and the package root), as
# docs/design.md's table and the subpackages' docstrings say; None: anything
MAY_IMPORT: dict[str, set[str] | None] = {
    "store": set(),
    "backing": {"store"},
    "oplog": {"store"},
    "cache": {"oplog", "store", "backing"},
    "cluster": {"oplog", "backing"},
    "flusher": {"cluster", "cache", "oplog", "store", "backing"},
    "core": {"flusher", "cluster", "cache", "oplog", "store", "backing"},
    "fuse": {"core", "flusher", "cluster", "cache", "oplog", "store", "backing"},
    "daemon": {"fuse", "core", "flusher", "cluster", "cache", "oplog", "store", "backing"},
    "commands": None,
    "torch": None,
}
ROOT_MODULES = {"__init__", "__main__", "config", "node", "errors", "mounttable", "userdirs"}
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 500, 80


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["acpfs", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in it (in functions and
    under ``if TYPE_CHECKING:`` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:   # "from pkg import module" imports the module
                if f"{target}.{alias.name}" in known:
                    found.add(f"{target}.{alias.name}")
            if target in known and not any(f"{target}.{a.name}" in known for a in node.names):
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> str | None:
    """The subpackage of module ``name``; None for the package root's modules."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def test_the_walk_sees_the_imports_it_checks(graph):
    """The checks below are only as good as the walk: it sees relative imports of modules,
    of names from modules, and imports made only for type checking."""
    assert "acpfs.cache.inodes" in graph["acpfs.cache.files"]          # from .inodes import Inodes
    assert "acpfs.core.control" in graph["acpfs.commands.client"]      # from ..core import control
    assert "acpfs.flusher.flusher" in graph["acpfs.core.control"]      # under TYPE_CHECKING
    assert "acpfs.errors" in graph["acpfs.cluster.globalorder"]


def test_no_import_circle(graph):
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_no_layer_imports_a_layer_above_it(graph):
    upwards = []
    for name, targets in graph.items():
        allowed = MAY_IMPORT.get(layer(name) or "", None)
        if layer(name) is None or allowed is None:
            continue
        for target in targets:
            other = layer(target)
            if other is not None and other != layer(name) and other not in allowed:
                upwards.append(f"{name} -> {target}")
    assert upwards == []


def test_the_daemons_side_never_imports_the_command_side(graph):
    daemon_side = [n for n in graph if layer(n) not in (None, "commands", "torch")]
    daemon_side += [f"acpfs.{m}" for m in ROOT_MODULES - {"__init__", "__main__"}]
    wrong = [f"{n} -> {t}" for n in daemon_side for t in graph[n] if layer(t) == "commands"]
    assert wrong == []


def test_the_package_root_holds_what_every_layer_uses_and_the_public_api():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= ROOT_MODULES and len(top) <= 8, top
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(MAY_IMPORT)
    for sub in subpackages:
        doc = ast.get_docstring(ast.parse((PACKAGE / sub / "__init__.py").read_text()))
        assert doc and "May import" in doc or sub == "torch", f"{sub}/__init__.py says what it may import"


def test_units_stay_small():
    big = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        if text.count("\n") > MAX_MODULE:
            big.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                big.append(f"{rel}: class {node.name} {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                big.append(f"{rel}: {node.name} {size} lines")
    assert big == []


def test_every_module_says_what_it_owns():
    silent = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
              if p.name != "__main__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert silent == []
