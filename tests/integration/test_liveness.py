"""Registrations are checked, not trusted, with real etcd and real daemon processes:
`rlfleet status` at once after a kill -9 or a SIGSTOP, a daemon that finds a key it
does not own, a member key deleted by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.procs import ProcessId
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit

from .helpers import rlfleet, stop, store_with_spec, wait_for, write_spec

TTL_S = 2.0
# For the checks of `rlfleet status` right after a kill: status is a fresh Python process,
# which on a loaded machine takes more than a 2 s lease to start and ask.
LONG_TTL_S = 20.0
KEYS = JobKeys("live")
MEMBER = KEYS.member("reward-host", "rh-1")


def status(etcd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", "live", "--etcd",
                           etcd.endpoints_arg, "--output", "json"], capture_output=True, text=True, timeout=60)


@pytest.fixture
def store(tmp_path, etcd):
    with store_with_spec(tmp_path, etcd, "live") as s:
        yield s


@pytest.fixture
def long_lease(tmp_path, store):
    """The job's spec with LONG_TTL_S leases (request it before reward_host)."""
    spec = load_spec(write_spec(tmp_path, job="live")).to_dict()
    spec["etcd"]["lease_ttl_s"] = LONG_TTL_S
    store.put(KEYS.spec, spec)


@pytest.fixture
def reward_host(tmp_path, etcd, store):
    """One real daemon, started by hand (no supervisor to restart it)."""
    log = tmp_path / "rh.log"
    proc = rlfleet("daemon", "reward-host", "--job", "live", "--etcd", etcd.endpoints_arg, "--id", "rh-1", log=log)
    try:
        wait_for("reward-host registered", lambda: (kv := store.get(MEMBER)) and kv.value["pid"] == proc.pid,
                 timeout_s=60)
        yield proc, log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


def member_health(result: subprocess.CompletedProcess) -> str:
    out = json.loads(result.stdout)
    return next(m["health"] for m in out["members"] if m["member_id"] == "rh-1")


def test_status_says_dead_at_once_after_kill_9(etcd, store, long_lease, reward_host):
    proc, _ = reward_host
    healthy = status(etcd)
    assert healthy.returncode == Exit.OK and member_health(healthy) == "running", healthy.stdout
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    after = status(etcd)  # at once: the lease has up to LONG_TTL_S left
    assert store.get(MEMBER) is not None, "the lease ran out before status was asked; the test proves nothing"
    assert after.returncode == Exit.FAILURE, after.stdout
    assert member_health(after).startswith(f"dead (pid {proc.pid} is gone")
    assert any(p.startswith("reward-host/rh-1: dead") for p in json.loads(after.stdout)["problems"])


def test_status_says_stopped_for_a_sigstopped_daemon(etcd, store, long_lease, reward_host):
    proc, _ = reward_host
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for("the daemon stopped", lambda: ProcessId.local(proc.pid).state() == "stopped", timeout_s=5)
    result = status(etcd)
    assert result.returncode == Exit.FAILURE and member_health(result).startswith("stopped"), result.stdout
    os.kill(proc.pid, signal.SIGCONT)


def test_a_foreign_member_key_is_neither_overwritten_nor_deleted(tmp_path, etcd, store):
    """A second daemon with the same id (by mistake, or another job's run on this etcd)."""
    foreign_lease = store.grant_lease(30)
    foreign = {"id": "rh-1", "role": "reward-host", "host": "elsewhere", "pid": 4242, "boot_id": "another-boot",
               "state": "running", "incarnation": "first-run"}
    store.put(MEMBER, foreign, lease=foreign_lease)
    log = tmp_path / "dup.log"
    proc = rlfleet("daemon", "reward-host", "--job", "live", "--etcd", etcd.endpoints_arg, "--id", "rh-1", log=log)
    try:
        wait_for("the duplicate to say who holds the key",
                 lambda: "is held by another live process (pid 4242 on elsewhere, incarnation first-run" in
                 log.read_text(), timeout_s=60)
        assert store.get(MEMBER).value == foreign and store.get(MEMBER).lease_id == foreign_lease.id
        assert stop(proc) == 0
        kv = store.get(MEMBER)
        assert kv is not None and kv.value == foreign, "the duplicate deleted a key it did not own"
        assert "was never ours" in log.read_text()
    finally:
        stop(proc)
        store.revoke_lease(foreign_lease)


def test_a_duplicate_registers_once_the_holder_is_gone(tmp_path, etcd, store):
    foreign_lease = store.grant_lease(30)
    store.put(MEMBER, {"id": "rh-1", "pid": 4242, "host": "elsewhere"}, lease=foreign_lease)
    log = tmp_path / "dup.log"
    proc = rlfleet("daemon", "reward-host", "--job", "live", "--etcd", etcd.endpoints_arg, "--id", "rh-1", log=log)
    try:
        wait_for("the duplicate to wait", lambda: "waiting for it to go" in log.read_text(), timeout_s=60)
        store.revoke_lease(foreign_lease)
        wait_for("the daemon registered", lambda: (kv := store.get(MEMBER)) and kv.value["pid"] == proc.pid,
                 timeout_s=10)
    finally:
        assert stop(proc) == 0
    assert store.get(MEMBER) is None  # its own key, deleted at its exit


def test_a_member_key_deleted_by_hand_comes_back(etcd, store, reward_host):
    proc, log = reward_host
    lease = store.get(MEMBER).lease_id
    store.delete(MEMBER)
    # Within a TTL (the key check) plus a cycle (TTL/3), plus slack for two busy cores.
    back = wait_for("the member key written again", lambda: store.get(MEMBER), timeout_s=TTL_S + TTL_S / 3 + 2)
    assert back.value["pid"] == proc.pid and back.lease_id == lease
    wait_for("the log to say why", lambda: "vanished while lease" in log.read_text(), timeout_s=5)


def test_status_says_stalled_when_a_lease_is_not_refreshed(etcd, store):
    """A loop that stopped refreshing (on another machine: no pid to check) is flagged
    before its lease runs out, once over half the TTL passed without a refresh."""
    lease = store.grant_lease(LONG_TTL_S)  # status may take seconds to answer on a busy machine
    store.put(MEMBER, {"id": "rh-1", "role": "reward-host", "host": "elsewhere", "pid": 4242,
                       "boot_id": "another-boot", "state": "running"}, lease=lease)
    assert member_health(status(etcd)) == "running"
    flagged = wait_for("status to say stalled", lambda: (r := status(etcd)).returncode == Exit.FAILURE and r,
                       timeout_s=LONG_TTL_S)
    assert member_health(flagged).startswith("stalled (no lease refresh for ~"), flagged.stdout
    assert store.lease_remaining(lease.id) > 0  # flagged before the registration expired
