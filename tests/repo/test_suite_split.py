"""The suite's split over xdist workers (tests/conftest.py, FLEET_MODULES): every module it
names exists, and every module that starts `rlfleet run` is named. A fleet left out would run
beside another one, on deadlines set for one fleet on the machine's two cores."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import FLEET_MODULES

ROOT = Path(__file__).resolve().parents[2]
# `rlfleet run` as the tests start it: helpers.rlfleet("run", ...) or [..., "rlfleet.tools.cli", "run", ...].
STARTS_A_RUN = re.compile(r'rlfleet\("run"|cli", "run"')


def test_every_named_fleet_module_exists():
    assert sorted(m for m in FLEET_MODULES if not (ROOT / m).is_file()) == []


def test_every_module_that_starts_a_run_is_a_fleet_module():
    starting = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                if p != Path(__file__) and STARTS_A_RUN.search(p.read_text())}
    assert len(starting) >= 10  # the pattern still finds the runs it was written for
    assert sorted(starting - FLEET_MODULES) == []
