"""docs/operations/security.md's table of role-to-socket edges says what common/wire/edges.py enforces."""

from __future__ import annotations

import re
from pathlib import Path

from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire.edges import EDGES

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations" / "security.md"


def documented_edges() -> dict[str, frozenset[str]]:
    text = DOC.read_text()
    section = text[text.index("## Roles: who may send to which socket"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([a-z-]+)` \| [^|]+ \| ([^|]+) \|", section, re.MULTILINE)
    return {edge: frozenset(r.strip() for r in roles.split(",")) for edge, roles in rows}


def test_the_documented_table_is_the_enforced_one():
    documented = documented_edges()
    assert documented == EDGES
    assert all(roles <= set(ROLES) for roles in documented.values())
    forbidden = len(ROLES) * len(EDGES) - sum(len(r) for r in EDGES.values())
    assert f"{forbidden} of the {len(ROLES) * len(EDGES)} role × socket pairs" in DOC.read_text()
