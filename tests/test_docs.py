"""The README and docs/: every relative link resolves to a file or folder in the repository (and a
`#section` to a heading of the page it names), and the README stays a five-minute read."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_PAGES = [p for p in sorted(RESULTS.rglob("*.md")) if p not in PAGES]  # each run's own pages, archived ones too
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def links(page: pathlib.Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def resolved(page: pathlib.Path, target: str) -> pathlib.Path:
    path = target.partition("#")[0]
    return (page.parent / path).resolve() if path else page


def test_there_are_pages_and_links():
    assert {"methods.md", "benchmarks.md", "training.md", "gpu.md", "kernels.md", "design.md"} <= {
        p.name for p in PAGES}
    assert sum(len(links(p)) for p in PAGES) > 50  # the pattern finds them
    assert len(RUN_PAGES) > 100


# A run's page links its neighbours and the docs: moving runs into archive/ must leave none broken.
@pytest.mark.parametrize("page", PAGES + RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        anchor, to = target.partition("#")[2], resolved(page, target)
        if not to.exists() or not to.is_relative_to(ROOT):
            broken.append(target)
        elif anchor and to.suffix == ".md" and anchor not in anchors(to):
            broken.append(target)
    assert broken == []


def test_the_results_index_names_every_run_beside_it():
    # Current runs sit beside the index, which names each; every other run is in archive/.
    index = RESULTS / "README.md"
    named = {resolved(index, t).relative_to(RESULTS).parts[0] for t in links(index)
             if resolved(index, t).is_relative_to(RESULTS) and resolved(index, t) != index}
    assert sorted(p.name for p in RESULTS.iterdir() if p.name not in named | {"README.md", "archive"}) == []
    assert len(list((RESULTS / "archive").iterdir())) > 100


def test_the_anchor_rule_matches_github():
    page = ROOT / "docs" / "benchmarks.md"
    assert "ar-against-transformers" in anchors(page)  # from "## `ar` against transformers"


def test_the_readme_is_short_and_every_docs_page_is_reachable_from_it():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    assert lines.index("## Two commands") <= 25  # the table, how it was measured and links, then how to run it
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        for target in links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            if path.suffix == ".md" and path.parent == ROOT / "docs" and path not in reached:
                reached.add(path)
                todo.append(path)
    assert [p.name for p in PAGES if p.parent == ROOT / "docs" and p not in reached] == []


def test_every_method_option_the_command_line_takes_is_documented():
    # One declaration (s3djax.options) makes the flags and the Python keywords; the pages must name every flag.
    from s3djax import options

    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "methods.md").read_text()
    flags = [options.flag(f) for f in options.dataclasses.fields(options.Options)]
    assert len(flags) >= 13 and [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)] == []
