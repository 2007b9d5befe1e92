"""etcd compacts its history on its own (periodic auto-compaction), as Ansible's members do:
a job writes all day, and an etcd never compacted keeps every revision in memory and on
disk until its quota stops all writes (the soak saw etcd's RSS grow 10-35% in 2 hours)."""

from __future__ import annotations

import subprocess

from rlfleet.tools.run.etcd_local import COMPACTION_RETENTION, EtcdCluster

from .helpers import wait_for


def etcdctl(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["etcdctl", f"--endpoints={endpoint}", *args], capture_output=True, text=True,
                          env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, timeout=20)


def test_old_revisions_are_compacted_away(tmp_path):
    cluster = EtcdCluster(1, base_dir=tmp_path, compaction_retention="1s").start()
    try:
        [endpoint] = cluster.endpoints
        for i in range(3):
            assert etcdctl(endpoint, "put", "/k", str(i)).returncode == 0
        first = etcdctl(endpoint, "get", "/k", "--rev=2", "--print-value-only")
        assert first.returncode == 0 and first.stdout.strip() == "0"  # still kept right after

        def compacted() -> bool:
            etcdctl(endpoint, "put", "/tick", "x")  # compaction needs newer revisions to keep
            got = etcdctl(endpoint, "get", "/k", "--rev=2")
            return got.returncode != 0 and "compacted" in got.stderr
        wait_for("etcd compacting revision 2", compacted, timeout_s=30, every_s=0.5)
        # The latest value is never compacted away.
        assert etcdctl(endpoint, "get", "/k", "--print-value-only").stdout.strip() == "2"
    finally:
        cluster.stop()


def test_every_local_etcd_compacts_by_default(etcd):
    cmdline = open(f"/proc/{etcd.members[0].proc.pid}/cmdline").read().split("\0")
    at = cmdline.index("--auto-compaction-retention")
    assert (cmdline[at - 1], cmdline[at + 1]) == ("periodic", COMPACTION_RETENTION)
