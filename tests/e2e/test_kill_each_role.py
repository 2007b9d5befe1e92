"""End to end under faults: a real job (`rlfleet run`, all daemons, the shipped
tiny model) keeps training while each role in turn is killed with SIGKILL, and
afterwards every claimed prompt is trained, dropped with a reason, or in flight.
Claims are paced (trainer.max_staleness is set), so a killed trainer also stops
the claiming until it is back, and pacing must not wedge the job.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.placement import ROLES, SINGLETON_ROLES
from rlfleet.tools.exit_codes import Exit
from tests.integration.helpers import TINY_MODEL, rlfleet, small_job, stop, wait_for, write_spec

pytestmark = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

# max_staleness: and so env-hosts pace their claims by trainer/progress
SPEC = small_job(eval_size=16, eval_every_steps=1000, max_steps=100000, checkpoint_every=2,
                 trainer="learning_rate = 1e-3\nmax_staleness = 2\n",
                 env_host="turn_timeout_s = 10\ntrajectory_timeout_s = 30\n")


def train_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def last_step(run_dir: Path) -> int:
    lines = train_lines(run_dir)
    return lines[-1]["step"] if lines else 0


def member_of(store: EtcdStore, job: str, role: str) -> dict:
    """The member to kill: the leader for singleton roles, else the first."""
    keys = JobKeys(job)
    members = {kv.value["id"]: kv.value for kv in store.get_prefix(keys.role_members_prefix(role))}
    if role in SINGLETON_ROLES:
        leader = store.get(keys.leader(role))
        if leader is not None and leader.value["id"] in members:
            return members[leader.value["id"]]
    return members[sorted(members)[0]]


def test_kill_9_each_role_during_training(tmp_path, etcd):
    spec_path = write_spec(tmp_path, "faults", SPEC)
    log = tmp_path / "run.log"
    proc = rlfleet("run", str(spec_path), "--etcd", etcd.endpoints_arg, "--no-view", log=log)
    store = EtcdStore(etcd.endpoints)
    try:
        run_dir = Path(wait_for("the run dir line", lambda: next(
            (line.split("run dir:", 1)[1].strip() for line in log.read_text().splitlines()
             if line.startswith("run dir:")), None), timeout_s=30))
        wait_for("two training steps", lambda: last_step(run_dir) >= 2, timeout_s=240)

        for role in ROLES:
            victim = member_of(store, "faults", role)
            step_before = last_step(run_dir)
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(f"{role}/{victim['id']} to come back with a new pid", lambda: any(
                kv.value["pid"] != victim["pid"] and kv.value["state"] == "running"
                for kv in store.get_prefix(JobKeys("faults").role_members_prefix(role))
                if kv.value["id"] == victim["id"]), timeout_s=90)
            # The job keeps going: training advances after every kill.
            wait_for(f"training to advance after killing {role}",
                     lambda: last_step(run_dir) > step_before, timeout_s=180)
    finally:
        code = stop(proc, timeout_s=60)
    assert code == Exit.STOPPED, log.read_text()[-3000:]  # stopped by SIGTERM, accounting ok

    steps = [r["step"] for r in train_lines(run_dir)]
    # A restarted trainer resumes from its checkpoint and journal: versions never go back.
    assert steps == sorted(steps), steps
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["ok"], accounting
    assert accounting["lost_total"] == 0 and accounting["trained"] > 0
    assert accounting["claimed"] == (accounting["trained"] + accounting["dropped_total"]
                                     + accounting["in_flight"])

    # Where the machine's time went: each daemon's CPU seconds, summed over its restarts.
    cpu = json.loads((run_dir / "summary.json").read_text())["cpu_s"]
    daemons = {p.stem for p in (run_dir / "logs").glob("*.log")}
    assert daemons and daemons <= set(cpu), (daemons, cpu)
    assert min(cpu[d] for d in daemons if d.startswith(("trainer", "rollout"))) > 1.0, cpu
