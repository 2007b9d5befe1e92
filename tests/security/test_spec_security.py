"""The [security] section of the job spec (common/spec/job.py): what `rlfleet job validate` says."""

from __future__ import annotations

import pytest

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import parse_spec
from tests.integration.helpers import TINY_MODEL


def _spec(security: dict) -> dict:
    return {"job": {"name": "s"}, "model": {"path": str(TINY_MODEL)}, "task": {"env": {"kind": "arithmetic"}},
            "security": security}


def test_defaults_off_and_a_full_section_validates():
    assert parse_spec(_spec({})).security.curve is False
    sec = parse_spec(_spec({"curve": True, "curve_dir": "/etc/rlfleet/curve", "relay_auth": True,
                            "job_secret_file": "/etc/rlfleet/job.secret"})).security
    assert sec.curve and sec.relay_auth and sec.curve_dir == "/etc/rlfleet/curve"


@pytest.mark.parametrize("security, message", [
    ({"curve_dir": "/etc/k"}, "security: curve_dir is set but curve = false"),
    ({"relay_auth": False, "job_secret_file": "/etc/s"}, "security: job_secret_file is set but relay_auth = false"),
    ({"curve": True, "curve_dir": "keys"}, "security.curve_dir: must be an absolute path"),
    ({"curve": "yes"}, "security.curve:"),
    ({"curv": True}, "security.curv: unknown key"),
])
def test_mistakes_are_reported_with_their_key(security, message):
    with pytest.raises(SpecError) as err:
        parse_spec(_spec(security), source="job.toml")
    assert any(message in line for line in err.value.errors), err.value.errors
