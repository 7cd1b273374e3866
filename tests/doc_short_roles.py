"""A short Sphinx role of a docstring (``:func:`admit```, ``:meth:`_bitmask_on_device```) names something that exists.

Read with ``ast``.  A role whose target does not start with ``tpguide.``
(those are dotted names, checked by ``tests/doc_names.py``) resolves when its
first part is bound in the file itself (a ``def``, ``class``, assigned name or
attribute, a parameter, an import), is defined anywhere in ``tpguide/`` (then
``Name.attr`` must be bound in that class, :mod:`doc_class_names`), or is a
module beside the file (``failure_policy.run_main``).  Another project's name
(``asyncio.Queue``) is taken when the file imports its first part or when it
is in :data:`EXTERNAL_MODULES`.  Used by ``tests/doc_names.py``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Callable, Iterator

import doc_class_names
import doc_file_symbols

#: ``:func:`name```, ``:meth:`~Class.name```, ``:data:`title <name>```: the role's target.
ROLE = re.compile(r":(?:func|meth|data|attr|class|obj|exc|const):`(?:[^`<]*<)?~?([A-Za-z_][\w.]*)>?`")

#: Other projects' modules that docstrings cite without importing them where they do.
EXTERNAL_MODULES = frozenset({"prometheus_client"})


def references(line: str) -> Iterator[str]:
    """The target of each short role (not ``tpguide.``-dotted) of one line of a docstring or comment."""
    for m in ROLE.finditer(line):
        ref = m.group(1)
        if not ref.startswith("tpguide.") and not doc_class_names.CLASS_NAME.fullmatch(f"`{ref}`"):
            yield ref  # a quoted CamelCase name is the class-name check's


@functools.lru_cache(maxsize=None)
def _imports(path: Path) -> frozenset:
    """Every name an ``import`` binds anywhere in ``path`` (its first part)."""
    out = set()
    for node in ast.walk(doc_file_symbols.tree(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(out)


def role_exists(ref: str, page: Path, root: Path, name_exists: Callable[[str, Path], bool]) -> bool:
    """Whether a short role's target ``ref`` of ``page`` (a ``.py`` file under ``root``) resolves (module doc)."""
    first = ref.split(".")[0]
    if first in EXTERNAL_MODULES:
        return True
    names, _ = doc_class_names.index(root)
    if first in names:
        return doc_class_names.class_name_exists(ref, root)
    if first in doc_file_symbols.bound_names(page) or first in _imports(page):
        return True
    package = ".".join(page.relative_to(root).with_suffix("").parts[:-1])
    return name_exists(f"{package}.{ref}", root)
