"""Maintenance mode with real processes (docs/operations/maintenance-mode.md): `rlfleet pause` on a
running `rlfleet run`, and a node agent (`rlfleet daemon agent`, process backend)
that observes only while the job is paused.

A kill -9 while paused stands for a daemon that crashed, or that an operator took
down for maintenance: it stays down until `rlfleet resume`, and the job still
finishes with the accounting invariant holding.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit

from .helpers import TINY_MODEL, agent_host_placement, rlfleet, stop, wait_for, write_spec

needs_model = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

MAX_IDLE_S = 40  # the run's no-progress watchdog (a busy 2-core machine took 24 s to a first step); the pause lasts longer
# Steps of the tiny model come in bursts of ~30/s once a backlog waits for the trainer, and
# the pause takes effect within a trainer cycle (lease_ttl_s / 3) after the command starts:
# dozens of steps may pass meanwhile, and many must remain after it.
MAX_STEPS = 200

RUN_JOB = """\
group_size = 4
eval_size = 8
eval_every_steps = 100

[trainer]
batch_size = 8
max_steps = {max_steps}
checkpoint_every = 1000

[env_host]
max_concurrent = 16
"""


def cli(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def member(store: EtcdStore, keys: JobKeys, role: str, member_id: str) -> dict | None:
    kv = store.get(keys.member(role, member_id))
    return kv.value if kv else None


def held_for(what: str, seconds: float, fn, timeout_s: float = 60.0) -> None:
    """fn() holds on every read for `seconds` in a row (reads every 0.2 s)."""
    since = [time.monotonic()]

    def steady() -> bool:
        if not fn():
            raise AssertionError(f"{what}: broke after {time.monotonic() - since[0]:.1f} s")
        return time.monotonic() - since[0] >= seconds
    wait_for(what, steady, timeout_s=timeout_s, every_s=0.2)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@needs_model
def test_pause_a_running_job_kill_a_daemon_resume_and_finish(tmp_path, etcd):
    spec = write_spec(tmp_path, job="maint", extra=RUN_JOB.format(max_steps=MAX_STEPS))
    keys, store = JobKeys("maint"), EtcdStore(etcd.endpoints)
    log = tmp_path / "run.log"
    run = rlfleet("run", str(spec), "--etcd", etcd.endpoints_arg, "--no-view", "--max-idle-s", str(MAX_IDLE_S),
                  log=log)
    try:
        def trained(steps: int) -> bool:
            assert run.poll() is None, f"the run ended (exit {run.returncode}): {log.read_text()[-3000:]}"
            return (member(store, keys, "trainer", "trainer-0") or {}).get("version", 0) >= steps
        wait_for("step 2", lambda: trained(2), timeout_s=240)
        paused = cli("pause", "--job", "maint", "--etcd", etcd.endpoints_arg, "--reason", "itest", "--timeout", "120")
        assert paused.returncode == Exit.OK, paused.stdout + paused.stderr + log.read_text()[-3000:]
        assert "job maint paused since " in paused.stdout and ": itest" in paused.stdout
        t = member(store, keys, "trainer", "trainer-0")
        assert t["paused"] is True and t["training"] == "paused" and t["version"] == t["checkpoint_version"]
        assert f"trainer trainer-0: paused at step {t['version']} (checkpoint version {t['version']})" in paused.stdout
        assert store.get(keys.trainer_checkpoint).value["version"] == t["version"]  # not due by checkpoint_every
        step = t["version"]
        assert 2 <= step < MAX_STEPS, f"paused at step {step}: the job must be mid-way for this test to mean much"
        paused_at = time.monotonic()

        # The trainer holds: its version and trainer/progress do not move.
        progress = store.get(keys.trainer_progress).value
        held_for("the trainer held at its step", 2.5, lambda: (
            member(store, keys, "trainer", "trainer-0")["version"] == step
            and store.get(keys.trainer_progress).value["version"] == progress["version"]))

        status = cli("status", "--job", "maint", "--etcd", etcd.endpoints_arg)
        assert status.stdout.startswith("PAUSED since "), status.stdout
        assert "by " in status.stdout.splitlines()[0] and ": itest — `rlfleet resume` to continue" in status.stdout
        state = json.loads(cli("status", "--job", "maint", "--etcd", etcd.endpoints_arg, "--output", "json").stdout)
        assert state["state"]["state"] == "paused" and state["state"]["reason"] == "itest"

        # kill -9 a daemon while paused: recorded, reported held, not restarted.
        rh = member(store, keys, "reward-host", "reward-host-0")
        os.kill(rh["pid"], signal.SIGKILL)
        host = rh["host"]

        def reported_held() -> bool:
            node = store.get(keys.node(host)).value
            d = node["daemons"]["reward-host-0"]
            return node.get("paused") is True and d["state"] == "held" and d["restarts"] == 1
        wait_for("reward-host-0 reported held", reported_held, timeout_s=30)
        wait_for("its registration to expire", lambda: member(store, keys, "reward-host", "reward-host-0") is None,
                 timeout_s=30)
        held_for("reward-host-0 down while paused", 2.5, lambda: reported_held()
                 and member(store, keys, "reward-host", "reward-host-0") is None)
        # Longer paused than --max-idle-s: the run's watchdog does not count a pause.
        wait_for("a pause longer than --max-idle-s", lambda: run.poll() is None
                 and time.monotonic() - paused_at > MAX_IDLE_S + 2, timeout_s=MAX_IDLE_S + 30, every_s=0.5)

        resumed = cli("resume", "--job", "maint", "--etcd", etcd.endpoints_arg, "--timeout", "120")
        assert resumed.returncode == Exit.OK, resumed.stdout + resumed.stderr
        print(paused.stdout, resumed.stdout)  # the figures docs/operations/maintenance-mode.md quotes (pytest -s)
        assert "job maint resumed by " in resumed.stdout and "no host paused" in resumed.stdout
        again = wait_for("reward-host-0 started again", lambda: member(store, keys, "reward-host", "reward-host-0"),
                         timeout_s=60)
        assert again["pid"] != rh["pid"]
        code = run.wait(300)
    finally:
        stop(run)
        store.close()
    out = log.read_text()
    assert code == Exit.OK, out[-4000:]  # max_steps reached, accounting invariant held
    assert "job paused since " in out and ": starting and stopping nothing" in out
    assert "reward-host-0 died (signal 9); paused: the agent starts nothing until `rlfleet resume`" in out
    assert "job resumed" in out and re.search(r"restarted reward-host-0 \(restart #1", out)
    run_dir = Path(out.splitlines()[0].removeprefix("run dir: "))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if "loss" in x]
    assert steps == list(range(1, MAX_STEPS + 1)), steps  # every step once: none lost or repeated by the pause
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["ok"] is True, accounting


HOST = "pause-h1"
PLACEMENT = agent_host_placement(HOST)


def test_a_paused_agent_observes_only_and_restarts_on_resume(tmp_path, etcd):
    spec_path = write_spec(tmp_path, job="pausejob", extra=PLACEMENT)
    keys, store = JobKeys("pausejob"), EtcdStore(etcd.endpoints)
    store.put(keys.spec, load_spec(spec_path).to_dict())
    env = {**os.environ, "RLFLEET_RUN_DIR": str(tmp_path / "run")}
    log = open(tmp_path / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", "--job", "pausejob",
                              "--etcd", etcd.endpoints_arg, "--host", HOST],
                             stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def node() -> dict:
        kv = store.get(keys.node(HOST))
        return kv.value if kv else {}
    try:
        rh = wait_for("reward-host-0 placed and registered",
                      lambda: member(store, keys, "reward-host", "reward-host-0"), timeout_s=90)
        # No trainer runs (it is placed on a host without an agent): the pause is written
        # and the agent follows it, but it is never confirmed whole: exit 10, still in effect.
        paused = cli("pause", "--job", "pausejob", "--etcd", etcd.endpoints_arg, "--timeout", "3")
        assert paused.returncode == Exit.TIMED_OUT, paused.stdout + paused.stderr
        assert "no trainer leader registered" in paused.stderr and "the pause stays in effect" in paused.stderr
        wait_for("the node record paused", lambda: node().get("paused") is True, timeout_s=30)

        os.kill(rh["pid"], signal.SIGKILL)
        wait_for("reward-host-0 held", lambda: node()["daemons"]["reward-host-0"]["state"] == "held", timeout_s=30)
        held_for("reward-host-0 down, the resource-manager untouched", 2.5, lambda: (
            not alive(rh["pid"]) and node()["daemons"]["reward-host-0"]["state"] == "held"
            and node()["daemons"]["resource-manager-0"]["state"] == "running"))
        assert node()["daemons"]["reward-host-0"]["restarts"] == 1

        resumed = cli("resume", "--job", "pausejob", "--etcd", etcd.endpoints_arg, "--timeout", "30")
        assert resumed.returncode == Exit.OK, resumed.stdout + resumed.stderr
        again = wait_for("reward-host-0 restarted", lambda: (
            (m := member(store, keys, "reward-host", "reward-host-0")) and m["pid"] != rh["pid"] and m),
            timeout_s=60)
        assert alive(again["pid"]) and "paused" not in node()
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(30)
        store.close()
    assert code == 0
    text = (tmp_path / "agent.log").read_text()
    assert "job paused since " in text and ": observing only" in text
    assert "reward-host-0 died (signal 9); paused: the agent starts nothing until `rlfleet resume`" in text
    assert "job resumed: acting on placement again" in text
