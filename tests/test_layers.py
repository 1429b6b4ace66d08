"""The package's layers: each subpackage imports only from the layers below it, and no
two modules import each other, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coalescer"

# Lowest first. Modules of one rank may import each other's rank only where they
# share a subpackage (worker and sources are peers that never import each other).
RANKS = {
    "errors": 0, "common": 1, "config": 2, "store": 3, "tracing": 3, "write": 4, "claim": 4,
    "worker": 5, "sources": 5, "query": 6,
    "facade": 7, "integrations": 7,
    "web": 8, "cli": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


FACADE = {"__init__", "coalescer", "sync", "testing"}


# Of one rank, but one builds on the other: the integrations make coalescers for an app
# (the façade's SyncCoalescer), the façade never imports an integration.
BESIDE = {("integrations", "facade")}

# A Django app's management commands are command-line entry points: the cli layer.
DJANGO_COMMANDS = "coalescer.integrations.django.management"


def layer(module: str) -> str:
    """The subpackage of ``module``; the top-level modules a user imports are the façade."""
    if module == DJANGO_COMMANDS or module.startswith(DJANGO_COMMANDS + "."):
        return "cli"
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return "facade" if name in FACADE else name


def imported(path: Path, *, typing: bool = False) -> set[str]:
    """The coalescer modules ``path`` imports, lazy imports inside functions included,
    imports made only for type checking left out unless ``typing``."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing else {
        id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
        and "TYPE_CHECKING" in ast.unparse(top.test) for n in ast.walk(top)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.split(".")[0] == "coalescer"}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_from_its_own_layer_or_below(module: str) -> None:
    mine = layer(module)
    wrong = []
    for target in imported(MODULES[module]):
        theirs = layer(target)
        if theirs == mine or (mine, theirs) in BESIDE:
            continue
        if RANKS[theirs] >= RANKS[mine]:
            wrong.append(target)
    assert not wrong, f"{module} ({mine}) imports from layers at or above its own: {wrong}"


def test_every_subpackage_says_what_it_holds_and_may_import() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.parent.name}/__init__.py does not say what it may import"
        assert layer(module_name(init)) in RANKS, f"{init.parent.name} has no rank"


def test_no_two_modules_import_each_other() -> None:
    """Imports made only for type checking count too: a part that names the node's type
    cannot be read without the node."""
    graph = {m: {t for t in imported(p, typing=True) if t in MODULES and t != m}
             for m, p in MODULES.items()}
    cycles = []
    for start, targets in graph.items():
        seen: set[str] = set()
        stack = list(targets)
        while stack:
            node = stack.pop()
            if node == start:
                cycles.append(start)
                break
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"
