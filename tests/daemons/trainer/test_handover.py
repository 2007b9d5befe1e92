"""`rlfleet switchover trainer`: the leader finishes its step and checkpoints it before it
resigns, and the standby resumes from exactly that checkpoint (nothing re-trained, the
version never goes back). Real trainer processes, a real etcd, the tiny torch model."""

from __future__ import annotations

import json
import subprocess
import sys

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.tools.exit_codes import Exit
from tests.integration.helpers import stop, wait_for

from .test_daemon import JOB, address, group, member, metrics, send_all, setup  # noqa: F401 (fixture)


def test_switchover_checkpoints_and_the_standby_resumes_from_it(setup, etcd):  # noqa: F811
    start, store, tmp = setup
    a = start("trainer-a")
    sender = ReliableSender(address(store, "trainer-a", tmp / "trainer-a.log"), resend_after_s=0.5)
    send_all(sender, [st for p in range(6) for st in group(p)])  # 3 steps; checkpoint_every = 2
    wait_for("version 3 in trainer-a's record", lambda: member(store, "trainer-a").get("version") == 3, timeout_s=60)
    assert store.get(JobKeys(JOB).trainer_checkpoint).value["version"] == 2  # version 3 is not in a checkpoint yet
    start("trainer-b")
    wait_for("trainer-b a standby", lambda: member(store, "trainer-b").get("training") == "standby", timeout_s=60)
    a_lease = store.get(JobKeys(JOB).member("trainer", "trainer-a")).lease_id

    result = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "switchover", "trainer", "--to", "trainer-b",
                             "--job", JOB, "--etcd", etcd.endpoints_arg, "--output", "json", "--timeout", "60"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == Exit.OK, result.stdout + result.stderr
    out = json.loads(result.stdout)
    assert out["from"] == "trainer-a" and out["to"] == "trainer-b" and out["vacant_s"] >= 0, out
    # Handed over while trainer-a's lease lived (resigned, not expired; the gap's length is
    # tools/bench/switchover.py's figure).
    assert store.get(JobKeys(JOB).member("trainer", "trainer-a")).lease_id == a_lease
    assert store.lease_remaining(a_lease) > 0
    # The handover checkpoint: version 3, written by trainer-a before it resigned.
    assert store.get(JobKeys(JOB).trainer_checkpoint).value["version"] == 3
    assert "switchover to trainer-b: finishing the step and writing a checkpoint at version 3" in (
        tmp / "trainer-a.log").read_text()
    sender.close()

    sender = ReliableSender(address(store, "trainer-b", tmp / "trainer-b.log"), resend_after_s=0.5)
    assert "resumed at version 3 (the checkpoint's), 0 steps (0 groups) to re-train" in (tmp / "trainer-b.log").read_text()
    assert "trajectories" not in member(store, "trainer-a")["addresses"]
    wait_for("trainer-a a standby", lambda: member(store, "trainer-a").get("training") == "standby", timeout_s=10)
    send_all(sender, [st for p in range(6, 8) for st in group(p, 3)])  # one more step, by trainer-b
    wait_for("step 4", lambda: len(metrics(tmp)) == 4, timeout_s=60)
    assert [m["version"] for m in metrics(tmp)] == [1, 2, 3, 4]  # none re-trained, none went back
    sender.close()
    assert stop(a) == 0
