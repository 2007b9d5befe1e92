"""`rlfleet switchover` with real etcd and real daemon processes: the leadership of a
singleton moves to the named standby with the leader key vacant far less than one lease
TTL; every refusal says why with exit 9; a request whose target died before taking over
lets any standby lead again once the target's registration is gone, and expires by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Leader
from rlfleet.common.control.operations import Switchover
from rlfleet.common.procs import ProcessId, start_ticks
from rlfleet.tools.exit_codes import Exit

from .helpers import rlfleet, stop, store_with_spec, wait_for

JOB = "so"
KEYS = JobKeys(JOB)
TTL_S = 2.0  # FAST_SPEC's lease TTL
# A killed daemon's lease runs out within TTL; etcd checks expiry every 500 ms, and two
# busy cores start processes slowly.
EXPIRY_SLACK_S = 3.0
PREFIX = {"resource-manager": "rm", "repack-manager": "pm"}


def switchover(etcd, role: str, to: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "switchover", role, "--to", to,
                           "--job", JOB, "--etcd", etcd.endpoints_arg, *extra],
                          capture_output=True, text=True, timeout=120)


def leader(store: EtcdStore, role: str) -> str:
    kv = store.get(KEYS.leader(role))
    return Leader.from_kv(KEYS, kv).id if kv is not None else ""


def member_leads(store: EtcdStore, role: str, member_id: str) -> bool:
    """The member's own record says it leads (or not): what the daemon believes."""
    kv = store.get(KEYS.member(role, member_id))
    return kv is not None and kv.value.get("leader") is True


@pytest.fixture
def store(tmp_path, etcd):
    with store_with_spec(tmp_path, etcd, JOB) as s:
        yield s


@pytest.fixture
def pair(tmp_path, etcd, store):
    """start(role) -> (leader id, standby id): two daemons of the role, the first leading,
    the second a registered standby."""
    procs: dict[str, subprocess.Popen] = {}

    def start(role: str) -> tuple[str, str]:
        first, second = f"{PREFIX[role]}-0", f"{PREFIX[role]}-1"
        for member_id in (first, second):
            procs[member_id] = rlfleet("daemon", role, "--job", JOB, "--etcd", etcd.endpoints_arg,
                                       "--id", member_id, log=tmp_path / f"{member_id}.log")
            wait_for(f"{role} {member_id} registered",
                     lambda: (kv := store.get(KEYS.member(role, member_id))) and kv.value["state"] == "running",
                     timeout_s=60)
            if member_id == first:
                wait_for(f"{first} leads", lambda: leader(store, role) == first, timeout_s=TTL_S + 10)
        return first, second

    start.procs = procs  # type: ignore[attr-defined]
    yield start
    for proc in procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    for proc in procs.values():
        stop(proc)


@pytest.mark.parametrize("role", ["resource-manager", "repack-manager"])
def test_switchover_moves_leadership_to_the_standby_within_a_fraction_of_a_ttl(pair, store, etcd, tmp_path, role):
    first, second = pair(role)
    first_lease = store.get(KEYS.member(role, first)).lease_id
    result = switchover(etcd, role, second, "--output", "json", "--timeout", "30")
    assert result.returncode == Exit.OK, result.stdout + result.stderr
    out = json.loads(result.stdout)
    assert (out["from"], out["to"], out["ok"]) == (first, second, True) and out["vacant_s"] >= 0, out
    # Handed over, not failed over: the old leader resigned while its lease lived (a failover
    # waits for the lease to expire). How short the gap is: tools/bench/switchover.py's figure.
    assert store.get(KEYS.member(role, first)).lease_id == first_lease and store.lease_remaining(first_lease) > 0
    assert leader(store, role) == second
    assert store.get(KEYS.switchover(role)) is None  # the target deleted the request
    wait_for(f"{second} says it leads, {first} that it does not",
             lambda: member_leads(store, role, second) and not member_leads(store, role, first), timeout_s=10)
    # The old leader stays a standby (it does not grab the key back), and a switchover back works too.
    back = switchover(etcd, role, first, "--timeout", "30")
    assert back.returncode == Exit.OK, back.stdout + back.stderr
    assert back.stdout.startswith(f"{role} leadership: {second} -> {first} in "), back.stdout
    assert leader(store, role) == first
    logs = (tmp_path / f"{first}.log").read_text()
    assert f"resigned {role} leadership to {second} (switchover)" in logs
    assert f"switchover of {role} to {first} done" in logs


