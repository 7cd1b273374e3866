"""Every relative link in README.md and docs/*.md resolves (file and GitHub #anchor), and the README stays a front door."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 12 * 1024

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str):
    """(line number, line) of a Markdown page's lines outside fenced code blocks."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    """Every ``#anchor`` a page has, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict = {}
    out = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path):
    """(line number, target) of every relative link in a page's prose (not in code)."""
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield number, target


def broken_links(page: Path, root: Path = ROOT) -> list:
    """The relative links of ``page`` whose file or ``#anchor`` does not exist, as messages."""
    broken = []
    for number, target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target!r}"
        if not dest.exists():
            broken.append(f"{where}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_readme_is_a_front_door():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail into docs/"


def test_the_checker_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title `x`, y!\n## Two\n## Two\n```\n[in code](nowhere.md)\n```\n"
                                   "[ok](a.md#title-x-y) [ok2](#two-1) [file](gone.md) [anchor](a.md#three) "
                                   "[web](https://example.com) `[code](no.md)`\n")
    found = broken_links(tmp_path / "a.md", root=tmp_path)
    assert len(found) == 2 and "gone.md" in found[0] and "#three" in found[1], found
