"""The simulated fleet under faults, with real processes (`rlfleet run`, etcd, every daemon):
two sim rollout processes of 4 simulated rollouts each, repack on (Laminar Algorithm 1),
the sim trainer. kill -9 of the repack-manager mid-plan (a failpoint, once) and of a
whole sim rollout process while repacks move generations between them: the accounting
invariant holds (the run exits 7, not 4) and no trajectory mixes versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import members_from
from rlfleet.tools.exit_codes import Exit

from .helpers import SIM_HEAD, TINY_MODEL, one_host, sim_backend, sim_lengths, wait_for

needs_model = pytest.mark.skipif(not (TINY_MODEL / "config.json").exists(), reason="models/tiny-qwen2 not built")

SIM_JOB = SIM_HEAD + """\
[task]
group_size = 4

[task.env]
kind = "sim"
max_new_tokens = 2048

[trainer]
batch_size = 16
max_steps = 100000
max_staleness = 4
checkpoint_every = 5

""" + sim_backend(time_scale=0.1, fixed_s=30.0) + """\
# the trainer: a 3 s step (fixed_s x time_scale), so versions outlive a few stats polls
[rollout]
mode = "{mode}"

[rollout.engine]
kind = "sim"
rollouts = 4
time_scale = 0.3
max_batch = 4
roofline_batch = 4

""" + sim_lengths(median=300, p99=3000) + """\
[env_host]
max_concurrent = 16        # half the 32 slots: rollouts run part-full, so repacks happen (the env-host keeps
                           # max_concurrent trajectories running, docs/guide/agentic.md)
turn_timeout_s = 30

[repack_manager.planner]
kind = "{planner}"{planner_keys}

""" + one_host(2)


def start(tmp_path: Path, etcd, job: str, *, mode: str = "trajectory", planner: str = "laminar",
          duration_s: int = 45, env: dict[str, str] | None = None) -> subprocess.Popen:
    spec = tmp_path / f"{job}.toml"
    spec.write_text(SIM_JOB.format(job=job, runs=tmp_path / "runs", model=TINY_MODEL, mode=mode,
                                   planner=planner,
                                   planner_keys="\ninterval_s = 2.0" if planner == "laminar" else ""))
    return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
                             "--etcd", etcd.endpoints_arg, "--duration", str(duration_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen) -> tuple[Path, str]:
    out, err = proc.communicate(timeout=240)
    assert out.startswith("run dir: "), out[-2000:] + err[-3000:]
    run_dir = Path(out.splitlines()[0].removeprefix("run dir: "))
    assert proc.returncode == Exit.STOPPED, out[-3000:] + err[-3000:]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["ok"] and not accounting["lost"], accounting
    return run_dir, out


def finish_when(proc: subprocess.Popen, what: str, evidence, timeout_s: float) -> tuple[Path, str]:
    """Stop the run (SIGTERM, exit 7) once ``evidence()`` holds, or let its --duration end
    it; then ``finish`` it. The tests' --duration is a bound, not the time they take."""
    try:
        wait_for(what, lambda: proc.poll() is not None or evidence(), timeout_s)
    finally:
        proc.send_signal(signal.SIGTERM)
    return finish(proc)


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"step"' in line and '"trajectories"' in line]


def rollouts(store: EtcdStore, job: str) -> list:
    keys = JobKeys(job)
    return members_from(keys, store.get_prefix(keys.role_members_prefix("rollout")))


def run_dir_of(tmp_path: Path, job: str) -> Path:
    return wait_for("the run dir", lambda: next((tmp_path / "runs" / job).glob("*/"), None), 30)


@needs_model
def test_repack_manager_and_a_sim_rollout_process_killed_mid_migration_lose_nothing(tmp_path, etcd):
    job = "simfaults"
    # --duration is a bound: the test stops the run (SIGTERM, exit 7) once the evidence is in.
    proc = start(tmp_path, etcd, job, duration_s=150, env={"RLFLEET_REPACK_FAILPOINT": "kill_mid_plan"})
    store = EtcdStore(etcd.endpoints_arg)
    try:
        run_dir = run_dir_of(tmp_path, job)
        # 8 simulated rollouts (4 per process) and the two hosts, all registered.
        wait_for("8 simulated rollouts", lambda: len([m for m in rollouts(store, job)
                                                      if m.address("requests")]) == 8, 60)
        # The failpoint fired (SIGKILL mid-plan); the restarted repack-manager re-sent it.
        wait_for("a plan resumed by the next leader", lambda: any(
            json.loads(line).get("resumed") for line in (run_dir / "repack_plans.jsonl").read_text().splitlines())
            if (run_dir / "repack_plans.jsonl").exists() else False, 60)
        # Right after (continuations of the moved generations in flight), kill -9 a whole
        # sim rollout process: a machine failure for its 4 rollouts.
        host = next(m for m in rollouts(store, job) if not m.address("requests"))
        os.kill(host.pid, signal.SIGKILL)
        wait_for("its 4 rollouts gone and back", lambda: len(
            [m for m in rollouts(store, job) if m.address("requests") and m.pid != host.pid]) == 8, 60)
        trained = len(steps(run_dir))
        wait_for("2 more training steps", lambda: len(steps(run_dir)) >= trained + 2, 40)
        wait_for("a plan that moved generations", lambda: any(  # asserted below, from the same file
            o.get("moved", 0) > 0 for line in (run_dir / "repack_plans.jsonl").read_text().splitlines()
            for o in json.loads(line)["outcomes"]), 60)
    finally:
        store.close()
        proc.send_signal(signal.SIGTERM)
    run_dir, _ = finish(proc)
    lines = steps(run_dir)
    assert sum(m["mixed_version"] for m in lines) == 0  # outside `partial`, never
    plans = [json.loads(line) for line in (run_dir / "repack_plans.jsonl").read_text().splitlines()]
    assert any(o.get("moved", 0) > 0 for p in plans for o in p["outcomes"])  # generations did move
    assert (run_dir / "repack-failpoint-fired").exists()


def steps_of_a_short_run(tmp_path, etcd, job: str, mode: str, enough) -> list[dict]:
    """The step lines of a run in rollout mode ``mode``, without repack, stopped (SIGTERM) once
    ``enough(step lines)`` holds, or by --duration after 60 s."""
    proc = start(tmp_path, etcd, job, mode=mode, planner="none", duration_s=60)
    run_dir, _ = finish_when(proc, f"enough steps in {mode} mode",
                             lambda: enough(steps(run_dir_of(tmp_path, job))), 90)
    return steps(run_dir)


@needs_model
def test_partial_mode_mixes_versions_within_a_turn_and_loses_nothing(tmp_path, etcd):
    lines = steps_of_a_short_run(tmp_path, etcd, "simpartial", "partial",
                                 lambda lines: len(lines) >= 3 and sum(m["mixed_version"] for m in lines) > 0)
    assert len(lines) >= 3
    assert sum(m["mixed_version"] for m in lines) > 0  # AReaL-style: segments of several versions


@needs_model
def test_sync_mode_trains_only_fresh_trajectories(tmp_path, etcd):
    lines = steps_of_a_short_run(tmp_path, etcd, "simsync", "sync", lambda lines: len(lines) >= 2)
    assert len(lines) >= 2
    assert all(set(m["staleness"]) == {"0"} for m in lines), [m["staleness"] for m in lines]
    assert sum(m["mixed_version"] for m in lines) == 0
