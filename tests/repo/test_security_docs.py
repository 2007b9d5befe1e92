"""docs/operations/security.md's table of role-to-socket edges says what common/wire/edges.py enforces."""

from __future__ import annotations

import re

from rlfleet.common.spec.placement import ROLES
from rlfleet.common.wire.edges import EDGES
from tests.docs import DOCS, section

DOC = DOCS / "operations" / "security.md"


def documented_edges() -> dict[str, frozenset[str]]:
    rows = re.findall(r"^\| `([a-z-]+)` \| [^|]+ \| ([^|]+) \|",
                      section("operations/security.md", "Roles: who may send to which socket"), re.MULTILINE)
    return {edge: frozenset(r.strip() for r in roles.split(",")) for edge, roles in rows}


def test_the_documented_table_is_the_enforced_one():
    documented = documented_edges()
    assert documented == EDGES
    assert all(roles <= set(ROLES) for roles in documented.values())
    forbidden = len(ROLES) * len(EDGES) - sum(len(r) for r in EDGES.values())
    assert f"{forbidden} of the {len(ROLES) * len(EDGES)} role × socket pairs" in DOC.read_text()
