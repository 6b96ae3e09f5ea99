"""The documentation site: its navigation holds the user documentation (the maintainers' dated measurements are
reached from one Benchmarks page, which links every one of them), and the first pages a reader opens show their
commands whole."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BENCHMARKS = REPO / "benchmarks"
# Characters of a code line the site shows in its content column at the theme's default width, sidebars open; a
# longer line is cut off at the right and has to be scrolled to.
CODE_WIDTH = 88
FRONT_PAGES = ("index.md", "getting-started.md")


def _nav_pages(node: object) -> list[str]:
    """Every page path the navigation lists, in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def _config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def test_the_navigation_lists_one_benchmarks_page_and_no_measurement():
    pages = _nav_pages(_config()["nav"])
    assert [p for p in pages if p.startswith("benchmarks/")] == ["benchmarks/README.md"]
    assert all((DOCS / p).is_file() for p in pages), [p for p in pages if not (DOCS / p).is_file()]
    # the measurements are left out of the navigation on purpose, which --strict would otherwise refuse
    assert "/benchmarks/*.md" in _config()["not_in_nav"].split()


def test_the_benchmarks_page_links_every_measurement():
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", (BENCHMARKS / "README.md").read_text(encoding="utf-8")))
    files = {p.name for p in BENCHMARKS.glob("*.md")} - {"README.md"}
    assert files and files <= linked, sorted(files - linked)


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(```+|~~~+)", line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = m.group(1)[:3] if fence is None else None
            continue
        if fence is not None:
            out.append((n, line))
    return out


def test_the_front_pages_code_fits_the_content_column():
    for name in FRONT_PAGES:
        long = [
            (n, len(line))
            for n, line in _code_lines((DOCS / name).read_text(encoding="utf-8"))
            if len(line) > CODE_WIDTH
        ]
        assert not long, f"{name}: code lines over {CODE_WIDTH} characters (line, length): {long}"


def test_code_lines_are_found_inside_fences_only():
    text = "prose " + "x" * 200 + "\n```bash\nshort\n" + "y" * 100 + "\n```\nafter\n"
    assert [(n, len(line)) for n, line in _code_lines(text)] == [(3, 5), (4, 100)]
