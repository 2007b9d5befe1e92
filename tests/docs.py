"""Reading the docs from tests that hold a page to the code (tables of seams, of edges)."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def section(page: str, heading: str) -> str:
    """The text of ``docs/<page>`` from its ``## <heading>`` line to the next ``## ``."""
    text = (DOCS / page).read_text()
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]
