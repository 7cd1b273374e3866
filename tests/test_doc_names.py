"""Every ``tpguide/...`` path, quoted source path, ``tpguide.x.y`` name, quoted ``Class.attr`` and section cited exists.

Checked in README.md, docs/*.md and the package's docstrings and comments.

Read with ``ast`` (``tests/doc_names.py``): nothing of tpguide is imported.
"""

import pytest
from doc_names import ROOT, broken_references, name_exists, pages


@pytest.mark.parametrize("page", [p for p in pages() if p.suffix == ".md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_of_a_doc_page_exists(page):
    broken = broken_references(page)
    assert broken == [], "\n".join(broken)


#: Stale references left for another change to fix: (file, reference).  Fix the reference and delete its entry; the test fails on an entry that resolves.
KNOWN_STALE: set = set()


def test_every_reference_of_a_docstring_or_comment_exists():
    broken = [b for p in pages() if p.suffix == ".py" for b in broken_references(p)]
    known = [b for b in broken if any(b.startswith(f + ":") and repr(ref) in b for f, ref in KNOWN_STALE)]
    assert [b for b in broken if b not in known] == [], "\n".join(b for b in broken if b not in known)
    assert len(known) >= len(KNOWN_STALE), f"a KNOWN_STALE entry resolves now: delete it ({known})"


def test_the_checker_finds_broken_paths_and_names(tmp_path):
    pkg = tmp_path / "tpguide" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "tpguide" / "__init__.py").write_text('"""Root."""\nfrom tpguide.engine.config import Config as C\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpguide.engine import other\n"
        "class Config:\n    limit: int = 1\n    def check(self):\n        self.ratio = 2\nDEFAULT = Config()\n"
        "class Sub(Config):\n    pass\n")
    (pkg / "other.py").write_text('"""A module."""\nfrom .config import Config\nfrom .config import DEFAULT\n'
                                  '__all__ = ["Config"]\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "`tpguide/engine/config.py`, `engine/other.py`, `tpguide/engine/*.py`\n"
        'docs/a.md §1 "Data parallel", docs/a.md, "Fixed-order reductions", docs/a.md "Fixed-order\n'
        'docs/a.md §2, docs/a.md, "Gone", docs/gone.md\n'
        "`Config.check()`, `Config.gone`, `Missing`, vLLM's `Outside`, `SiluAndMul`, `Sub.limit`, `Sub.ratio`\n"
        "`engine/config.py` `Config.check`, `engine/config.py` (`DEFAULT`), `engine/other.py` (`Sub`, `x`), `engine/config.py`\n"
        "  (`gone_next`)\n"
        "`engine/config.py`: `Config`, `engine/config.py`: `gone_colon`, `engine/config.py` (`Config`, `DEFAULT`, `gone_listed`;"
        " `gone_prose`)\n"
        'docs/a.md §1 "Data parallel", docs/a.md §1 "Elsewhere", docs/a.md §3 "Elsewhere", a.md §3, a.md §4\n')
    (tmp_path / "docs" / "a.md").write_text(
        "## 1. Process\n### Data parallel\n```\n## 2. In code\n```\n**Fixed-order reductions** (the default)\n"
        "tpguide.engine.config.Config.check, tpguide.engine.other.Config.limit, tpguide.C.check, "
        "tpguide.engine.config.os.path, tpguide.engine.config.Config.ratio, tpguide.engine.config.Config.ratio.real\n"
        "`tpguide/engine/gone.py` and tpguide.engine.config.Config.gone; `engine/gone.py` (nano-vllm's "
        "``layers/linear.py``)\n"
        "tpguide.engine.missing, tpguide.engine.config.DEFAULT.limit, tpguide.engine.other.DEFAULT\n"
        "## 3. Other\n### Elsewhere\n")
    (pkg / "driver.py").write_text('"""See :class:`tpguide.engine.config.Gone`."""\nx = "tpguide.not.checked"  # '
                                   'tpguide.engine.other.Config.nope\n'
                                   'import asyncio\ndef run(limit):\n    """:func:`run`, :attr:`limit`, :class:`asyncio.Queue`, '
                                   ':class:`other.Config`, :meth:`~Config.check`, :func:`gone_role`, :data:`other.GONE`."""\n')
    assert name_exists("tpguide.engine.other.Config.check", tmp_path)
    assert [b for p in pages(tmp_path) for b in broken_references(p, tmp_path)] == [
        "README.md:3: section 'docs/a.md §2' does not exist",
        "README.md:3: section 'docs/a.md \"Gone\"' does not exist",
        "README.md:3: section 'docs/gone.md' does not exist",
        "README.md:4: class name 'Config.gone' does not exist",
        "README.md:4: class name 'Missing' does not exist",
        "README.md:5: name in file 'engine/other.py Sub' does not exist",
        "README.md:5: name in file 'engine/other.py x' does not exist",
        "README.md:5: name in file 'engine/config.py gone_next' does not exist",
        "README.md:7: name in file 'engine/config.py gone_colon' does not exist",
        "README.md:7: name in file 'engine/config.py gone_listed' does not exist",
        "README.md:8: section 'docs/a.md §1 \"Elsewhere\"' does not exist",  # a title of another section
        "README.md:8: section 'docs/a.md §4' does not exist",
        "docs/a.md:7: name 'tpguide.engine.config.Config.ratio.real' does not exist",
        "docs/a.md:8: path 'tpguide/engine/gone.py' does not exist",
        "docs/a.md:8: name 'tpguide.engine.config.Config.gone' does not exist",
        "docs/a.md:8: relative path 'engine/gone.py' does not exist",
        "docs/a.md:9: name 'tpguide.engine.missing' does not exist",
        "docs/a.md:9: name 'tpguide.engine.config.DEFAULT.limit' does not exist",
        "docs/a.md:9: name 'tpguide.engine.other.DEFAULT' does not exist",  # imported there, not exported
        "tpguide/engine/driver.py:1: name 'tpguide.engine.config.Gone' does not exist",
        "tpguide/engine/driver.py:5: short role 'gone_role' does not exist",
        "tpguide/engine/driver.py:5: short role 'other.GONE' does not exist",
        "tpguide/engine/driver.py:2: name 'tpguide.engine.other.Config.nope' does not exist",  # comments last
    ]
