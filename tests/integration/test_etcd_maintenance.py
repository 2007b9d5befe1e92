"""etcd maintenance under a live job (docs/operations/etcd-maintenance.md), on real etcd processes
and real daemons: `rlfleet etcd snapshot` / `restore` of a job's durable keys, and the
replacement of a dead etcd member (learner first, then promoted) while resource-managers
keep running against the cluster.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.common.control.etcd_auth import EtcdCredentials
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.ctl.etcd import read_members
from rlfleet.tools.exit_codes import Exit
from rlfleet.tools.run.etcd_local import EtcdCluster

from .helpers import rlfleet, stop, wait_for, write_spec

JOB = "ops"
KEYS = JobKeys(JOB)


def cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def start_manager(tmp_path: Path, etcd: EtcdCluster, member_id: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{member_id}.log"
    return rlfleet("daemon", "resource-manager", "--job", JOB, "--etcd", etcd.endpoints_arg, "--id", member_id,
                   log=log), log


def durable(store: EtcdStore) -> dict[str, object]:
    return {kv.key.removeprefix(KEYS.prefix): kv.value for kv in store.get_prefix(KEYS.prefix) if not kv.lease_id}


def leased(store: EtcdStore) -> set[str]:
    return {kv.key.removeprefix(KEYS.prefix) for kv in store.get_prefix(KEYS.prefix) if kv.lease_id}


# -- snapshot and restore -----------------------------------------------------------------
def test_snapshot_restores_durable_keys_into_a_fresh_etcd_and_refuses_what_would_harm(tmp_path, etcd):
    store = EtcdStore(etcd.endpoints)
    store.put(KEYS.spec, load_spec(write_spec(tmp_path, job=JOB)).to_dict())
    for i in range(60):  # an etcd that has lived a while: revisions a fresh one has not reached
        store.put("/scratch/revision-filler", i)
    term = store.revision()
    store.put(KEYS.weights_latest, {"version": 7, "bytes": 100, "checksum": "c7", "master": "relay-0", "term": term})
    store.put(KEYS.term("trainer"), {"term": term, "reign": term, "id": "trainer-0", "since": 1.0})
    store.put(KEYS.prompts_cursor, {"next": 640, "claims": {"env-0": [[576, 640]]}})
    store.put(KEYS.trainer_progress, {"version": 7, "consumed_groups": 600, "trained_groups": 590,
                                      "dropped_groups": 10, "received_groups": 610, "time": 2.0})
    store.put(KEYS.trainer_checkpoint, {"version": 5, "path": "/ckpt/5", "step": 5, "time": 3.0})
    store.put(KEYS.relay_chain, {"master": "relay-0", "order": ["relay-0"], "layouts": [1], "updated": 4.0})
    store.put(KEYS.state, {"state": "running", "since": 5.0, "by": "op", "reason": ""})
    store.put(KEYS.node_state("h1"), {"state": "cordoned", "since": 6.0, "by": "op", "reason": "disk"})
    # A real daemon: its member, leader and node keys are lease-bound, its placements durable.
    manager, log = start_manager(tmp_path, etcd, "rm-1")
    try:
        wait_for("the resource-manager leads and placed the job",
                 lambda: store.get(KEYS.leader("resource-manager")) and store.get_prefix(KEYS.placement_prefix),
                 timeout_s=60)
        live = leased(store)
        assert {"members/resource-manager/rm-1", "leader/resource-manager"} <= live, live
        snap_file = tmp_path / "ops.snapshot.json"
        taken = cli("etcd", "snapshot", str(snap_file), "--job", JOB, "--etcd", etcd.endpoints_arg)
        assert taken.returncode == Exit.OK, taken.stderr
        expected = durable(store)
        data = json.loads(snap_file.read_text())
        assert {e["key"]: e["value"] for e in data["keys"]} == expected
        assert {e["key"] for e in data["skipped"]} >= {"members/resource-manager/rm-1", "leader/resource-manager"}
        assert data["job"] == JOB and data["revision"] >= term and data["format"] == "rlfleet-etcd-snapshot"
        assert stat.S_IMODE(snap_file.stat().st_mode) == 0o600
        assert f"wrote {len(expected)} durable keys of job {JOB} at etcd revision {data['revision']}" in taken.stdout
        assert not list(tmp_path.glob(".rlfleet-snapshot-*")), "the temporary file was left behind"

        # Over the live job: refused, and nothing written.
        over_live = cli("etcd", "restore", str(snap_file), "--etcd", etcd.endpoints_arg)
        assert over_live.returncode == Exit.REFUSED, over_live.stderr
        assert "the job is live" in over_live.stderr and "members/resource-manager/rm-1" in over_live.stderr
    finally:
        stop(manager)
    assert "became resource-manager leader" in log.read_text()

    wrong_job = cli("etcd", "restore", str(snap_file), "--job", "other", "--etcd", etcd.endpoints_arg)
    assert wrong_job.returncode == Exit.REFUSED and "holds job 'ops', not 'other'" in wrong_job.stderr

    not_json = tmp_path / "broken.json"
    not_json.write_text('{"format": "rlfleet-etcd-snapshot", "version": 1, ')
    broken = cli("etcd", "restore", str(not_json), "--etcd", etcd.endpoints_arg)
    assert broken.returncode == Exit.BAD_SPEC and "not JSON" in broken.stderr, broken.stderr
    no_value = tmp_path / "no-value.json"
    no_value.write_text(json.dumps({**data, "keys": [*data["keys"][:2], {"key": "prompts/cursor"}]}))
    missing = cli("etcd", "restore", str(no_value), "--etcd", etcd.endpoints_arg)
    assert missing.returncode == Exit.BAD_SPEC and "keys[2]: expected an object with 'key' and 'value'" in missing.stderr
    escaping = tmp_path / "escaping.json"
    escaping.write_text(json.dumps({**data, "keys": [{"key": "../other/spec", "value": {}}]}))
    escape = cli("etcd", "restore", str(escaping), "--etcd", etcd.endpoints_arg)
    assert escape.returncode == Exit.BAD_SPEC and "keys[0].key" in escape.stderr, escape.stderr

    # Into a fresh etcd (the old cluster is lost): the durable keys come back, nothing else.
    with EtcdCluster(1) as fresh:
        target = EtcdStore(fresh.endpoints)
        restored = cli("etcd", "restore", str(snap_file), "--etcd", fresh.endpoints_arg)
        assert restored.returncode == Exit.OK, restored.stderr
        assert f"restored {len(expected)} keys of job {JOB}" in restored.stdout and "1 transaction" in restored.stdout
        back = durable(target)
        assert leased(target) == set()
        # The fencing terms were revisions of the old etcd: reset, older than any term this one gives.
        assert "set to 0, no fence" in restored.stdout
        clamped = {"weights/latest", "term/trainer"}
        assert {k: v for k, v in back.items() if k not in clamped} == \
               {k: v for k, v in expected.items() if k not in clamped}
        assert back["weights/latest"]["version"] == 7 and back["weights/latest"]["term"] == 0
        assert back["term/trainer"]["term"] == back["term/trainer"]["reign"] == 0 and back["term/trainer"]["id"] == "trainer-0"
        lease = target.grant_lease(5)
        assert target.campaign(KEYS.leader("trainer"), {"id": "trainer-1"}, lease)
        new_term = target.get(KEYS.leader("trainer")).create_revision
        assert new_term > back["weights/latest"]["term"], "a leader elected after the restore would be fenced"
        target.revoke_lease(lease)

        # Prompts claimed meanwhile: the older cursor is refused (they would be claimed twice) ...
        target.put(KEYS.prompts_cursor, {"next": 1280, "claims": {"env-0": [[1216, 1280]]}})
        older = cli("etcd", "restore", str(snap_file), "--etcd", fresh.endpoints_arg)
        assert older.returncode == Exit.REFUSED
        assert "prompts/cursor: the file's next 640 is older than etcd's 1280" in older.stderr
        assert "claimed twice" in older.stderr
        assert target.get(KEYS.prompts_cursor).value["next"] == 1280
        # ... and written with --force, while keys already equal are left as they are.
        forced = cli("etcd", "restore", str(snap_file), "--force", "--etcd", fresh.endpoints_arg)
        assert forced.returncode == Exit.OK, forced.stderr
        assert f"restored 1 keys of job {JOB}" in forced.stdout and f"{len(expected) - 1} already equal" in forced.stdout
        assert target.get(KEYS.prompts_cursor).value["next"] == 640
        target.close()
    store.close()


def test_an_unreachable_etcd_exits_3(tmp_path):
    from rlfleet.tools.run.etcd_local import free_port
    nobody = f"127.0.0.1:{free_port()}"
    result = cli("etcd", "snapshot", str(tmp_path / "s.json"), "--job", JOB, "--etcd", nobody)
    assert result.returncode == Exit.ETCD_UNREACHABLE, result.stderr
    assert not (tmp_path / "s.json").exists()
    shown = cli("etcd", "members", "--etcd", nobody)
    assert shown.returncode == Exit.ETCD_UNREACHABLE and "unreachable" in shown.stderr, shown.stderr


def test_a_job_larger_than_one_transaction_is_restored_pacing_keys_first(tmp_path, etcd):
    from rlfleet.common.control import job_snapshot
    with EtcdStore(etcd.endpoints) as store:
        for i in range(200):
            store.put(KEYS.placement(f"h{i % 5}", "rollout", f"rollout-{i}"),
                      {"host": f"h{i % 5}", "role": "rollout", "id": f"rollout-{i}"})
        store.put(KEYS.prompts_cursor, {"next": 64, "claims": {}})
        store.put(KEYS.trainer_progress, {"version": 1, "consumed_groups": 60, "trained_groups": 60,
                                          "dropped_groups": 0, "received_groups": 60, "time": 1.0})
        expected = durable(store)
    snap_file = tmp_path / "big.json"
    assert cli("etcd", "snapshot", str(snap_file), "--etcd", etcd.endpoints_arg).returncode == Exit.OK
    with EtcdCluster(1) as fresh, EtcdStore(fresh.endpoints) as target:
        batches = job_snapshot.plan(target, job_snapshot.load(str(snap_file))).batches()
        assert [len(b) for b in batches] == [128, 74] and batches[0][:2] == ["prompts/cursor", "trainer/progress"]
        restored = cli("etcd", "restore", str(snap_file), "--etcd", fresh.endpoints_arg)
        assert restored.returncode == Exit.OK and "in 2 transaction(s)" in restored.stdout, restored.stderr
        assert durable(target) == expected


# -- member replacement under running daemons ----------------------------------------------
def etcdctl(endpoints: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["etcdctl", f"--endpoints={','.join(endpoints)}", "--dial-timeout=1s",
                           "--command-timeout=5s", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "ETCDCTL_API": "3"})


def members_by_name(cluster: EtcdCluster) -> dict:
    return {v.name: v for v in read_members([m.endpoint for m in cluster.members if m.alive()], EtcdCredentials())}


def outages(log: Path) -> list[float]:
    """Seconds between each 'etcd unreachable' and the next 'etcd reachable again' in a
    daemon's JSON log (an outage still open counts up to now)."""
    spans, since = [], None
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        msg = str(entry.get("msg", ""))
        if msg.startswith("etcd unreachable") and since is None:
            since = entry["ts"]
        elif msg.startswith("etcd reachable again") and since is not None:
            spans.append(entry["ts"] - since)
            since = None
    return spans + ([time.time() - since] if since is not None else [])


