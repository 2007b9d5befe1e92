"""Daemon lifecycle with real etcd and real daemon processes.

The fleet runs under `rlfleet run --etcd` (the embedded supervisor) against a
test etcd; faults are real signals sent to real pids taken from etcd.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import load_spec
from rlfleet.common.spec.placement import ROLES
from rlfleet.tools.exit_codes import Exit

from .helpers import rlfleet, spec_store, stop, wait_for, write_spec

TTL_S = 2.0
# Expiry is detected within TTL; allow for etcd's lease granularity (whole
# seconds, checked every 500 ms) and two busy cores.
EXPIRY_SLACK_S = 3.0


def members(store: EtcdStore, job: str) -> dict[tuple[str, str], dict]:
    keys = JobKeys(job)
    return {keys.parse_member(kv.key): kv.value for kv in store.get_prefix(keys.members_prefix)}


@pytest.fixture
def fleet(tmp_path, etcd):
    """`rlfleet run` of a full default placement (8 daemons) against the test etcd."""
    spec_path = write_spec(tmp_path, job="life")
    spec = load_spec(spec_path)
    expected = sum(spec.all_roles().values())
    proc = rlfleet("run", str(spec_path), "--etcd", etcd.endpoints_arg, "--no-view", log=tmp_path / "run.log")
    store = EtcdStore(etcd.endpoints)
    try:
        wait_for(f"all {expected} daemons registered",
                 lambda: len([v for v in members(store, "life").values() if v["state"] == "running"]) == expected,
                 timeout_s=90)
    except AssertionError:
        stop(proc)  # a failed set-up must not leave a fleet running
        raise
    yield store, proc, tmp_path
    # SIGTERM before the trainer finished: a clean stop, told apart from a finished job.
    assert stop(proc) == Exit.STOPPED, (tmp_path / "run.log").read_text()[-3000:]
    # Clean shutdown deregisters everything at once (no waiting for leases).
    assert members(store, "life") == {}


def test_all_seven_roles_register_and_etcdctl_shows_json(fleet, etcd):
    store, _, _ = fleet
    live = members(store, "life")
    assert {role for role, _ in live} == set(ROLES)
    for (role, member_id), value in live.items():
        assert value["role"] == role and value["id"] == member_id and value["pid"] > 0
        assert value["metrics"].startswith("http://")
    wait_for("a leader for every singleton role", lambda: {
        kv.key.rsplit("/", 1)[1] for kv in store.get_prefix(JobKeys("life").leaders_prefix)
    } == {"resource-manager", "repack-manager", "trainer"}, timeout_s=10)
    # The operator's view: plain etcdctl prints readable JSON for every key.
    etcdctl = shutil.which("etcdctl")
    if etcdctl is None:
        pytest.skip("etcdctl not installed")
    out = subprocess.run([etcdctl, f"--endpoints={etcd.endpoints_arg}", "get", "--prefix", "/rlfleet/life/"],
                         capture_output=True, text=True, check=True, env={**os.environ, "ETCDCTL_API": "3"}).stdout
    lines = out.splitlines()
    pairs = dict(zip(lines[0::2], lines[1::2]))
    assert "/rlfleet/life/spec" in pairs
    assert any(k.startswith("/rlfleet/life/nodes/") for k in pairs)
    assert any(k.startswith("/rlfleet/life/placement/") for k in pairs)
    for value in pairs.values():
        json.loads(value)  # every value is JSON


def test_kill_9_of_each_role_is_noticed_and_restarted(fleet):
    store, _, _ = fleet
    for role in ROLES:
        (r, member_id), value = next((k, v) for k, v in sorted(members(store, "life").items()) if k[0] == role)
        old_pid, old_lease = value["pid"], int(value["lease"], 16)
        os.kill(old_pid, signal.SIGKILL)
        # Noticed: the dead daemon's lease (and so its registration) is gone within the TTL.
        # (The supervisor may restart it sooner, re-registering under the same key
        # with a new lease; that is why the lease is watched, not the key.)
        wait_for(f"{role}/{member_id}'s lease to expire",
                 lambda: store.lease_remaining(old_lease) == -1, timeout_s=TTL_S + EXPIRY_SLACK_S)
        back = wait_for(f"{role}/{member_id} to re-register",
                        lambda: (v := members(store, "life").get((role, member_id))) and v["pid"] != old_pid and v,
                        timeout_s=60)
        assert int(back["lease"], 16) != old_lease


def test_killing_the_elected_resource_manager_hands_over_within_ttl(fleet):
    store, _, _ = fleet
    keys = JobKeys("life")
    leader_id = wait_for("a resource-manager leader", lambda: store.get(keys.leader("resource-manager")),
                         timeout_s=10).value["id"]
    pid = members(store, "life")[("resource-manager", leader_id)]["pid"]
    os.kill(pid, signal.SIGKILL)

    def standby_leads():
        kv = store.get(keys.leader("resource-manager"))
        return kv is not None and kv.value["id"] != leader_id
    # The deadline is the property: the leader's lease expires (TTL) and a standby's next cycle takes over.
    wait_for("a standby resource-manager to take over", standby_leads, timeout_s=TTL_S + EXPIRY_SLACK_S + 1)
    new_id = store.get(keys.leader("resource-manager")).value["id"]
    assert members(store, "life")[("resource-manager", new_id)]["leader"] is True or wait_for(
        "new leader's registration to say leader",
        lambda: members(store, "life")[("resource-manager", new_id)]["leader"], timeout_s=5)


def test_sigterm_exits_zero_and_deregisters_at_once(tmp_path, etcd):
    store = spec_store(tmp_path, etcd.endpoints, "term")
    proc = rlfleet("daemon", "reward-host", "--job", "term", "--etcd", etcd.endpoints_arg, "--id", "rh-1",
                   log=tmp_path / "rh.log")
    wait_for("reward-host registered", lambda: members(store, "term").get(("reward-host", "rh-1")), timeout_s=30)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    # Gone now, not after the lease runs out.
    assert ("reward-host", "rh-1") not in members(store, "term")
    log = (tmp_path / "rh.log").read_text()
    exit_line = next(line for line in log.splitlines() if '"event": "exit"' in line)
    assert "deregistered reward-host/rh-1" in exit_line and exit_line.endswith('exiting", "job": "term", '
                                                                              '"role": "reward-host", "id": "rh-1", '
                                                                              '"event": "exit"}')


def test_a_burst_of_signals_during_an_etcd_outage_still_ends_in_a_clean_exit(tmp_path, etcd):
    """Signals are handled on a thread (common/signals.py): a daemon that once set its
    stop Event inside the handler deadlocked when a second SIGTERM arrived meanwhile."""
    store = spec_store(tmp_path, etcd.endpoints, "burst")
    proc = rlfleet("daemon", "resource-manager", "--job", "burst", "--etcd", etcd.endpoints_arg,
                   "--id", "rm-1", log=tmp_path / "rm.log")
    wait_for("resource-manager registered", lambda: members(store, "burst").get(("resource-manager", "rm-1")),
             timeout_s=30)
    member = etcd.members[0]
    etcd.kill_member(member)  # the shutdown's deregistration now blocks on an unreachable etcd
    try:
        for sig in [signal.SIGHUP, signal.SIGTERM] * 10 + [signal.SIGINT] * 10:
            proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        etcd.start_member(member)
    assert "lease expires by itself" in (tmp_path / "rm.log").read_text()


def test_daemon_survives_etcd_outage_and_reregisters(tmp_path, etcd):
    store = spec_store(tmp_path, etcd.endpoints, "outage")
    proc = rlfleet("daemon", "trainer", "--job", "outage", "--etcd", etcd.endpoints_arg, "--id", "t-1",
                   log=tmp_path / "t.log")
    try:
        first = wait_for("trainer registered", lambda: members(store, "outage").get(("trainer", "t-1")), timeout_s=30)
        member = etcd.members[0]
        etcd.kill_member(member)
        # The daemon notices (a failed lease refresh), says so and keeps running.
        wait_for("the daemon to report etcd unreachable",
                 lambda: "etcd unreachable, degraded" in (tmp_path / "t.log").read_text(), timeout_s=30)
        assert proc.poll() is None, "daemon died when etcd went away"
        etcd.start_member(member)
        again = wait_for("trainer re-registered after etcd came back",
                         lambda: members(store, "outage").get(("trainer", "t-1")), timeout_s=30)
        # (etcd re-arms surviving leases with a full TTL when it restarts, so the
        # lease may be the old one; what matters is that the daemon is back.)
        assert again["pid"] == first["pid"]
        wait_for("trainer leads again", lambda: store.get(JobKeys("outage").leader("trainer")), timeout_s=10)
        # The keys above may be the ones that survived the restart; the daemon itself is back
        # once it says so (its gRPC channel may still be in reconnect back-off for seconds).
        def log_once_back() -> str:
            text = (tmp_path / "t.log").read_text()
            return text if "etcd reachable again" in text else ""

        log = wait_for("the daemon saying etcd is reachable again", log_once_back, timeout_s=30)
        assert "etcd unreachable, degraded, keeping local work" in log
    finally:
        assert stop(proc) == 0


def test_daemon_survives_sigkill_of_its_etcd_member(tmp_path, etcd3):
    store = spec_store(tmp_path, etcd3.endpoints[1:], "cluster")  # the test's own client avoids the victim
    # The daemon prefers the first endpoint listed: that is the member we kill.
    proc = rlfleet("daemon", "rollout", "--job", "cluster", "--etcd", etcd3.endpoints_arg, "--id", "r-1",
                   log=tmp_path / "r.log")
    try:
        before = wait_for("rollout registered", lambda: members(store, "cluster").get(("rollout", "r-1")),
                          timeout_s=30)
        etcd3.kill_member(etcd3.members[0])
        # Over several TTLs the registration must stay (failover keeps the lease alive).
        deadline = time.monotonic() + 3 * TTL_S
        while time.monotonic() < deadline:
            now = wait_for("registration readable", lambda: members(store, "cluster").get(("rollout", "r-1")),
                           timeout_s=TTL_S + EXPIRY_SLACK_S)
            time.sleep(0.2)
        assert proc.poll() is None
        assert now["pid"] == before["pid"]
    finally:
        assert stop(proc) == 0


def test_kill_9_of_the_supervisor_leaves_no_orphans(tmp_path):
    """`rlfleet run` with its private etcd: SIGKILL of the supervisor takes every daemon
    and etcd with it (PR_SET_PDEATHSIG), instead of a headless fleet running on."""
    import psutil

    spec_path = write_spec(tmp_path, job="orphans")
    log = tmp_path / "run.log"
    proc = rlfleet("run", str(spec_path), "--no-view", log=log)
    try:
        wait_for("the supervisor to start 8 daemons and etcd",
                 lambda: len(psutil.Process(proc.pid).children()) >= 9, timeout_s=60)
        # Past start-up, every process of the fleet exists (reward workers included): the
        # trainer has trained, which needs every role.
        wait_for("the first training step", lambda: re.search(r"step \d+/", log.read_text()), timeout_s=120)
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, [p.cmdline()[:6] for p in alive]
