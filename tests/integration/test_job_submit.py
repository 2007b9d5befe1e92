"""`rlfleet job submit` against a real etcd: a live job keeps its spec unless --force, and
a job an `rlfleet run` owns is never changed from outside (it overwrote them silently)."""

from __future__ import annotations

import subprocess
import sys

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.tools.exit_codes import Exit

from .helpers import REPO, write_spec

JOB = "submitted"


def submit(spec, etcd, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "job", "submit", str(spec),
                           "--etcd", etcd.endpoints_arg, *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_live_job_keeps_its_spec_unless_forced_and_an_owned_one_always(tmp_path, etcd):
    keys, store = JobKeys(JOB), EtcdStore(etcd.endpoints)
    first = write_spec(tmp_path, JOB, "group_size = 4\n")
    (tmp_path / "b").mkdir()
    second = write_spec(tmp_path / "b", JOB, "group_size = 8\n")
    try:
        ok = submit(first, etcd)
        assert ok.returncode == 0 and f"submitted {first} to {keys.spec}" in ok.stdout, ok.stderr
        assert submit(first, etcd).stdout.strip().endswith("already holds this spec: nothing to do")
        store.put(keys.member("trainer", "trainer-0"), {"id": "trainer-0", "role": "trainer"})

        refused = submit(second, etcd)
        assert refused.returncode == Exit.REFUSED, refused.stdout + refused.stderr
        assert "job 'submitted' is live (trainer/trainer-0 registered) and has a spec; --force replaces it" \
            in refused.stderr
        assert store.get(keys.spec).value["task"]["group_size"] == 4  # untouched

        forced = submit(second, etcd, "--force")
        assert forced.returncode == 0 and "replacing a live job's spec" in forced.stdout
        assert store.get(keys.spec).value["task"]["group_size"] == 8

        store.put(keys.owner, {"incarnation": "abc123", "host": "ops-1", "pid": 4242})
        owned = submit(first, etcd, "--force")
        assert owned.returncode == Exit.REFUSED
        assert "is run by `rlfleet run` on ops-1 (pid 4242, incarnation abc123)" in owned.stderr
        assert store.get(keys.spec).value["task"]["group_size"] == 8
    finally:
        store.close()
