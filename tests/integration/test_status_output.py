"""`rlfleet status` into a pipe or a file: every id, address and problem whole.

Before, rich assumed 80 columns when stdout was not a terminal and cut cells
("resourc…"). The registrations here are written straight into a real etcd, so
the ids and addresses can be longer than any 80-column layout.
"""

from __future__ import annotations

import subprocess
import sys
import time

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.tools.exit_codes import Exit

LONG_ID = "resource-manager-on-a-machine-with-a-rather-long-name-0"
ADDRESS = "tcp://gpu-node-with-a-long-hostname.cluster.example.internal:45555"
MISSING = "rollout-placed-but-never-registered-with-a-long-identifier-7"


def test_status_into_a_pipe_keeps_ids_addresses_and_problems_whole(etcd):
    keys = JobKeys("wide")
    store = EtcdStore(etcd.endpoints)
    store.put(keys.member("resource-manager", LONG_ID),
              {"id": LONG_ID, "role": "resource-manager", "host": "gpu-node-with-a-long-hostname", "pid": 4242,
               "state": "running", "leader": True, "lease": "1", "addresses": {"requests": ADDRESS},
               "metrics": "http://127.0.0.1:9000/metrics", "started": time.time()})
    store.put(keys.leader("resource-manager"), {"id": LONG_ID, "since": time.time()})
    store.put(keys.placement("gpu-node-with-a-long-hostname", "rollout", MISSING),
              {"host": "gpu-node-with-a-long-hostname", "role": "rollout", "id": MISSING})
    proc = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", "wide",
                           "--etcd", etcd.endpoints_arg], capture_output=True, text=True, timeout=60)
    assert proc.returncode == Exit.FAILURE, proc.stdout + proc.stderr  # the missing rollout is a problem
    out = proc.stdout
    assert "…" not in out, out
    assert LONG_ID in out and ADDRESS in out
    assert f"problem: rollout/{MISSING} placed on gpu-node-with-a-long-hostname but not registered" in out
    # One row per member: the id is not folded over several lines either.
    assert any(LONG_ID in line and ADDRESS in line for line in out.splitlines()), out
    assert "\x1b[" not in out
