"""Every relative link in README.md and docs/ reaches a file, and every `#anchor` a heading (by
GitHub's anchor rules) or an `<a id>` of the target page; README maps every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def prose(text: str) -> str:
    """The text without fenced code blocks (links and headings there are not links or headings)."""
    return _FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (code marks and link targets dropped),
    lower case, every character but letters, digits, `_`, `-` and spaces dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' (duplicates numbered -1, -2, ... as GitHub does)
    and its explicit `<a id=...>` / `<a name=...>`."""
    found, seen = set(), {}
    body = prose(text)
    for m in _HEADING.finditer(body):
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found |= set(_HTML_ID.findall(body))
    return found


def links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans."""
    return _LINK.findall(_CODE_SPAN.sub("", prose(text)))


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(REPO)}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            problems.append(f"{target}: no heading or <a id> '{fragment}' in {dest.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert len(PAGES) > 10  # README and the docs/ pages are all found
    assert broken_links(page) == []


def test_readme_maps_every_docs_page():
    readme = REPO / "README.md"
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(readme.read_text())}
    missing = [str(p.relative_to(REPO)) for p in PAGES[1:] if p not in linked]
    assert missing == []


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_anchor_rules_match_githubs():
    """GitHub's rule (github-slugger: the rendered text in lower case, punctuation but `-` and `_`
    dropped, each space a hyphen, so " -m" gives "--m"); code blocks hold no headings or links."""
    assert github_anchor("Planning a run (`python -m MaxText.plan`)") == (
        "planning-a-run-python--m-maxtextplan"
    )
    assert github_anchor("Engine options") == "engine-options"
    assert github_anchor("Differences (choices, documented)") == "differences-choices-documented"
    assert github_anchor("First run on a node: `python benchmarks/gpu_smoke.py`") == (
        "first-run-on-a-node-python-benchmarksgpu_smokepy"
    )
    text = '# A\n\n## B b\n\n```\n# not a heading\n```\n\n## B b\n\n<a id="k"></a>\n'
    assert anchors(text) == {"a", "b-b", "b-b-1", "k"}
    assert links("[x](a.md#b) `[y](c.md)`\n```\n[z](d.md)\n```\n") == ["a.md#b"]


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    """A wrong anchor and a missing file are both reported."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [bad](#nope) [gone](b.md)\n")
    assert broken_links(tmp_path / "a.md") == [
        "#nope: no heading or <a id> 'nope' in a.md",
        "b.md: no file b.md",
    ]
