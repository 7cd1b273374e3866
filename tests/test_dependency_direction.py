"""The import graph of tpguide (docs/architecture.md §9), checked on the import statements.

* no import circles between tpguide's modules;
* no upward imports between the layered folders, from high to low
  ``engine > worker > speculative > guided > sampling > model > kernels``;
* every-rank step modules (``tpguide/worker``) import nothing from the
  driver side (``tpguide/engine``), not even indirectly;
* the pure sampling mathematics (``tpguide/sampling``) never reaches
  ``torch.distributed`` (nor ``tpguide.dist``, its only user), not even indirectly.

Every import counts (module level and inside functions).  The graph checks
count those under ``if TYPE_CHECKING:`` too (a dependency all the same); the
reach checks do not.  Importing ``a.b.c`` also imports the packages ``a`` and
``a.b``; in the graph, a module's own enclosing packages are not edges (they
are always imported first).
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


def _imports(tree: ast.AST, package: str, type_checking: bool = False):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            branch = node.body + node.orelse if type_checking else node.orelse
            yield from (n for child in branch for n in _imports(ast.Module(body=[child]), package, type_checking))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # "from pkg import module"
        yield from _imports(node, package, type_checking)


@lru_cache(maxsize=None)
def direct_imports(name: str, type_checking: bool = False) -> frozenset:
    """Every module ``name`` imports (tpguide modules and packages, and others by name).

    ``type_checking``: also the imports under ``if TYPE_CHECKING:`` (a dependency all the same).
    """
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for imported in _imports(ast.parse(path.read_text()), package, type_checking):
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


#: The layered folders, from low to high: a module may import only from its own layer or lower ones.
LAYERS = ("kernels", "model", "sampling", "guided", "speculative", "worker", "engine")


def layer_of(module: str):
    """Index of ``module``'s folder in :data:`LAYERS`, None outside them."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def graph_edges(module: str) -> list:
    """The tpguide modules ``module`` imports (``TYPE_CHECKING`` included, its own packages not)."""
    return sorted(t for t in direct_imports(module, type_checking=True)
                  if t in MODULES and t != module and not module.startswith(t + "."))


def import_circles() -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph_edges(v):
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

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return circles


def upward_imports() -> list:
    return [(m, t) for m in sorted(MODULES) for t in graph_edges(m)
            if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m)]


def test_no_import_circles():
    assert import_circles() == []


def test_no_upward_imports_between_layers():
    assert upward_imports() == []


def test_the_cache_root_imports_nothing_of_tpguide():
    """``tpguide/cache.py`` sits below every folder (the kernels and the model both use it)."""
    assert graph_edges("tpguide.cache") == []


def test_the_graph_checks_see_circles_and_upward_imports(monkeypatch):
    """The graph checks themselves, on a made-up edge: a circle and an upward import."""
    real = graph_edges

    def edges(module):
        extra = ["tpguide.engine.driver"] if module == "tpguide.guided.bitmask" else []
        return real(module) + extra

    monkeypatch.setitem(globals(), "graph_edges", edges)
    assert ("tpguide.guided.bitmask", "tpguide.engine.driver") in upward_imports()
    assert any({"tpguide.guided.bitmask", "tpguide.engine.driver"} <= set(c) for c in import_circles())


#: The folders that may use the engine only through its API (docs/architecture.md §1): no driver internals.
API_ONLY = ("tpguide/serving", "tpguide/cli", "launch")


def driver_reach_throughs(path: Path) -> list:
    """``(line, what)`` of every import from ``tpguide.engine.driver`` and every ``.driver`` attribute in a file."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpguide.engine.driver"):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith("tpguide.engine.driver")]
        elif isinstance(node, ast.Attribute) and node.attr == "driver":
            found.append((node.lineno, f"{ast.unparse(node)}"))
    return found


@pytest.mark.parametrize("path", [p for folder in API_ONLY for p in sorted((ROOT / folder).rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_serving_and_launch_use_only_the_engine_api(path):
    assert driver_reach_throughs(path) == [], f"{path.relative_to(ROOT)} reaches into the driver"


def test_the_reach_through_check_sees_them(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from tpguide.engine.driver import Driver\nx = engine.driver.spec\n")
    assert [line for line, _ in driver_reach_throughs(bad)] == [1, 2]
