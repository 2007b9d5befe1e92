"""docs/design/architecture.md's table of seams names the kinds that are registered."""

from __future__ import annotations

import re

from rlfleet.common.spec.seams import SEAMS
from tests.docs import section


def documented_kinds() -> dict[str, set[str]]:
    rows = re.findall(r"^\| ([a-z -]+) \| `\[[a-z_.]+\]` \| ([^|]+) \|", section("design/architecture.md", "Seams"),
                      re.MULTILINE)
    return {seam.strip(): set(re.findall(r"`([a-z_]+)`", kinds)) for seam, kinds in rows}


def test_the_seams_table_names_every_registered_kind():
    documented = documented_kinds()
    registered = {r.seam: set(r.names()) for r in SEAMS}
    assert documented == registered
    assert len(documented) == len(SEAMS) == 8
