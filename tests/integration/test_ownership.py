"""Who owns a key: a session writes only keys bound to its own lease (or absent ones),
takes over a predecessor only when this machine proves it dead, and writes back a key
deleted by hand. Real etcd, real sessions (in-process), real dead processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.session import Session
from rlfleet.common.procs import ProcessId, boot_id, pid_namespace

from .helpers import wait_for

TTL_S = 2.0
KEYS = JobKeys("own")


def member_value(pid: int = 0, **extra) -> dict:
    me = ProcessId.current()
    return {"id": "rh-0", "role": "reward-host", "host": "h", **me.to_fields(),
            **({"pid": pid} if pid else {}), **extra}


def session(store: EtcdStore, member_id: str = "rh-0", elect: bool = False) -> Session:
    return Session(store, KEYS, "reward-host" if not elect else "trainer", member_id, ttl_s=TTL_S, elect=elect)


def step_until(what: str, s: Session, value: dict, done, timeout_s: float = 10.0) -> list[str]:
    """Step like a daemon's loop (every TTL/3) until `done()`; every sentence said meanwhile."""
    said: list[str] = []

    def one():
        said.extend(s.step(value))
        if done():
            return True
        time.sleep(TTL_S / 3)  # the daemon's refresh interval, not a wait for the outcome
        return False
    wait_for(what, one, timeout_s=timeout_s, every_s=0)
    return said


@pytest.fixture
def store(etcd):
    with EtcdStore(etcd.endpoints) as s:
        yield s


def test_a_second_session_with_the_same_id_neither_overwrites_nor_deletes_the_first(store, etcd):
    first = session(store)
    first.step(member_value(marker="first"))
    with EtcdStore(etcd.endpoints) as other_store:
        second = session(other_store)
        said = second.step(member_value(marker="second"))
        assert second.blocked and any("held by another live process" in s for s in said), said
        kv = store.get(first.member_key)
        assert kv.value["marker"] == "first" and kv.lease_id == first.lease.id
        # Asking again costs a read, says nothing new and still writes nothing.
        assert second.step(member_value(marker="second")) == []
        second.close()
    kv = store.get(first.member_key)
    assert kv is not None and kv.value["marker"] == "first", "the duplicate's close deleted the owner's key"
    first.close()
    assert store.get(first.member_key) is None


def test_a_blocked_session_registers_once_the_owner_is_gone(store, etcd):
    first = session(store)
    first.step(member_value(marker="first"))
    with EtcdStore(etcd.endpoints) as other_store:
        second = session(other_store)
        second.step(member_value(marker="second"))
        assert second.blocked
        first.close()
        said = second.step(member_value(marker="second"))
        assert not second.blocked and any("the key is ours now" in s for s in said), said
        assert store.get(second.member_key).value["marker"] == "second"
        second.close()


def test_a_blocked_candidate_never_campaigns(store, etcd):
    first = session(store, "t-0", elect=True)
    first.campaign_after = 0.0
    first.step(member_value())
    first.step(member_value())
    assert first.is_leader
    first.is_leader = False  # a leader's key gone with its lease would look like this
    store.delete(first.leader_key)
    with EtcdStore(etcd.endpoints) as other_store:
        dup = session(other_store, "t-0", elect=True)
        dup.campaign_after = 0.0
        for _ in range(3):
            dup.step(member_value())
        assert dup.blocked and not dup.is_leader and store.get(dup.leader_key) is None
        dup.close()
    first.close()


def test_a_foreign_lease_bound_key_is_left_alone(store, etcd):
    node_key = KEYS.node("h")
    with EtcdStore(etcd.endpoints) as other_store:
        foreign = other_store.grant_lease(10)
        other_store.put(node_key, {"owner": "someone else"}, lease=foreign)
        s = session(store)
        s.put_lease_bound(node_key, {"owner": "me"})
        said = s.step(member_value())
        assert any(f"{node_key} is held by another live process" in x for x in said), said
        assert store.get(node_key).value == {"owner": "someone else"}
        assert s.step(member_value()) == []  # not asked again every cycle
        s.close()
        assert store.get(node_key).value == {"owner": "someone else"}
        other_store.revoke_lease(foreign)


def test_a_member_key_deleted_by_hand_is_written_again_within_a_ttl(store):
    s = session(store)
    s.put_lease_bound(KEYS.node("h"), {"inventory": 1})
    s.step(member_value())
    store.delete(s.member_key)
    store.delete(KEYS.node("h"))
    cycles: list[int] = []

    def written_again() -> bool:
        cycles.append(1)  # one call per daemon cycle (step_until steps, then asks)
        return store.get(s.member_key) is not None and store.get(KEYS.node("h")) is not None
    said = step_until("the member key written again", s, member_value(), written_again)
    # The keys are checked once a TTL: by the 4th cycle (one every TTL/3, at least a TTL after
    # the last check). Counted in cycles, not timed: a slow machine only makes each one longer.
    assert len(cycles) <= 4, (len(cycles), said)
    assert any("vanished while lease" in x for x in said), said
    assert store.get(s.member_key).lease_id == s.lease.id
    assert s.lease_grants == 1  # the same lease: a rewrite, not a new registration
    s.close()


