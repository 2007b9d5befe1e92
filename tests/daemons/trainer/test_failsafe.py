"""The trainer through an etcd outage (docs/operations/failsafe.md), with real processes.

A sim-backend trainer and a relay run against a 3-member etcd; two members are killed
(quorum lost: nobody can take the leader key) for longer than the lease TTL while the
trainer is mid-run. The trainer must go on from its in-memory state: no second resume
from the checkpoint, no step trained twice, versions increasing by one, one publisher.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import RelayMaster, WeightsLatest
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.wire.reliable import ReliableSender
from tests.integration.helpers import wait_for

from .conftest import claim_prompts, send_groups, sim_fleet

JOB = "fsafe"
TTL_S = 2.0  # FAST_SPEC's lease TTL
SPEC = """\
group_size = 2

[trainer]
batch_size = 4
checkpoint_every = 1000   # every step of the run is after the last checkpoint
max_steps = 100

[trainer.backend]
kind = "sim"
time_scale = 0.02
fixed_s = 1.0
tokens_per_s = 1000.0
weight_mib = 1

[relay]
chunk_mib = 1
"""


@pytest.fixture
def fleet(tmp_path, etcd3):
    # The test's own client: a short timeout, so reads during the outage fail fast.
    with sim_fleet(tmp_path, etcd3, JOB, SPEC, store_timeout_s=0.5) as (start, store):
        yield start, store, tmp_path, etcd3


def metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def member(store: EtcdStore, member_id: str) -> dict:
    kv = store.get(JobKeys(JOB).member("trainer", member_id))
    return kv.value if kv else {}


def etcd_down(store: EtcdStore) -> bool:
    try:
        store.get(JobKeys(JOB).spec)
        return False
    except StoreUnavailable:
        return True


def test_quorum_loss_longer_than_the_ttl_loses_no_step(fleet):
    start, store, tmp, etcd3 = fleet
    keys = JobKeys(JOB)
    start("relay", "relay-a")
    wait_for("relay-a to become master",
             lambda: (m := RelayMaster.read(store, keys)) is not None and m.id == "relay-a")
    start("trainer", "trainer-a")
    log = tmp / "trainer-a.log"
    claim_prompts(store, JOB)
    address = wait_for(f"trainer-a serving trajectories (log: {log})",
                       lambda: member(store, "trainer-a").get("addresses", {}).get("trajectories"))
    sender = ReliableSender(address, resend_after_s=0.5)
    send_groups(sender, range(6))
    wait_for("3 steps published", lambda: (r := WeightsLatest.read(store, keys)) and r.version == 3)
    term = store.get(keys.leader("trainer")).create_revision

    # -- quorum lost for longer than the TTL; the trainer keeps training meanwhile -----
    lost_at = time.monotonic()
    for m in etcd3.members[1:]:
        etcd3.kill_member(m)
    wait_for("etcd to refuse requests", lambda: etcd_down(store), timeout_s=10)
    wait_for("the trainer to notice the outage", lambda: "etcd unreachable" in log.read_text(), timeout_s=10)
    send_groups(sender, range(6, 10), version=3)  # acked during the outage: the intake needs no etcd
    wait_for("2 steps trained during the outage", lambda: len(metrics(tmp)) == 5, timeout_s=30)
    # The outage itself is what is under test: it lasts past the TTL (the leader key's
    # lease would have expired by now had a quorum been there to expire it).
    wait_for("the outage to outlast the TTL", lambda: time.monotonic() - lost_at > 2.5 * TTL_S,
             timeout_s=10 * TTL_S)
    for m in etcd3.members[1:]:
        etcd3.start_member(m, wait=False)
    etcd3.wait_healthy()

    # -- back: the same reign goes on, publishing what it trained meanwhile -----------
    wait_for("trainer-a to lead again", lambda: member(store, "trainer-a").get("leader"), timeout_s=30)
    wait_for("version 5 published", lambda: (r := WeightsLatest.read(store, keys)) and r.version == 5,
             timeout_s=30)
    address_after = wait_for("trainer-a serving trajectories",
                             lambda: member(store, "trainer-a").get("addresses", {}).get("trajectories"))
    assert address_after == address  # the same worker, never stopped
    send_groups(sender, range(10, 14), version=5)
    wait_for("7 steps", lambda: len(metrics(tmp)) == 7, timeout_s=30)
    wait_for("version 7 published", lambda: (r := WeightsLatest.read(store, keys)) and r.version == 7,
             timeout_s=30)
    sender.close()

    text = log.read_text()
    assert text.count("resumed at version") == 1, "the trainer resumed from its checkpoint again"
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3, 4, 5, 6, 7]  # no step trained twice
    assert [x["trained_groups"] for x in m] == [2, 4, 6, 8, 10, 12, 14]
    assert "failsafe" in text and "continuing from in-memory state" in text
    latest = store.get(keys.weights_latest).value
    assert latest["term"] >= term  # stamped with the reign's fencing term