def test_refusals_say_why(pair, store, etcd):
    role = "resource-manager"
    first, second = pair(role)

    def refused(to: str, *extra: str, role: str = role) -> str:
        result = switchover(etcd, role, to, "--timeout", "5", *extra)
        assert result.returncode == Exit.REFUSED, result.stdout + result.stderr
        assert leader(store, "resource-manager") == first  # nothing moved
        return result.stderr.strip()

    usage = switchover(etcd, "reward-host", second)
    assert usage.returncode == Exit.BAD_SPEC and "'reward-host' is not a singleton role" in usage.stderr
    assert refused(first) == f"rlfleet switchover: refused: {first} is already the {role} leader"
    assert refused("rm-9") == (f"rlfleet switchover: refused: rm-9 is not a registered {role} member; "
                               f"healthy standbys: {second}")
    assert refused("tr-1", role="trainer") == (
        "rlfleet switchover: refused: trainer has no leader now: nothing to switch over "
        "(its standbys campaign by themselves)")
    # A member whose record is not `running` (its lease here is the test's own).
    lease = store.grant_lease(30)
    store.put(KEYS.member(role, "rm-new"), {"id": "rm-new", "role": role, "state": "starting"}, lease=lease)
    assert refused("rm-new") == f"rlfleet switchover: refused: {role} rm-new is not a healthy standby: " \
                                "its member record says 'starting'"
    # A stopped process (SIGSTOP) whose registration still stands (the lease is the test's:
    # a real daemon's 2 s lease would run out while the command starts).
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        ident = ProcessId.local(sleeper.pid, start_ticks(sleeper.pid))
        store.put(KEYS.member(role, "rm-stopped"), {"id": "rm-stopped", "role": role, "state": "running",
                                                    **ident.to_fields()}, lease=lease)
        assert refused("rm-stopped").startswith(f"rlfleet switchover: refused: {role} rm-stopped is not a "
                                                f"healthy standby: stopped (pid {sleeper.pid} is stopped")
    finally:
        sleeper.kill()
        sleeper.wait()
    # A request pending already (written by hand, addressed to a leader that is gone: the
    # one in office leaves it to expire).
    store.put(KEYS.switchover(role), Switchover(role, to="rm-new", from_="rm-gone", by="someone",
                                                at=time.time()).to_value(), lease=lease)
    message = refused(second, "--output", "json")
    assert message.startswith(f"rlfleet switchover: refused: a switchover of {role} to rm-new is already "
                              "pending (requested by someone "), message
    store.revoke_lease(lease)
    result = switchover(etcd, role, second)  # nothing pending any more
    assert result.returncode == Exit.OK, result.stdout + result.stderr
    assert leader(store, role) == second


def test_a_request_for_a_target_that_died_gives_way_to_any_standby(pair, store):
    """The target is kill -9'd before it takes over: the leader hands over (the target's
    registration still stands), nobody else campaigns while it does, and once its lease
    runs out the old behaviour is back (any candidate leads); the request then expires
    with its own lease."""
    role = "resource-manager"
    first, second = pair(role)
    proc = pair.procs[second]  # type: ignore[attr-defined]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    request_lease = store.grant_lease(10)
    store.put(KEYS.switchover(role), Switchover(role, to=second, from_=first, by="test", at=time.time()).to_value(),
              lease=request_lease)
    wait_for(f"{first} resigned to the dead {second}", lambda: leader(store, role) == "", timeout_s=TTL_S + 5)
    assert store.get(KEYS.member(role, second)) is not None, "the target's lease ran out already: proves nothing"
    wait_for(f"{second}'s registration expired", lambda: store.get(KEYS.member(role, second)) is None,
             timeout_s=TTL_S + EXPIRY_SLACK_S)
    wait_for(f"{first} leads again", lambda: leader(store, role) == first, timeout_s=TTL_S + EXPIRY_SLACK_S)
    assert store.get(KEYS.switchover(role)) is not None  # led again while the request still stood
    wait_for("the request expired with its lease", lambda: store.get(KEYS.switchover(role)) is None,
             timeout_s=10 + EXPIRY_SLACK_S)
    assert leader(store, role) == first