def test_a_dead_predecessor_on_this_machine_is_taken_over_at_once(store, etcd):
    """kill -9 then a restart: the old registration's lease would hold the key for a TTL."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = store.grant_lease(30)
    store.put(KEYS.member("reward-host", "rh-0"),
              {**member_value(), "pid": dead.pid, "pid_start": 0, "marker": "old"}, lease=old)
    store.put(KEYS.leader("reward-host"), {"id": "rh-0"}, lease=old)
    s = session(store)
    said = s.step(member_value(marker="new"))
    assert not s.blocked and any(f"from dead pid {dead.pid}" in x for x in said), said
    assert store.get(s.member_key).value["marker"] == "new"
    # Everything the dead process owned went with its lease.
    assert store.lease_remaining(old.id) == -1 and store.get(KEYS.leader("reward-host")) is None
    s.close()


def test_a_live_holder_on_another_boot_is_not_taken_over(store):
    other = store.grant_lease(30)
    store.put(KEYS.member("reward-host", "rh-0"),
              {**member_value(), "boot_id": "another-machine", "pid": 1, "marker": "remote"}, lease=other)
    s = session(store)
    s.step(member_value(marker="new"))
    assert s.blocked and store.get(s.member_key).value["marker"] == "remote"
    s.close()
    store.revoke_lease(other)


def test_process_identity_tells_dead_stopped_and_reused_pids_apart():
    me = ProcessId.current()
    assert me.boot_id == boot_id() and me.state() == "running"
    assert ProcessId.local(me.pid, me.start + 1).state() == "dead"  # a reused pid
    assert ProcessId("elsewhere", me.pid, me.start, me.pid_ns).state() == "remote"
    assert ProcessId(me.boot_id, me.pid, me.start, me.pid_ns + 1).state() == "remote"  # a container's
    assert ProcessId(me.boot_id, me.pid, me.start).state() == "remote"  # a record without its namespace
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = ProcessId.local(proc.pid)
        wait_for("the child running", lambda: ident.state() == "running", timeout_s=5)
        proc.send_signal(19)  # SIGSTOP
        wait_for("the child stopped", lambda: ident.state() == "stopped", timeout_s=5)
        proc.kill()
        wait_for("the child a zombie", lambda: ident.state() == "zombie", timeout_s=5)
    finally:
        proc.kill()
        proc.wait()
    assert ident.state() == "dead"


def test_a_process_in_another_pid_namespace_is_remote_on_the_same_boot():
    """A container shares the kernel (the lab's hosts showed the VM's boot id): its pids mean
    nothing in this process table, so its registrations are judged by their leases. On main a
    pid from another namespace was looked up here: "dead" if free, "running" if it named ours."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) as root: a pid namespace of its own")
    code = "import json; from rlfleet.common.procs import ProcessId; print(json.dumps(ProcessId.current().to_fields()))"
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    theirs = ProcessId.of(json.loads(out))
    assert theirs is not None and theirs.boot_id == boot_id() and theirs.pid == 1, out
    assert theirs.pid_ns != pid_namespace() and theirs.state() == "remote"


def test_put_owned_updates_only_a_key_bound_to_the_lease(store):
    mine, theirs = store.grant_lease(10), store.grant_lease(10)
    assert store.put_owned("/own/k", 1, mine) == (False, None)  # never creates
    assert store.get("/own/k") is None
    assert store.swap("/own/k", 0, 1, lease=mine)[0]
    assert store.put_owned("/own/k", 2, mine) == (True, None)
    ok, current = store.put_owned("/own/k", 3, theirs)
    assert not ok and current.value == 2 and current.lease_id == mine.id
    info = store.lease_info(mine.id)
    assert info.keys == {"/own/k"} and info.granted_s == 10 and 0 < info.remaining_s <= 10
    store.revoke_lease(mine)
    assert store.lease_info(mine.id).remaining_s == -1


def test_a_run_killed_with_9_does_not_block_the_next_one(store):
    """The owner key of a dead run is freed at once on its machine, not after its TTL."""
    from rlfleet.tools.run.job_owner import JobOwned, JobOwner
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = store.grant_lease(30)
    store.put(KEYS.owner, {"incarnation": "old", "host": "h", "pid": dead.pid, "boot_id": boot_id(),
                           "pid_ns": pid_namespace(), "pid_start": 0, "started": time.time()}, lease=old)
    owner = JobOwner(store, KEYS, TTL_S)
    assert "the previous owner incarnation old (pid" in owner.claim()
    assert store.get(KEYS.owner).value["incarnation"] == owner.incarnation
    # A live owner is refused, then replaced only when asked; the old one learns it.
    second = JobOwner(store, KEYS, TTL_S)
    with pytest.raises(JobOwned, match=f"already being run by incarnation {owner.incarnation}"):
        second.claim()
    assert second.lease is None  # its lease was given back
    assert "took job own over from" in second.claim(take_over=True)
    owner._refreshed_at = 0.0  # its loop's next pass is due now
    assert owner.keep() == f"taken over by {second.me.describe()}"
    owner.release()
    assert store.get(KEYS.owner).value["incarnation"] == second.incarnation  # not the old run's to delete
    second.release()
    assert store.get(KEYS.owner) is None
