"""Every link and image in README.md and docs/**/*.md resolves inside the repository,
so a fresh clone reads whole (the README once pointed at a design page that lived
beside the repository, not in it). Every page under docs/ is reachable from
docs/index.md through relative links. And every cited section exists, not only its
page: an anchor `[text](page.md#anchor)` is the GitHub slug of one of that page's
headings, and a citation `page.md, "Section title"` (or `page.md "Section title"`,
`README, "Section title"`), in the pages and in the code's comments alike, names a
heading of that page (the README once lost sections that pages still cited)."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
INDEX = DOCS / "index.md"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]

# [text](target) and ![alt](target), with an optional "title"; <img src="...">.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\s[^>]*(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
# A path in backticks that climbs out of the page's folder: `../shared/ARCHITECTURE.md`.
CODE_PATH_UP = re.compile(r"`(\.\./[^`\s]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
# `docs/x.md, "Title"`, `x.md "Title"`, `README ("Title")`. A quoted phrase whose first word
# is all lower case ("the batch estimate") quotes the page's words, not a heading: not checked.
CITATION = re.compile(r"(?<![\w/.-])(README(?:\.md)?|[\w./-]*[\w-]\.md)(?:,[ \t]*|[ \t]+)\(?\"([^\"\s][^\"]{0,120})\"")
# Files whose comments and docstrings cite pages; folders that are not the project's.
CITING_SUFFIXES = {".py", ".toml", ".yml", ".yaml", ".j2", ".ini", ".cfg", ".service", ".sh", ".md"}
CITING_NAMES = {"Makefile", "run"}
NOT_OURS = {"runs", "node_modules", "__pycache__"}


def links(page: Path) -> list[str]:
    """Every relative link target of a page, `#anchor` ones included; none from code blocks."""
    text = FENCE.sub("", page.read_text())  # code blocks show commands, not links
    found = MARKDOWN_LINK.findall(text) + HTML_SRC.findall(text) + CODE_PATH_UP.findall(text)
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def targets(page: Path) -> list[str]:
    return [t for t in links(page) if not t.startswith("#")]


def plain(heading: str) -> str:
    """A heading's text as GitHub shows it: no backticks, emphasis, link targets or tags."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("**", "").replace("*", "").strip()


def headings(page: Path) -> list[str]:
    return [plain(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))]


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for h in headings(page):
        s = slug(h)
        out.add(s if not seen[s] else f"{s}-{seen[s]}")
        seen[s] += 1
    return out


def names_a_heading(title: str, page: Path) -> bool:
    """The title is a heading of the page, or a heading's part before ': ', ' (' or ' — '."""
    want = " ".join(plain(title).split()).casefold()
    for h in headings(page):
        h = " ".join(h.split()).casefold()
        if want in {h, h.split(": ")[0], h.split(" (")[0], h.split(" — ")[0]}:
            return True
    return False


def resolve(name: str, citing: Path, root: Path) -> Path | None:
    """A cited page: beside the citing file, else from the repository's root."""
    name = "README.md" if name == "README" else name
    for base in (citing.parent, root):
        path = (base / name).resolve()
        if path.is_file():
            return path
    return None


def citation_problems(path: Path, root: Path = REPO) -> list[str]:
    text = path.read_text()
    if path.suffix == ".md":
        text = FENCE.sub("", text)
    # a citation may wrap: join the lines, less any comment marks that start them
    text = re.sub(r"[ \t]*\n[ \t]*(?:#+|//|;+)?[ \t]*", " ", text)
    bad = []
    for name, title in CITATION.findall(text):
        if not re.search(r"[A-Z0-9`]", title.split()[0]):
            continue
        page = resolve(name, path, root)
        if page is None:
            bad.append(f'{name}, "{title}": no such page')
        elif not names_a_heading(title, page):
            bad.append(f'{name}, "{title}": no such heading in {os.path.relpath(page, root)}')
    return bad


