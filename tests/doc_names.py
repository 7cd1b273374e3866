"""Every ``tpguide/...`` path, quoted source path and dotted ``tpguide.x.y`` name the docs and docstrings mention exists.

Read statically (``ast``), never by importing: a dotted name resolves when its
longest module prefix is a file or package of ``tpguide/`` and each remaining
part is bound there (a ``def``, ``class``, assignment or annotated field at
module or class level).  An imported name counts only where it is re-exported:
in a package's ``__init__`` or a module's ``__all__``, followed to its module;
``tpguide.engine.driver.StepFinisher`` (imported there, defined in
``engine/finisher.py``) does not resolve.
Used by ``tests/test_doc_names.py``.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import doc_class_names
import doc_file_symbols
import doc_short_roles

ROOT = Path(__file__).resolve().parents[1]

#: ``tpguide/engine/driver.py``, ``tpguide/kernels/csrc/*.c``, ``tpguide/dist``: a path under the package.
_PATH = re.compile(r"(?<![\w./-])tpguide/[\w*./-]*[\w*/]")
#: ``tpguide.engine.config.EngineConfig``: a dotted name (at least one dot).
_NAME = re.compile(r"(?<![\w./-])tpguide(?:\.[A-Za-z_]\w*)+")
#: ```engine/driver.py```: a quoted relative path of a source file, under the root, ``tpguide/``,
#: ``tpguide/kernels/`` (``csrc/``) or ``tests/``.  After ``<name>'s`` it is another project's file: not checked.
_RELATIVE = re.compile(r"(?<!'s )(?<!'s `)`((?:[\w.-]+/)+[\w.*-]+\.(?:py|sh|c))`")
_RELATIVE_BASES = ("", "tpguide", "tpguide/kernels", "tests")
#: ``docs/architecture.md §7 "KV cache"``, ``docs/gpu.md, "Exactness on CUDA"``: a doc page, its numbered
#: section(s) and a section title (a title cut by the end of a docstring line is checked as far as it goes).
_SECTION = re.compile(r'(?<![\w/-])docs/([\w-]+\.md)((?:,? §\d+)*)(?:,? "([^"]+)(?:"|$))?')
#: ``architecture.md §9`` without ``docs/`` (a doc page citing another): a numbered section, maybe a title.
_BARE_SECTION = re.compile(r'(?<![\w/.-])([\w-]+\.md)((?:,? §\d+)+)(?:,? "([^"]+)(?:"|$))?')


def pages(root: Path = ROOT) -> List[Path]:
    """README.md, docs/*.md and every ``.py`` file of the package: the text whose references are checked."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "tpguide").rglob("*.py"))]


#: Module attributes every module has.
_MODULE_DUNDERS = {"__file__", "__name__", "__path__", "__doc__", "__spec__", "__all__"}


def prose_lines(page: Path) -> Iterator[Tuple[int, str]]:
    """(line number, text) of a page's prose: every line of a Markdown page; a Python file's docstrings and comments.

    A docstring is any string statement (module, class, function or attribute
    docstring); code and other string literals (a store key, a message) are not
    prose and are not checked.
    """
    text = page.read_text(encoding="utf-8")
    if page.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    lines = text.splitlines()
    for node in ast.walk(doc_file_symbols.tree(page)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for number in range(node.lineno, node.end_lineno + 1):
                yield number, lines[number - 1]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def references(lines) -> Iterator[Tuple[int, str, str]]:
    """(line number, kind, reference) of every path, name and section citation in ``lines`` (see the kinds below)."""
    lines = list(lines)
    for i, (number, line) in enumerate(lines):
        # a quoted name may follow its file on the next line of the paragraph
        following = lines[i + 1][1] if i + 1 < len(lines) and lines[i + 1][0] == number + 1 else ""
        for m in _PATH.finditer(line):
            yield number, "path", m.group(0)
        for m in _NAME.finditer(line):
            yield number, "name", m.group(0)
        for m in _RELATIVE.finditer(line):
            if not m.group(1).startswith("tpguide/"):
                yield number, "relative path", m.group(1)
        for ref in doc_class_names.references(line):
            yield number, "class name", ref
        for ref in doc_file_symbols.references(line, following):
            yield number, "name in file", ref
        for ref in doc_short_roles.references(line):
            yield number, "short role", ref
        for m in [*_SECTION.finditer(line), *_BARE_SECTION.finditer(line)]:
            page, numbers, title = m.groups()
            numbers = re.findall(r"§(\d+)", numbers)
            for n in numbers:
                yield number, "section", f"docs/{page} §{n}"
            if title:  # after one section number: a title inside that section
                where = f" §{numbers[0]}" if len(numbers) == 1 else ""
                yield number, "section", f'docs/{page}{where} "{title.strip()}"'
            if not numbers and not title:
                yield number, "section", f"docs/{page}"


def path_exists(ref: str, root: Path = ROOT) -> bool:
    """Whether a ``tpguide/...`` path (a ``*`` glob allowed) names a file or folder under ``root``."""
    ref = ref.rstrip("/")
    if "*" in ref:
        return any(root.glob(ref))
    return (root / ref).exists()


def relative_path_exists(ref: str, root: Path = ROOT) -> bool:
    """Whether a relative source path names a file under one of :data:`_RELATIVE_BASES` of ``root``."""
    return any(path_exists(str(Path(base) / ref) if base else ref, root) for base in _RELATIVE_BASES)


def source_file(ref: str, root: Path = ROOT) -> Optional[Path]:
    """The file a quoted source path names (under one of :data:`_RELATIVE_BASES`), or None."""
    for base in _RELATIVE_BASES:
        path = root / base / ref
        if path.is_file():
            return path
    return None


def file_symbol_exists(ref: str, root: Path = ROOT) -> bool:
    """Whether ``"path.py name"`` (a name quoted right after a source file) is bound in that file."""
    return doc_file_symbols.symbol_exists(ref, root, source_file)


@functools.lru_cache(maxsize=None)
def _module_file(dotted: str, root: Path) -> Optional[Path]:
    """The source file of module ``dotted`` (``tpguide.x.y``) under ``root``, or None."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


_tree = doc_file_symbols.tree


def _bindings(body: list, module: str, path: Path) -> dict:
    """Names bound at one level (module or class body): name -> node, or (module, name) for an import."""
    out: dict = {}

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            out[name.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, path)
                for alias in node.names:
                    out[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    out[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname else
                                                                     alias.name.split(".")[0], None)
            elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, optional imports
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(body)
    return out


def _instance_attributes(cls: ast.ClassDef) -> set:
    """Names a class's own methods assign on ``self`` (``self.stats = ...``): its instances' attributes."""
    out = set()
    for method in cls.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(method):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                out.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                           and isinstance(t.value, ast.Name) and t.value.id == "self")
    return out


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module of a ``from ... import`` in ``module`` (a package's ``__init__`` is its own level)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _exported(path: Path) -> set:
    """The names in a module's ``__all__`` (a list or tuple of strings at module level), else none."""
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def _resolve_in(module: str, parts: List[str], root: Path, depth: int = 0) -> bool:
    """Whether ``parts`` (attribute names) resolve inside module ``module``, following imports."""
    path = _module_file(module, root)
    if path is None or depth > 8:
        return False
    if not parts:
        return True
    if parts == [parts[0]] and parts[0] in _MODULE_DUNDERS:
        return True
    if _module_file(f"{module}.{parts[0]}", root) is not None:  # a submodule
        return _resolve_in(f"{module}.{parts[0]}", parts[1:], root, depth + 1)
    bound = _bindings(_tree(path).body, module, path).get(parts[0])
    if bound is None:
        return False
    if isinstance(bound, tuple):
        source, name = bound
        if not source.startswith("tpguide"):
            return True  # an outside module's name: its attributes are not ours to check
        if path.name != "__init__.py" and parts[0] not in _exported(path):
            return False  # a plain module's import is not its name: cite the module that defines it
        if name is None:
            return _resolve_in(source, parts[1:], root, depth + 1)
        return _resolve_in(source, [name, *parts[1:]], root, depth + 1)
    node = bound
    for i, part in enumerate(parts[1:], 2):
        if not isinstance(node, ast.ClassDef):
            return False
        cls = node
        node = _bindings(cls.body, module, path).get(part)
        if node is None:
            return i == len(parts) and part in _instance_attributes(cls)
        if isinstance(node, tuple):  # a name imported into a class body: the last part only
            return i == len(parts)
    return True


def name_exists(ref: str, root: Path = ROOT) -> bool:
    """Whether a dotted ``tpguide.x.y`` names a module of ``root/tpguide`` or something bound in one."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if _module_file(module, root) is not None:
            return _resolve_in(module, parts[cut:], root)
    return False


def _headings(page: Path) -> List[Tuple[int, str]]:
    """``(level, name)`` of ``page``'s sections, outside fenced code: its headings (level 1-6), and bold
    labels that start a paragraph or a bullet (``**Fixed-order reductions** (the default ...``, level 7)."""
    out, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and re.match(r"^#{1,6} ", line):
            out.append((len(line) - len(line.lstrip("#")), line.lstrip("#").strip()))
        elif not inside:
            out.extend((7, label) for label in re.findall(r"^(?:[*-] )?\*\*([^*]+)\*\*", line))
    return out


def _in_section(headings: List[Tuple[int, str]], number: str) -> List[str]:
    """The names of the headings inside section ``number`` (``## N. ...`` up to the next heading as high)."""
    for i, (level, name) in enumerate(headings):
        if name.startswith(number + ". "):
            inside = []
            for deeper, sub in headings[i + 1:]:
                if deeper <= level:
                    break
                inside.append(sub)
            return inside
    return []


def section_exists(ref: str, root: Path = ROOT) -> bool:
    """Whether ``docs/x.md``, ``docs/x.md §N`` (a heading ``N. ...``), ``docs/x.md "Title"`` or
    ``docs/x.md §N "Title"`` (the title inside section N) exists.

    A title matches a heading that starts with it, so a title cut at a line's
    end (or shortened, "Speed on CUDA") still names its section.
    """
    page, _, where = ref.partition(" ")
    if not (root / page).is_file():
        return False
    if not where:
        return True
    headings = _headings(root / page)
    number, _, title = where.partition(" ") if where.startswith("§") else ("", "", where)
    if number and not title:
        return any(h.startswith(number[1:] + ". ") for _, h in headings)
    inside = _in_section(headings, number[1:]) if number else [h for _, h in headings]
    return any(h.startswith(title.strip('"')) for h in inside)


def broken_references(page: Path, root: Path = ROOT) -> List[str]:
    """``"file:line: kind 'ref' does not exist"`` for each reference of ``page`` that does not resolve."""
    broken = []
    for number, kind, ref in references(prose_lines(page)):
        if kind in ("class name", "name in file") and page.name == "changelog.md":
            continue  # history names what is gone
        if kind == "short role" and page.suffix != ".py":
            continue  # a Sphinx role is a docstring's
        check = {"path": path_exists, "relative path": relative_path_exists, "name": name_exists,
                 "section": section_exists, "class name": doc_class_names.class_name_exists,
                 "name in file": file_symbol_exists,
                 "short role": lambda r, base: doc_short_roles.role_exists(r, page, base, name_exists)}[kind]
        ok = check(ref, root)
        if not ok:
            broken.append(f"{page.relative_to(root)}:{number}: {kind} {ref!r} does not exist")
    return broken
