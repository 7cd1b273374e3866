"""docs/architecture.md §9's file map equals each module's first docstring paragraph (``launch/file_map.py``)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import file_map  # noqa: E402


def test_the_documented_file_map_is_the_generated_one():
    doc = file_map.DOC.read_text(encoding="utf-8")
    assert file_map.with_map(doc, file_map.file_map()) == doc, (
        "docs/architecture.md's file map differs from the modules' docstrings: run `python launch/file_map.py --write`")


def test_every_module_has_a_summary():
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tpguide").rglob("*.py"))
               if file_map.summary(p) == "(no docstring)"]
    assert missing == [], f"modules without a docstring (the file map's row): {missing}"


def test_the_map_follows_a_new_module_and_a_changed_docstring(tmp_path):
    pkg = tmp_path / "tpguide" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "tpguide" / "__init__.py").write_text('"""The root."""\n')
    (pkg / "__init__.py").write_text('"""The engine: `a` | b."""\n')
    (pkg / "loop.py").write_text('"""The loop, see :class:`~tpguide.engine.loop.Loop`\nand ``x | y``.\n\nMore."""\n')
    assert file_map.file_map(tmp_path) == (
        "### tpguide\n\nThe root.\n\n| file | what it holds |\n|---|---|\n\n"
        "### tpguide/engine\n\nThe engine: `a` | b.\n\n| file | what it holds |\n|---|---|\n"
        "| `loop.py` | The loop, see `tpguide.engine.loop.Loop` and `x \\| y`. |\n")
    doc = f"# A\n{file_map.BEGIN}\n\nold\n{file_map.END}\n## B\n"
    assert file_map.with_map(doc, "new\n") == f"# A\n{file_map.BEGIN}\n\nnew\n\n{file_map.END}\n## B\n"
    with pytest.raises(ValueError, match="no file map markers"):
        file_map.with_map("# A\n", "new")
