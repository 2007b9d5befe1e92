"""The dynamic filtering schedule in the spec: bad combinations are refused with the key,
the reason and the value, by parse_spec and by `rlfleet job validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.spec.job import load_spec
from tests.integration.helpers import TINY_MODEL, spec_errors

BASE = f"""\
[job]
name = "f"
[model]
path = "{TINY_MODEL}"
[task.env]
kind = "arithmetic"
"""


def errors(tmp_path: Path, text: str) -> list[str]:
    return spec_errors(tmp_path / "f.toml", BASE + text)


def test_the_schedules_that_validate(tmp_path):
    for text in ("[trainer]\nno_signal_drops_per_batch = 2\n",
                 "[trainer]\nno_signal_drops_per_batch = 2\nmax_extra_prompts = 16\n",
                 "[trainer]\nno_signal_drops_per_batch = 2\nfilter_schedule = \"after_batch\"\n"):
        (tmp_path / "ok.toml").write_text(BASE + text)
        spec = load_spec(tmp_path / "ok.toml")
        assert spec.trainer.no_signal_drops_per_batch == 2
    assert spec.trainer.filter_schedule == "after_batch" and spec.trainer.max_extra_prompts is None


@pytest.mark.parametrize("text, expected", [
    ("[trainer]\nfilter_schedule = \"after_batch\"\n",
     "trainer.filter_schedule: 'after_batch' filters each round once it is complete, but "
     "no_signal_drops_per_batch = 0 turns filtering off: set it > 0, or remove filter_schedule"),
    ("[trainer]\nno_signal_drops_per_batch = 1\nfilter_schedule = \"after_batch\"\nmax_extra_prompts = 4\n",
     "trainer.max_extra_prompts: bounds the 'queue' schedule's extra claims; 'after_batch' claims rounds of "
     "exactly batch_size/group_size prompts: remove max_extra_prompts (got 4) or use 'queue'"),
    ("[trainer]\nno_signal_drops_per_batch = 2\n[rollout]\nmode = \"sync\"\n",
     "trainer.no_signal_drops_per_batch: dynamic filtering needs rollout.mode 'trajectory' or 'partial': "
     "mode 'sync' makes batch k of its own prompts only, so a dropped group is never replaced and the "
     "step waits forever (got 2)"),
    ("[trainer]\nmax_extra_prompts = 8\n[env_host]\npace_claims = false\n",
     "trainer.max_extra_prompts: is enforced by the claim pacer, which env_host.pace_claims = false turns "
     "off: set pace_claims = true or remove max_extra_prompts (got 8)"),
    ("[trainer]\nfilter_schedule = \"later\"\n",
     "trainer.filter_schedule: must be one of 'queue', 'after_batch', got 'later'"),
])
def test_bad_combinations_are_refused_precisely(tmp_path, text, expected):
    assert errors(tmp_path, text) == [expected]


def test_validate_command_refuses_filtering_under_a_barrier(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BASE + "[trainer]\nno_signal_drops_per_batch = 2\n[rollout]\nmode = \"one_step_off\"\n")
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "job", "validate", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.startswith(f"{path}: trainer.no_signal_drops_per_batch: dynamic filtering needs "
                                  "rollout.mode 'trajectory' or 'partial': mode 'one_step_off'"), done.stderr
