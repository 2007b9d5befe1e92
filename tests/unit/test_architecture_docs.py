"""docs/design/architecture.md's table of seams names the kinds that are registered."""

from __future__ import annotations

import re
from pathlib import Path

from rlfleet.common.spec.seams import SEAMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "architecture.md"


def documented_kinds() -> dict[str, set[str]]:
    text = DOC.read_text()
    section = text[text.index("## Seams"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| ([a-z -]+) \| `\[[a-z_.]+\]` \| ([^|]+) \|", section, re.MULTILINE)
    return {seam.strip(): set(re.findall(r"`([a-z_]+)`", kinds)) for seam, kinds in rows}


def test_the_seams_table_names_every_registered_kind():
    documented = documented_kinds()
    registered = {r.seam: set(r.names()) for r in SEAMS}
    assert documented == registered
    assert len(documented) == len(SEAMS) == 8