def test_replacing_a_dead_member_learner_first_keeps_the_daemons_on_etcd(tmp_path, etcd3, capsys):
    store = EtcdStore(etcd3.endpoints)
    store.put(KEYS.spec, load_spec(write_spec(tmp_path, job=JOB)).to_dict())
    managers = [start_manager(tmp_path, etcd3, f"rm-{i}") for i in (1, 2)]
    try:
        def registered():
            recs = {kv.key.rsplit("/", 1)[1]: kv for kv in store.get_prefix(KEYS.role_members_prefix("resource-manager"))}
            return len(recs) == 2 and store.get(KEYS.leader("resource-manager")) and recs
        before = wait_for("a leader and a standby resource-manager", registered, timeout_s=90)
        leader_before = store.get(KEYS.leader("resource-manager"))

        # The worst case for the daemons: the member every one of them asks first (their
        # first endpoint) is also etcd's raft leader, so its death costs a raft election too.
        victim = etcd3.members[0]
        views = members_by_name(etcd3)
        raft_leader = next(v for v in views.values() if v.leader)
        if raft_leader.name != victim.name:
            moved = etcdctl([m.endpoint for m in etcd3.members], "move-leader", views[victim.name].id)
            assert moved.returncode == 0, moved.stderr
            wait_for("the raft leader moved to the victim", lambda: members_by_name(etcd3)[victim.name].leader)
        survivors = [m.endpoint for m in etcd3.members if m is not victim]
        phases: dict[str, float] = {}

        probe = EtcdStore(survivors, timeout_s=0.5)
        started = time.monotonic()
        etcd3.kill_member(victim)
        # A write needs a raft leader: the first one accepted ends the election.
        wait_for("a write accepted by the survivors", lambda: probe.put("/scratch/probe", 1), timeout_s=30, every_s=0.01)
        phases["kill -> writes accepted"] = time.monotonic() - started
        probe.close()
        shown = cli("etcd", "members", "--etcd", etcd3.endpoints_arg)
        assert shown.returncode == Exit.FAILURE and "unreachable" in shown.stdout, shown.stdout + shown.stderr
        assert "1 of 3 members do not answer (3 voters: quorum 2)" in shown.stderr

        t = time.monotonic()
        removed = etcdctl(survivors, "member", "remove", views[victim.name].id)
        assert removed.returncode == 0, removed.stderr
        phases["member remove"] = time.monotonic() - t
        etcd3.forget_member(victim)
        # The replacement takes the dead member's name and address: the daemons' endpoint
        # lists stay right, and they meet the learner there (it refuses their requests).
        new = etcd3.new_member(victim.name, victim.client_port, victim.peer_port)
        t = time.monotonic()
        # etcd accepts a member only when every voter has been connected to the one asked
        # for 5 s (--strict-reconfig-check): retried until it does.
        added = wait_for("member add --learner accepted", lambda: (r := etcdctl(
            survivors, "member", "add", new.name, f"--peer-urls={new.peer_url}", "--learner")).returncode == 0 and r,
            timeout_s=30, every_s=0.2)
        assert 'ETCD_INITIAL_CLUSTER_STATE="existing"' in added.stdout
        phases["member add --learner"] = time.monotonic() - t
        t = time.monotonic()
        etcd3.start_member(new, wait=False)
        learner = wait_for("the learner started and caught up", lambda: (v := members_by_name(etcd3).get(new.name))
                           and v.learner and v.answers and v.behind == 0 and v, timeout_s=60)
        phases["start learner -> caught up"] = time.monotonic() - t
        shown = cli("etcd", "members", "--etcd", etcd3.endpoints_arg)
        assert shown.returncode == Exit.OK, shown.stdout + shown.stderr
        assert any(line.split()[1:3] == [new.name, "learner"] for line in shown.stdout.splitlines()[1:]), shown.stdout
        t = time.monotonic()
        wait_for("member promote accepted (etcd refuses a learner not in sync)",
                 lambda: etcdctl(survivors, "member", "promote", learner.id).returncode == 0, timeout_s=30, every_s=0.2)
        phases["member promote"] = time.monotonic() - t
        wait_for("three voters, every one answering", lambda: (vs := members_by_name(etcd3)) and len(vs) == 3
                 and all(v.answers and not v.learner for v in vs.values()), timeout_s=30)
        window = time.monotonic() - started  # the daemons' 2 s leases lived through all of it
        phases["sum of the phases"] = sum(phases.values())

        final = cli("etcd", "members", "--output", "json", "--etcd", etcd3.endpoints_arg)
        assert final.returncode == Exit.OK, final.stderr
        assert sorted((v["name"], v["learner"], v["answers"]) for v in json.loads(final.stdout)) == \
               [(m.name, False, True) for m in sorted(etcd3.members, key=lambda m: m.name)]
        for m in etcd3.members:  # each answers a linearizable read on its own
            with EtcdStore([m.endpoint]) as one:
                assert one.get(KEYS.spec) is not None

        # The daemons: alive, still registered under the same lease, the same leader.
        for proc, _ in managers:
            assert proc.poll() is None, "a resource-manager died during the replacement"
        after = registered()
        assert after, "a resource-manager lost its registration"
        for member_id, kv in before.items():
            assert after[member_id].lease_id == kv.lease_id, f"{member_id} registered again (its lease expired)"
        leader_after = store.get(KEYS.leader("resource-manager"))
        assert (leader_after.value["id"], leader_after.create_revision) == \
               (leader_before.value["id"], leader_before.create_revision), "leadership changed hands"
        without = {proc.args[proc.args.index("--id") + 1]: outages(log) for proc, log in managers}
        with capsys.disabled():
            print("\netcd member replacement (3 members, heartbeat 10 ms, election 100 ms; "
                  "victim: the daemons' first endpoint and the raft leader):")
            for name, seconds in phases.items():
                print(f"  {name:28s} {seconds:6.2f} s")
            print(f"  kill -> 3 voters, with the checks  {window:6.2f} s")
            print(f"  daemons without etcd: {without}")
        assert all(not spans for spans in without.values()), f"daemons lost etcd: {without}"
    finally:
        for proc, _ in managers:
            stop(proc)
        store.close()
