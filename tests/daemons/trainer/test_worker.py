"""The training worker in-process, over real sockets and a real etcd: the
accounting invariant (every group trained, dropped with a reason, or pending),
the staleness bound, refusals, max_steps, publishing order and metrics."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import parse_spec
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.daemons.trainer import training as training_module
from rlfleet.daemons.trainer.worker import TrainingWorker
from tests.integration.helpers import wait_for

from .conftest import claim_prompts, scored


class Recorder:
    """Stands in for the relay: keeps what would have been pushed."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.names: set[str] = set()
        self.lock = threading.Lock()

    def publish(self, version: int, tensors: dict[str, np.ndarray]) -> None:
        with self.lock:
            self.versions.append(version)
            self.names = set(tensors)


def start_worker(tmp_path, etcd, tiny_model, paused=False, **trainer):
    spec = parse_spec({
        "job": {"name": "tw", "runs_dir": str(tmp_path / "runs")},
        "model": {"path": str(tiny_model)},
        "task": {"env": {"kind": "arithmetic"}, "group_size": 2},
        "trainer": {"batch_size": 4, "max_steps": 3, "checkpoint_every": 2, "max_staleness": 1,
                    "learning_rate": 1e-3, **trainer},
    })
    store = EtcdStore(etcd.endpoints)
    claim_prompts(store, "tw")
    recorder = Recorder()
    w = TrainingWorker(spec, store, JobKeys("tw"), publisher=recorder, paused=paused)
    w.start()
    endpoint = wait_for("the worker's socket", lambda: w.endpoint, timeout_s=60)
    sender = ReliableSender(endpoint, resend_after_s=0.5)
    return w, sender, recorder, store, tmp_path / "runs" / "tw"


@pytest.fixture
def worker(tmp_path, etcd, tiny_model, monkeypatch):
    monkeypatch.delenv("RLFLEET_RUN_DIR", raising=False)
    w, sender, recorder, store, run_dir = started = start_worker(tmp_path, etcd, tiny_model)
    yield started
    sender.close()
    w.stop()
    assert w.join(30)
    store.close()


def send(sender: ReliableSender, items) -> None:
    for st in items:
        sender.send(st.trajectory.trajectory_id, st)
    assert sender.flush(30), f"{sender.pending()} not acked"


def pair(p: int, version: int) -> list:
    return [scored(p, 0, 1.0, version=version), scored(p, 1, 0.0, tokens=(9, 10, 2), version=version)]


def test_every_group_is_trained_dropped_with_a_reason_or_pending(worker):
    w, sender, recorder, store, run_dir = worker
    send(sender, pair(0, 0) + pair(1, 0))
    wait_for("version 1", lambda: w.version == 1)
    send(sender, pair(2, 1) + pair(3, 0))  # p3: staleness 1 at version 1 = the bound, kept
    wait_for("version 2", lambda: w.version == 2)
    send(sender, [
        *pair(4, 0),  # staleness 2 > 1: dropped whole
        *pair(5, 2), *pair(6, 1),
        # dropped upstream; fresh, so the reason cannot depend on which copy arrives first (a
        # stale p7-g1 arriving alone, under load, would be evicted as staleness before g0)
        scored(7, 0, 0.0, dropped_reason="env_error", version=2), scored(7, 1, 1.0, version=2),
        scored(8, 0, 1.0, tokens=(7, 999)),  # token outside the vocabulary: dropped as invalid
        scored(9, 0, 0.0, reward_error="reward worker died"),
    ])
    wait_for("done at max_steps", lambda: w.status == "done")
    assert w.version == 3
    # After max_steps the worker stays up, still journaling and acking (nothing lost).
    send(sender, pair(10, 3))
    extra = scored(10, 2, 1.0)  # a third trajectory for a group of two: refused for good
    sender.send(extra.trajectory.trajectory_id, extra)
    assert sender.flush(30)
    # Refused, each with its reason: p8's content (its group dropped first), p10-g2's slot.
    assert sender.failed == [
        ("p8-g0", "invalid: p8-g0 turn 0: token id 999 outside the vocabulary (size 38)"),
        ("p10-g2", "identity: trajectory_id 'p10-g2' is not p10-g<k> with 0 <= k < 2 "
                   "(task.group_size + env_host.redundant_samples)")]
    send(sender, pair(0, 0))  # late duplicates of a trained group: acked, ignored

    state = w._journal.state
    assert set(state.trained) == {"p0", "p1", "p2", "p3", "p5", "p6"}
    assert {g: r for g, (r, _) in state.dropped.items()} == {
        "p4": "staleness", "p7": "env_error", "p8": "invalid", "p9": "reward_error"}
    assert state.dropped["p4"][1] == "p4-g0: staleness 2 > max_staleness 1"
    assert state.dropped["p8"][1] == "p8-g0 turn 0: token id 999 outside the vocabulary (size 38)"
    assert set(state.pending) == {"p10"}
    assert w.counts["duplicate"] >= 2 and w.counts["refused"] == 2  # (>=: resends under load)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert lines[1]["staleness"] == {"0": 2, "1": 2}
    assert lines[2]["staleness"] == {"0": 2, "1": 2} and lines[2]["trained_groups"] == 6
    assert lines[2]["dropped"]["staleness"] == 1
    for key in ("time", "reward_mean", "loss", "trajectories", "tokens", "tokens_per_s"):
        assert key in lines[0]
    # Published in order, every version, with HF names.
    wait_for("version 3 published", lambda: recorder.versions[-1:] == [3])
    assert recorder.versions == [1, 2, 3] and "model.embed_tokens.weight" in recorder.names
    # trainer/progress, which env-hosts pace their claims by: 6 groups trained + 4 dropped.
    wait_for("trainer/progress", lambda: (store.get(JobKeys("tw").trainer_progress) or None)
             and store.get(JobKeys("tw").trainer_progress).value["consumed_groups"] == 10)
    progress = store.get(JobKeys("tw").trainer_progress).value
    assert (progress["version"], progress["trained_groups"], progress["dropped_groups"]) == (3, 6, 4)
    ckpt = store.get(JobKeys("tw").trainer_checkpoint).value
    assert ckpt["version"] == 2 and ckpt["step"] == 2 and ckpt["path"].endswith("step-00000002")



def test_a_trainer_fed_only_stale_groups_publishes_its_version_again(tmp_path, etcd, tiny_model, monkeypatch):
    # The livelock this breaks: relay and rollout restarted empty serve version 0, all
    # they generate is dropped as stale, and without a step no new version is published.
    monkeypatch.delenv("RLFLEET_RUN_DIR", raising=False)
    monkeypatch.setattr(training_module, "REPUBLISH_AFTER_S", 1.0)
    w, sender, recorder, store, _ = start_worker(tmp_path, etcd, tiny_model, max_steps=10)
    try:
        send(sender, pair(0, 0) + pair(1, 0))
        wait_for("version 1", lambda: w.version == 1)  # before anything generated with it arrives
        send(sender, pair(2, 0) + pair(3, 1))
        wait_for("version 2", lambda: w.version == 2)
        wait_for("version 2 published", lambda: recorder.versions[-1:] == [2])
        for p in range(4, 40):  # stale (2 > max_staleness 1), one group every 0.1 s
            send(sender, pair(p, 0))
            time.sleep(0.1)
            if recorder.versions.count(2) > 1:
                break
        assert recorder.versions.count(2) >= 2, recorder.versions
        assert w.version == 2 and w.counts["republished"] >= 1
    finally:
        sender.close()
        w.stop()
        assert w.join(30)
        store.close()
