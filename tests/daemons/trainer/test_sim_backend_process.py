"""The sim trainer backend in the real daemons: a trainer process and a relay process
against a real etcd. Trajectories go in as the reward-host sends them; versions advance
at the modeled pace, real bytes reach the master relay (weights/latest moves with them),
and a trainer killed with -9 resumes exactly as the torch trainer does."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import RelayMaster, WeightsLatest
from rlfleet.common.wire.reliable import ReliableSender
from tests.integration.helpers import wait_for

from .conftest import claim_prompts, send_groups, sim_fleet

JOB = "simt"
WEIGHT_MIB = 4
SPEC = f"""\
group_size = 2

[trainer]
batch_size = 4
checkpoint_every = 2
max_steps = 100

[trainer.backend]
kind = "sim"
time_scale = 0.05      # a step of 1 model second + its tokens sleeps ~50 ms
fixed_s = 1.0
tokens_per_s = 1000.0
weight_mib = {WEIGHT_MIB}

[relay]
chunk_mib = 1
"""


@pytest.fixture
def fleet(tmp_path, etcd):
    with sim_fleet(tmp_path, etcd, JOB, SPEC) as (start, store):
        yield start, store, tmp_path


def metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trainer_address(store: EtcdStore, member_id: str, log: Path) -> str:
    claim_prompts(store, JOB)

    def addr() -> str | None:
        kv = store.get(JobKeys(JOB).member("trainer", member_id))
        return (kv.value.get("addresses") or {}).get("trajectories") if kv else None
    return wait_for(f"{member_id} serving trajectories (log: {log})", addr, timeout_s=30)


def latest(store: EtcdStore) -> int:
    record = WeightsLatest.read(store, JobKeys(JOB))
    return record.version if record is not None else -1


def test_sim_trainer_publishes_real_bytes_through_the_relay_and_resumes(fleet):
    start, store, tmp = fleet
    keys = JobKeys(JOB)
    start("relay", "relay-a")
    wait_for("relay-a to become master",
             lambda: (m := RelayMaster.read(store, keys)) is not None and m.id == "relay-a")
    a = start("trainer", "trainer-a")
    sender = ReliableSender(trainer_address(store, "trainer-a", tmp / "trainer-a.log"),
                            resend_after_s=0.5)

    # -- three steps: versions 1..3 at the modeled pace, each published whole ---------
    send_groups(sender, range(6))
    wait_for("3 steps in metrics.jsonl", lambda: len(metrics(tmp)) == 3)
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3]
    model_s = 1.0 + 22 / 1000.0
    for line in m:
        assert (line["tokens"], line["batch_tokens"], line["reward_mean"], line["loss"]) == (10, 22, 0.5, 0.0)
        assert line["model_step_s"] == pytest.approx(model_s)
        assert line["step_s"] >= 0.05 * model_s - 1e-3  # slept at least the modeled time
    assert [x["staleness"] for x in m] == [{"0": 4}, {"1": 4}, {"2": 4}]
    wait_for("weights/latest at version 3", lambda: latest(store) == 3, timeout_s=20)
    record = WeightsLatest.read(store, keys)
    assert record is not None and record.bytes == WEIGHT_MIB << 20 and record.master == "relay-a"
    assert "held-out evaluation off: the sim trainer backend has no policy to generate with" in (
        tmp / "trainer-a.log").read_text()

    # -- kill -9 after the step-2 checkpoint: the next trainer resumes at version 2 ----
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    sender.close()
    start("trainer", "trainer-b")
    sender = ReliableSender(trainer_address(store, "trainer-b", tmp / "trainer-b.log"),
                            resend_after_s=0.5)
    log_b = (tmp / "trainer-b.log").read_text()
    assert "resumed at version 2 (the checkpoint's), 1 steps (2 groups) to re-train up to version 3, 2 pending groups" in log_b
    # Step 3 made again from its original batch (not published: the relay holds version 3),
    # then the two new groups: version 4; weights/latest never goes back.
    send_groups(sender, range(6, 8), version=3)
    wait_for("2 more steps", lambda: len(metrics(tmp)) == 5)
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3, 3, 4] and m[3]["replayed"]
    assert m[3]["staleness"] == {"2": 4}
    wait_for("weights/latest at version 4", lambda: latest(store) == 4, timeout_s=20)

    sender.close()
