"""etcd maintenance under a live job (docs/etcd-maintenance.md), on real etcd processes
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

import pytest

from rlfleet.common.etcd_auth import EtcdCredentials
from rlfleet.common.etcd_store import EtcdStore
from rlfleet.common.keys import JobKeys
from rlfleet.common.spec import load_spec
from rlfleet.tools.etcd_cmd import read_members
from rlfleet.tools.etcd_local import EtcdCluster
from rlfleet.tools.exit_codes import Exit

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


def test_snapshot_of_an_unreachable_etcd_exits_3(tmp_path):
    from rlfleet.tools.etcd_local import free_port
    result = cli("etcd", "snapshot", str(tmp_path / "s.json"), "--job", JOB, "--etcd", f"127.0.0.1:{free_port()}")
    assert result.returncode == Exit.ETCD_UNREACHABLE, result.stderr
    assert not (tmp_path / "s.json").exists()
