"""A name quoted right after a source file (```engine/engine.py` `Engine.step```) is bound in that file.

Read with ``ast``.  The forms ```path.py` `name```, ```path.py`: `name``` and
```path.py` (`name`, `other`)`` (a list in brackets: each name up to the first
word that is not a quoted name) check that ``name``'s first part is bound
somewhere in the file: a ``def``, ``class``, assigned name or attribute, or a
parameter.  So a function moved to another file, or renamed, fails here.
Used by ``tests/doc_names.py``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Callable, Iterator, Optional, Set

FILE_SYMBOL = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py)`:? (\(?)`([A-Za-z_][\w.]*)(?:\(\))?`"
                         r"((?:, `[A-Za-z_][\w.]*(?:\(\))?`)*)")
_LISTED = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?`")


def references(line: str, following: str = "") -> Iterator[str]:
    """``"path.py name"`` for each quoted name right after a quoted source file that starts in ``line``.

    ``following`` is the next line of the paragraph: a line ending in a
    quoted file may quote its name at the start of the next one.
    """
    text = line.rstrip() + " " + following.lstrip().lstrip("#* ") if following else line
    for m in FILE_SYMBOL.finditer(text):
        if m.start() < len(line):
            yield f"{m.group(1)} {m.group(3)}"
            if m.group(2):  # a list in brackets: the names that follow the first
                for name in _LISTED.findall(m.group(4)):
                    yield f"{m.group(1)} {name}"


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def tree(path: Path) -> ast.Module:
    """``path`` parsed, once per process: every doc checker reads a module's syntax tree from here."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def bound_names(path: Path) -> Set[str]:
    """Every name a file binds anywhere: defs, classes, assignments (names and attributes), parameters."""
    names: Set[str] = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def symbol_exists(ref: str, root: Path, find_file: Callable[[str, Path], Optional[Path]]) -> bool:
    """Whether ``"path.py name"``'s name is bound in the file (a file that does not exist is another check's)."""
    path, name = ref.split(" ", 1)
    found: Optional[Path] = find_file(path, root)
    return found is None or name.split(".")[0] in bound_names(found)
