"""One `rlfleet run` per job, and a supervisor that replaces daemons whose registration
expired while their process lives. Real etcd, real `rlfleet run` fleets, real signals.

The fleet is started once for the module (a full fleet takes tens of seconds on
two busy cores); the take-over test comes last and ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.failpoints import DAEMON as DAEMON_FAILPOINT_ENV
from rlfleet.common.procs import ProcessId
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit
from rlfleet.tools.run.etcd_local import EtcdCluster

from .helpers import TINY_MODEL, stop, wait_for, write_spec

pytestmark = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

TTL_S = 2.0
INTERVAL_S = TTL_S / 3
EXPIRY_SLACK_S = 3.0  # etcd's lease granularity (whole seconds, checked every 500 ms) and busy cores
KEYS = JobKeys("owned")
REWARD = KEYS.member("reward-host", "reward-host-0")


class Fleet:
    def __init__(self, tmp, etcd, store, proc, log, stall_file) -> None:
        self.tmp, self.etcd, self.store, self.proc, self.log, self.stall_file = tmp, etcd, store, proc, log, stall_file

    def members(self) -> dict[str, dict]:
        return {kv.key: kv.value for kv in self.store.get_prefix(KEYS.members_prefix)}

    def reward_pid(self) -> int:
        kv = self.store.get(REWARD)
        return kv.value["pid"] if kv else 0


def start_run(spec, etcd, log, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--etcd",
                             etcd.endpoints_arg, "--no-view", "--max-idle-s", "0", *extra],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})


def all_running(store: EtcdStore, expected: int, incarnation: str) -> bool:
    values = [kv.value for kv in store.get_prefix(KEYS.members_prefix)]
    return len([v for v in values if v.get("state") == "running" and v.get("incarnation") == incarnation]) == expected


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("owned")
    etcd = EtcdCluster(1).start()
    # Never finishes by itself: on an idle machine the default 100 steps take ~7 s, and
    # the tests below need the run live until the take-over test stops it.
    spec = write_spec(tmp, job="owned", extra="\n[trainer]\nmax_steps = 1000000\n")
    stall_file = tmp / "stall-reward-host"
    log = tmp / "run1.log"
    proc = start_run(spec, etcd, log, env={DAEMON_FAILPOINT_ENV: f"stall_if_file:reward-host:{stall_file}"})
    store = EtcdStore(etcd.endpoints)
    try:
        owner = wait_for("run 1 to own the job", lambda: store.get(KEYS.owner), timeout_s=30).value
        expected = sum(load_spec(spec).all_roles().values())
        wait_for(f"all {expected} daemons of run 1 registered",
                 lambda: all_running(store, expected, owner["incarnation"]), timeout_s=120)
        yield Fleet(tmp, etcd, store, proc, log, stall_file)
    finally:
        stop(proc)
        store.close()
        etcd.stop()


def test_a_second_run_of_a_live_job_is_refused_and_changes_nothing(fleet):
    before = fleet.members()
    owner = fleet.store.get(KEYS.owner)
    second = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "run", str(fleet.tmp / "owned.toml"),
                             "--etcd", fleet.etcd.endpoints_arg, "--no-view"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == Exit.JOB_OWNED, second.stdout + second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert f"refused: job 'owned' is already being run by incarnation {owner.value['incarnation']} " \
           f"(pid {fleet.proc.pid} on " in line and "--take-over" in line, line
    assert second.stdout == ""  # no run dir, no daemons
    assert fleet.store.get(KEYS.owner) == owner
    after = fleet.members()
    assert {k: (v["pid"], v["lease"]) for k, v in after.items()} == \
        {k: (v["pid"], v["lease"]) for k, v in before.items()}


def test_a_sigstopped_daemon_is_replaced_within_ttl_and_a_cycle(fleet):
    pid = fleet.reward_pid()
    os.kill(pid, signal.SIGSTOP)
    # The deadline is the property: its lease expires (TTL) and the supervisor's next cycle kills it.
    wait_for("the stopped reward-host killed", lambda: ProcessId.local(pid).state() in ("dead", "zombie"),
             timeout_s=TTL_S + INTERVAL_S + EXPIRY_SLACK_S)
    wait_for("a new reward-host registered", lambda: fleet.reward_pid() not in (0, pid), timeout_s=60)
    text = fleet.log.read_text()
    assert f"replacing reward-host-0 (pid {pid}): stopped (SIGSTOP?) and its registration" in text, text[-2000:]


def test_a_stalled_main_loop_loses_its_lease_and_is_replaced(fleet):
    pid = fleet.reward_pid()
    lease = int(fleet.store.get(REWARD).value["lease"], 16)
    fleet.stall_file.touch()  # its next cycle blocks for good; its threads keep running
    wait_for("the stalled loop to stop refreshing its lease", lambda: fleet.store.lease_remaining(lease) == -1,
             timeout_s=INTERVAL_S + TTL_S + EXPIRY_SLACK_S)
    assert not fleet.stall_file.exists()
    assert ProcessId.local(pid).state() == "running"  # alive, yet no longer registered
    wait_for("the stalled reward-host killed", lambda: ProcessId.local(pid).state() in ("dead", "zombie"),
             timeout_s=TTL_S + INTERVAL_S + EXPIRY_SLACK_S)
    wait_for("a new reward-host registered", lambda: fleet.reward_pid() not in (0, pid), timeout_s=60)
    assert f"replacing reward-host-0 (pid {pid}): its main loop stalled" in fleet.log.read_text()


def test_take_over_replaces_the_live_run_which_stops_and_exits_8(fleet):
    old_owner = fleet.store.get(KEYS.owner).value
    old_pids = {v["pid"] for v in fleet.members().values()}
    log = fleet.tmp / "run2.log"
    second = start_run(fleet.tmp / "owned.toml", fleet.etcd, log, "--take-over")
    try:
        assert fleet.proc.wait(60) == Exit.JOB_OWNED, fleet.log.read_text()[-3000:]
        new_owner = fleet.store.get(KEYS.owner).value
        assert new_owner["incarnation"] != old_owner["incarnation"] and new_owner["pid"] == second.pid
        assert f"taken over by incarnation {new_owner['incarnation']}" in fleet.log.read_text()
        expected = sum(load_spec(fleet.tmp / "owned.toml").all_roles().values())
        wait_for("the new run's daemons registered",
                 lambda: all_running(fleet.store, expected, new_owner["incarnation"]), timeout_s=120)
        assert not old_pids & {v["pid"] for v in fleet.members().values()}
        assert f"took job owned over from incarnation {old_owner['incarnation']}" in log.read_text()
    finally:
        code = stop(second, timeout_s=60)
    assert code == Exit.STOPPED, log.read_text()[-3000:]
    assert fleet.store.get(KEYS.owner) is None  # released at its end: the next run may start
    assert fleet.members() == {}
