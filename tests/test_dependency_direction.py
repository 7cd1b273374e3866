"""The folders' dependency direction (docs/architecture.md §9), checked on the import statements.

* every-rank step modules (``tpguide/worker``) import nothing from the
  driver side (``tpguide/engine``), not even indirectly;
* the pure sampling mathematics (``tpguide/sampling``) never reaches
  ``torch.distributed`` (nor ``tpguide.dist``, its only user), not even indirectly.

Every import counts (module level and inside functions), except those under
``if TYPE_CHECKING:``; importing ``a.b.c`` also imports the packages ``a``
and ``a.b``.
"""

import ast
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpguide"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports(ast.Module(body=[child]), package))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # "from pkg import module"
        yield from _imports(node, package)


@lru_cache(maxsize=None)
def direct_imports(name: str) -> frozenset:
    """Every module ``name`` imports (tpguide modules and packages, and others by name)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for imported in _imports(ast.parse(path.read_text()), package):
        parts = imported.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in MODULES or not prefix.startswith("tpguide"):
                found.add(prefix)
    return frozenset(found)


def closure(name: str) -> set:
    """``name`` and everything it imports, transitively (only tpguide modules are followed)."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in MODULES:
            todo.extend(direct_imports(current))
    return seen


def _in(prefix: str):
    return sorted(m for m in MODULES if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize("module", _in("tpguide.worker"))
def test_every_rank_step_imports_nothing_from_the_driver_side(module):
    driver_side = sorted(m for m in closure(module) if m == "tpguide.engine" or m.startswith("tpguide.engine."))
    assert driver_side == [], f"{module} reaches driver-side modules {driver_side}"


@pytest.mark.parametrize("module", _in("tpguide.sampling"))
def test_sampling_mathematics_never_reaches_torch_distributed(module):
    reached = closure(module)
    bad = sorted(m for m in reached if m.startswith("torch.distributed") or m.startswith("tpguide.dist"))
    assert bad == [], f"{module} reaches {bad}"


def test_the_checks_see_imports():
    """The scanner itself: the driver side does reach the worker, and the worker reaches torch.distributed."""
    assert "tpguide.worker.runner" in closure("tpguide.engine.engine")
    assert "torch.distributed" in closure("tpguide.worker.runner")
