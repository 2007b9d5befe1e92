"""The pacing benchmark's spec copies: the same job with env_host.pace_claims forced."""

from __future__ import annotations

import shutil
from pathlib import Path

from rlfleet.common.spec.job import load_spec
from rlfleet.tools.bench.pacing import spec_with

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_spec_copies_differ_only_in_pace_claims(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "models").symlink_to(EXAMPLES.parent / "models")  # the examples' ../models
    for name in ("arithmetic.toml", "frozenlake.toml"):  # with and without an [env_host] pace_claims line
        original = tmp_path / "examples" / name
        shutil.copy(EXAMPLES / name, original)
        base = load_spec(original)
        for pace in (True, False):
            copy = spec_with(original, pace)
            spec = load_spec(copy)
            assert copy.parent == original.parent and copy.name.startswith(".")
            assert spec.env_host.pace_claims is pace
            assert spec.model_copy(update={"env_host": base.env_host}) == base
            copy.unlink()
