"""Every link and image in README.md and docs/*.md resolves inside the repository,
so a fresh clone reads whole (the README once pointed at a design page that lived
beside the repository, not in it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# [text](target) and ![alt](target), with an optional "title"; <img src="...">.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\s[^>]*(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
# A path in backticks that climbs out of the page's folder: `../shared/ARCHITECTURE.md`.
CODE_PATH_UP = re.compile(r"`(\.\./[^`\s]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def targets(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # code blocks show commands, not links
    found = MARKDOWN_LINK.findall(text) + HTML_SRC.findall(text) + CODE_PATH_UP.findall(text)
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_pages_are_found():
    assert (REPO / "README.md") in PAGES and (REPO / "docs" / "architecture.md") in PAGES


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


def test_the_checker_sees_what_it_must(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('see [a](docs/a.md), ![plot](img/x.png "t"), [web](https://x.org), [top](#top),\n'
                    '<img src="b.png">, the design in `../shared/ARCHITECTURE.md`\n'
                    "```\n[not](a-link.md)\n```\n")
    assert targets(page) == ["docs/a.md", "img/x.png", "b.png", "../shared/ARCHITECTURE.md"]
