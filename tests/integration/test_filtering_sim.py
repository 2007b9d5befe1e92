"""Dynamic filtering on the simulated fleet, with real processes (`rlfleet run`, etcd,
every daemon): both schedules (docs/guide/agentic.md, "Queue scheduling and dynamic filtering")
train, groups without signal are dropped with the reason ``no_signal``, and the
accounting invariant holds. ``after_batch`` claims its prompts round by round (a claim
never crosses a round); ``queue`` replaces dropped prompts at once, never holding more
than the batch plus ``max_extra_prompts`` outstanding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import TINY_MODEL, one_host, sim_backend, sim_lengths
from .test_longtail_sim import finish_when, needs_model, run_dir_of, steps

P, EXTRA = 4, 3  # prompts per batch, the queue's extra prompts

FILTER_JOB = """\
[job]
name = "{job}"
runs_dir = "{runs}"

[model]
path = "{model}"

[task]
group_size = 4

[task.env]
kind = "sim"
max_new_tokens = 1024
zero_variance_share = 0.5  # half the groups carry no signal

[trainer]
batch_size = 16
max_steps = 100000
checkpoint_every = 5
no_signal_drops_per_batch = 4
filter_schedule = "{schedule}"{trainer_keys}

""" + sim_backend(time_scale=0.1, fixed_s=5.0) + """\
[rollout.engine]
kind = "sim"
rollouts = 4
time_scale = 0.1
max_batch = 8
roofline_batch = 8

""" + sim_lengths(median=200, p99=1000) + """\
[env_host]
max_concurrent = 64

[repack_manager.planner]
kind = "none"

""" + one_host()


def claims(run_dir: Path) -> list[tuple[int, int]]:
    out = []
    for line in (run_dir / "logs" / "env-host-0.log").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "claimed":
            out.append((rec["start"], rec["stop"]))
    return out


@needs_model
@pytest.mark.parametrize("schedule", ["after_batch", "queue"])
def test_both_schedules_train_and_drop_groups_without_signal(tmp_path, etcd, schedule):
    spec = tmp_path / f"{schedule}.toml"
    spec.write_text(FILTER_JOB.format(job=f"filter-{schedule.replace('_', '-')}", runs=tmp_path / "runs",
                                      model=TINY_MODEL, schedule=schedule,
                                      trainer_keys=f"\nmax_extra_prompts = {EXTRA}" if schedule == "queue" else ""))
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
                             "--etcd", etcd.endpoints_arg, "--duration", "90"],  # a bound: stopped below
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def evidence_in() -> bool:  # two steps, a group dropped without signal; in `queue`, a dropped prompt replaced
        run_dir = run_dir_of(tmp_path, f"filter-{schedule.replace('_', '-')}")
        lines = steps(run_dir)
        return (len(lines) >= 2 and (lines[-1].get("dropped") or {}).get("no_signal", 0) > 0
                and (schedule != "queue" or max(b for _, b in claims(run_dir)) > P + EXTRA))
    run_dir, _ = finish_when(proc, "two steps, a no_signal drop and, in queue, a replaced prompt", evidence_in, 120)
    # exits STOPPED; accounting.json ok, nothing lost
    trained = steps(run_dir)
    assert len(trained) >= 2, trained
    assert all(m["groups"] == P for m in trained)
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["dropped"].get("no_signal", 0) > 0, accounting
    assert accounting["claimed"] == (accounting["trained"] + accounting["dropped_total"]
                                     + accounting["in_flight"]), accounting
    ranges = claims(run_dir)
    assert ranges and ranges[0][0] == 0
    if schedule == "after_batch":
        # a claim never crosses a round: rounds are claimed one after the other
        assert all(a // P == (b - 1) // P for a, b in ranges), ranges
    else:
        # the first claim takes the batch and the extra prompts at once, no more
        assert ranges[0] == (0, P + EXTRA), ranges
        assert max(b for _, b in ranges) > P + EXTRA  # dropped prompts were replaced
