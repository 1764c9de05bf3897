"""Every relative link in README.md and docs/ reaches a file, and every `#anchor` a heading (by
GitHub's anchor rules) or an `<a id>` of the target page; README maps every page of docs/."""

from __future__ import annotations

import functools
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


# ------------------------------------------------------------ named tests and committed results

_REF = re.compile(
    r"(?P<file>tests/[\w/*]+\.py)(?:::(?P<test>\w+))?"  # tests/x.py, tests/x.py::test_y
    r"|(?<![\w/])::(?P<more>\w+)"  # ::test_z: another test of the file named last
    r"|(?P<result>benchmarks/results/[\w/*.-]+\.(?:json|png))"
)
# Files a tool writes when run (not committed results): named as outputs, not as evidence.
# written by the first runs on GPU nodes: benchmarks/gpu_smoke.py, and benchmarks/gpu_transfer.py
# on two nodes (scripts/gpu_smoke_two_nodes.sbatch)
WRITTEN_WHEN_RUN = {"benchmarks/results/gpu_smoke.json", "benchmarks/results/gpu_transfer.json"}


@functools.cache
def _defined(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def missing_references(text: str, repo: Path = REPO) -> list[str]:
    """Named tests (`tests/f.py::name`, or `::name` after a file) that do not exist, and
    benchmark results that are not in the tree."""
    problems, last = [], None
    for m in _REF.finditer(text):
        if m["result"]:
            if m["result"] not in WRITTEN_WHEN_RUN and not list(repo.glob(m["result"])):
                problems.append(f"no committed result {m['result']}")
        elif m["file"]:
            files = sorted(repo.glob(m["file"]))
            last = files[0] if len(files) == 1 else None
            if not files:
                problems.append(f"no test file {m['file']}")
            elif m["test"] and not any(m["test"] in _defined(f) for f in files):
                problems.append(f"no test {m['file']}::{m['test']}")
        elif last is None:
            problems.append(f"::{m['more']} follows no single test file")
        elif m["more"] not in _defined(last):
            problems.append(f"no test {last.relative_to(repo)}::{m['more']}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_test_and_result_exists(page):
    """A claim backed by a test or a result names one that exists (renamed tests break this)."""
    assert missing_references(page.read_text()) == []


def test_the_reference_check_finds_a_missing_test():
    text = (
        "`tests/test_docs_links.py::test_readme_is_short`, `::test_no_such_test`; "
        "`benchmarks/results/host_gap.json`, `benchmarks/results/nothing.json`"
    )
    assert missing_references(text) == [
        "no test tests/test_docs_links.py::test_no_such_test",
        "no committed result benchmarks/results/nothing.json",
    ]