def anchor_problems(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        if not anchor:
            continue
        linked = (page.parent / path).resolve() if path else page
        if linked.suffix == ".md" and linked.is_file() and anchor not in anchors(linked):
            bad.append(f"{target}: no heading has the anchor #{anchor}")
    return bad


def unreachable(index: Path) -> list[Path]:
    """The pages under index's folder that no chain of relative links from index reaches."""
    docs = index.parent.resolve()
    seen, todo = {index.resolve()}, [index.resolve()]
    while todo:
        page = todo.pop()
        for target in targets(page):
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if path.suffix == ".md" and path.is_file() and path.is_relative_to(docs) and path not in seen:
                seen.add(path)
                todo.append(path)
    return sorted(p for p in docs.rglob("*.md") if p.resolve() not in seen)


def citing_files(root: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_OURS and not d.endswith(".egg-info")
                         and (not d.startswith(".") or d == ".ci"))
        found += [Path(folder) / f for f in sorted(files)
                  if Path(f).suffix in CITING_SUFFIXES or f in CITING_NAMES]
    return [p for p in found if p.resolve() != Path(__file__).resolve()]


def test_the_pages_are_found():
    assert (REPO / "README.md") in PAGES and INDEX in PAGES
    assert (DOCS / "design" / "architecture.md") in PAGES and (DOCS / "results" / "drops.md") in PAGES


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves_inside_the_repository(page):
    bad = []
    for target in targets(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO):
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_anchor_is_a_heading_of_its_page(page):
    bad = anchor_problems(page)
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


def test_every_page_under_docs_is_reachable_from_the_index():
    orphans = [str(p.relative_to(REPO)) for p in unreachable(INDEX)]
    assert not orphans, f"not reachable from docs/index.md: {orphans}"


def test_every_cited_section_is_a_heading_of_its_page():
    bad = [f"{p.relative_to(REPO)}: {b}" for p in citing_files(REPO) for b in citation_problems(p)]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_what_it_must(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('see [a](docs/a.md), ![plot](img/x.png "t"), [web](https://x.org), [top](#top),\n'
                    '<img src="b.png">, the design in `../shared/ARCHITECTURE.md`\n'
                    "```\n[not](a-link.md)\n```\n")
    assert targets(page) == ["docs/a.md", "img/x.png", "b.png", "../shared/ARCHITECTURE.md"]


def test_the_section_checker_sees_what_it_must(tmp_path):
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# Front door\n\n## Two commands\n")
    (docs / "guide" / "a.md").write_text(
        "# A page\n\n## Shipped models\n\n### `ppo_clip` (default): PPO's clipped surrogate\n\n"
        '## A sandboxed task (`[task.env] kind = "tool_use"`)\n\n## Notes\n\n## Notes\n\n'
        "```\n# not a heading\n```\n")
    assert slug("Results (2 cores, measured on this kind of machine)") == \
        "results-2-cores-measured-on-this-kind-of-machine"
    assert anchors(docs / "guide" / "a.md") == {
        "a-page", "shipped-models", "ppo_clip-default-ppos-clipped-surrogate",
        "a-sandboxed-task-taskenv-kind--tool_use", "notes", "notes-1"}
    citing = docs / "b.md"
    citing.write_text(
        '# B\n\nAs (docs/guide/a.md, "Shipped models") and guide/a.md "`ppo_clip` (default)" say, and\n'
        '(README, "Two commands"); docs/guide/a.md,\n"Shiped models" is a typo, (README, "Results")\n'
        'a section that went, README "vLLM engine" one that never was, docs/guide/a.md "" nothing;\n'
        'and docs/gone.md "Anything" a page that went; docs/guide/a.md, "the words"\n'
        "quotes a phrase. [ok](guide/a.md#shipped-models) [ok](guide/a.md#notes-1) [ok](#b)\n"
        "[bad](guide/a.md#shipped) [bad](#a-page)\n"
        "```\ndocs/guide/a.md, \"Not checked in a code block\"\n```\n")
    assert citation_problems(citing, tmp_path) == [
        'docs/guide/a.md, "Shiped models": no such heading in docs/guide/a.md',
        'README, "Results": no such heading in README.md',
        'README, "vLLM engine": no such heading in README.md',
        'docs/gone.md, "Anything": no such page']
    code = tmp_path / "x.py"
    code.write_text('# the service (docs/guide/a.md,\n# "Shipped models"); docs/guide/a.md "Gone" is not\n')
    assert citation_problems(code, tmp_path) == ['docs/guide/a.md, "Gone": no such heading in docs/guide/a.md']
    assert anchor_problems(citing) == ["guide/a.md#shipped: no heading has the anchor #shipped",
                                      "#a-page: no heading has the anchor #a-page"]
    (docs / "index.md").write_text("[b](b.md)\n")
    (docs / "guide" / "orphan.md").write_text("# Nobody links here\n")
    assert unreachable(docs / "index.md") == [docs / "guide" / "orphan.md"]
