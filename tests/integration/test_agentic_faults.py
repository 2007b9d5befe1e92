"""Redundant rollouts and dynamic filtering on the simulated fleet, with real processes
(`rlfleet run`, etcd, every daemon), across kill -9 of the env-host: the batch env mode
with redundant prompts and samples, simulated environment latency and failures, groups
without signal filtered. Every claimed prompt ends trained or dropped with its reason —
``redundant`` and ``no_signal`` among them — and none is lost (docs/guide/agentic.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import members_from

from .helpers import SIM_HEAD, TINY_MODEL, sim_backend, sim_lengths, wait_for
from .test_longtail_sim import finish, run_dir_of, steps

needs_model = pytest.mark.skipif(not (TINY_MODEL / "config.json").exists(), reason="models/tiny-qwen2 not built")

JOB = SIM_HEAD + """\
[task]
group_size = 4
max_turns = 2

[task.env]
kind = "sim"
max_new_tokens = 256
step_latency_mean_s = 2.0
step_latency_std_s = 2.0
failure_rate = 0.05
zero_variance_share = 0.3
time_scale = 0.05

[trainer]
batch_size = 16
max_steps = 100000
checkpoint_every = 5
no_signal_drops_per_batch = 1

""" + sim_backend(time_scale=0.05, fixed_s=2.0) + """\
[rollout.engine]
kind = "sim"
rollouts = 4
time_scale = 0.05
max_batch = 16
roofline_batch = 16

""" + sim_lengths(median=40, p99=200) + """\
[env_host]
env_mode = "batch"
redundant_samples = 2
redundant_prompts = 2
max_concurrent = 36        # one round: (16 / 4 + 2) prompts x (4 + 2) trajectories
turn_timeout_s = 30

[repack_manager.planner]
kind = "none"
"""


def _env_host(store: EtcdStore, job: str):
    keys = JobKeys(job)
    return next(iter(members_from(keys, store.get_prefix(keys.role_members_prefix("env-host")))), None)


@needs_model
def test_redundant_and_filtered_work_is_accounted_across_kill_9_of_the_env_host(tmp_path, etcd):
    job = "agenticfaults"
    spec = tmp_path / f"{job}.toml"
    spec.write_text(JOB.format(job=job, runs=tmp_path / "runs", model=TINY_MODEL))
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
                             "--etcd", etcd.endpoints_arg, "--duration", "150"],  # a bound: stopped below
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = EtcdStore(etcd.endpoints_arg)
    try:
        run_dir = run_dir_of(tmp_path, job)
        for _ in range(2):  # two kills
            trained = len(steps(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
            wait_for("two training steps", lambda: (run_dir / "metrics.jsonl").exists()
                     and len(steps(run_dir)) >= trained + 2, 60)
            victim = wait_for("the env-host registered", lambda: _env_host(store, job), 30)
            os.kill(victim.pid, signal.SIGKILL)  # mid-round: spares, cancellations in flight
            wait_for("a new env-host", lambda: (m := _env_host(store, job)) and m.pid != victim.pid, 60)
        trained = len(steps(run_dir))
        wait_for("two more training steps", lambda: len(steps(run_dir)) >= trained + 2, 60)
        # What the accounting is asserted to hold below, seen in the trainer's totals first.
        wait_for("redundant and no_signal drops", lambda: all(
            (steps(run_dir)[-1].get("dropped") or {}).get(reason, 0) > 0 for reason in ("redundant", "no_signal")), 90)
    finally:
        store.close()
        proc.send_signal(signal.SIGTERM)
    run_dir, out = finish(proc)  # exit 7 (stopped by SIGTERM) with the invariant held
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["dropped"].get("redundant", 0) > 0, accounting  # rounds closed early
    assert accounting["dropped"].get("no_signal", 0) > 0, accounting  # groups filtered
    assert accounting["trained"] >= 4 * 16 // 4, accounting
