"""The trainer's parts in process, without sockets, etcd or a real learner (the spec
needs a model folder; nothing loads it): the intake's triage (what becomes of each
arrival), the intake's order (journal before ack), and the training step
(train -> journal -> publish -> checkpoint -> metrics line -> evaluate)."""

from __future__ import annotations

import json
import threading
from collections import Counter

import msgspec

from rlfleet.common.spec.job import parse_spec
from rlfleet.common.wire.messages import ScoredTrajectory
from rlfleet.daemons.trainer.intake import Intake, triage
from rlfleet.daemons.trainer.journal import ExperienceJournal
from rlfleet.daemons.trainer.metrics_log import MetricsLog
from rlfleet.daemons.trainer.progress import progress_record
from rlfleet.daemons.trainer.training import TrainerState, TrainingLoop

from .conftest import scored


def arrivals(*items):
    return [(st.trajectory.trajectory_id, st) for st in items]


def test_triage_takes_drops_and_refuses_as_the_contract_says():
    got = arrivals(
        scored(0, 0, 1.0), scored(0, 1, 0.0),               # p0: both new
        scored(0, 1, 0.0),                                  # the same id again in one batch
        scored(1, 0, 1.0),                                  # p1 already full in the journal
        scored(2, 0, 0.0, dropped_reason="env_error"),      # dropped upstream
        scored(3, 0, 1.0, tokens=(7, 999)),                 # outside the vocabulary
        scored(4, 0, 1.0),                                  # the journal has it already
    )
    nameless = scored(5, 0, 1.0)
    nameless = ScoredTrajectory(msgspec.structs.replace(nameless.trajectory, trajectory_id=""), 1.0)
    got.append(("", nameless))  # empty ids: refused for good
    squat = scored(6, 9, 1.0)  # p6-g9: no slot 9 in a group of 2 (a forged squat)
    future = scored(7, 0, 1.0, version=2**40)  # a version the trainer never made
    got += arrivals(squat, future)
    decided = triage(got, [False, False, False, False, False, False, True, False, False, False],
                     {"p1": 2}, group_size=2, vocab_size=38, max_version=5)
    assert [st.trajectory.trajectory_id for st in decided.new] == ["p0-g0", "p0-g1"]
    assert [(g, r) for g, r, _ in decided.drops] == [("p2", "env_error"), ("p3", "invalid"), ("p7", "invalid")]
    assert decided.ok == ["p0-g0", "p0-g1", "p0-g1", "p2-g0", "p4-g0"]
    assert decided.refused == [
        ("p1-g0", "group p1 already holds 2 trajectories"),
        ("p3-g0", "invalid: p3-g0 turn 0: token id 999 outside the vocabulary (size 38)"),
        ("", "trajectory_id and group_id must be non-empty"),
        ("p6-g9", "identity: trajectory_id 'p6-g9' is not p6-g<k> with 0 <= k < 2 "
                  "(task.group_size + env_host.redundant_samples)"),
        ("p7-g0", f"invalid: p7-g0 turn 0: weight_version {2**40} was never made (newest: 5)")]
    assert decided.counts == Counter(new=2, dropped=3, duplicate=2)


class Receiver:
    """Records acks, and what the journal held at the moment of each ack."""

    def __init__(self, journal: ExperienceJournal) -> None:
        self.journal, self.acks = journal, []

    def ack(self, ids, ok=True, error=""):
        self.acks.append((list(ids), ok, error, dict(self.journal.group_sizes())))


def test_intake_journals_before_it_acks_and_wakes_the_loop(tmp_path):
    woke = threading.Event()
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        intake = Intake(journal, bind_host="127.0.0.1", group_size=lambda: 2, vocab_size=38,
                        counts=Counter(), on_data=woke.set)
        receiver = Receiver(journal)
        intake.ingest(receiver, arrivals(scored(0, 0, 1.0), scored(0, 1, 1.0), scored(0, 2, 1.0)))
        assert receiver.acks[0] == (["p0-g0", "p0-g1"], True, "", {"p0": 2})  # journaled first
        assert receiver.acks[1][:3] == (["p0-g2"], False, "identity: trajectory_id 'p0-g2' is not p0-g<k> "
                                                          "with 0 <= k < 2 (task.group_size + env_host.redundant_samples)")
        assert woke.is_set() and intake.counts == Counter(new=2, refused=1)


class FakeLearner:
    """Learner's interface as the loop uses it: one version per train_step."""

    vocab_size = 38

    def __init__(self, refuse: bool = False) -> None:
        self.version, self.refuse, self.batches, self.model = 0, refuse, [], object()

    def train_step(self, batch):
        if self.refuse:
            raise ValueError("all advantages are NaN")
        self.batches.append(sorted(st.trajectory.trajectory_id for g in batch for st in g))
        self.version += 1
        return {"reward_mean": 0.5, "reward_std": 0.5, "loss": 0.1, "trajectories": 4,
                "groups": 2, "tokens": 8, "step_s": 0.01, "grad_norm": 1.0}

    def state_tensors(self, dtype="float32"):
        return {"w": self.version}


class Recorder:
    error = ""  # the Checkpointer's: no checkpoint failed

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def retry_due(self, version, every):
        return True

    def submit(self, version, tensors):
        self.calls.append(("publish", version))

    def save(self, version):
        self.calls.append(("checkpoint", version))
        return None  # as when leadership is not confirmed

    def due(self, version):
        return True

    def run(self, model, version, stop=None):
        self.calls.append(("evaluate", version))


def make_loop(tmp_path, model, journal, learner, recorder):
    spec = parse_spec({"job": {"name": "t"}, "model": {"path": str(model)}, "task": {"env": {"kind": "arithmetic"}, "group_size": 2},
                       "trainer": {"batch_size": 4, "max_steps": 5, "checkpoint_every": 1,
                                   "max_staleness": 1}})
    return TrainingLoop(spec=lambda: spec, journal=journal, learner=learner, publisher=recorder,
                        checkpointer=recorder, evaluator=recorder,  # type: ignore[arg-type]
                        metrics=MetricsLog(tmp_path / "metrics.jsonl"), state=TrainerState(),
                        wake=threading.Event())


def test_a_step_reads_like_the_algorithm(tmp_path, tiny_model):
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories([scored(p, k, 1.0) for p in (0, 1) for k in (0, 1)])
        learner, recorder = FakeLearner(), Recorder()
        loop = make_loop(tmp_path, tiny_model, journal, learner, recorder)
        loop.step(["p0", "p1"], Counter({0: 4}), wait_s=0.5)
        assert learner.batches == [["p0-g0", "p0-g1", "p1-g0", "p1-g1"]]
        assert set(journal.state.trained) == {"p0", "p1"}  # journaled ...
        assert recorder.calls == [("publish", 1), ("checkpoint", 1), ("evaluate", 1)]  # ... then on
        assert loop.state.version == 1 and loop.state.checkpoint_version == 0  # not saved
        line = json.loads((tmp_path / "metrics.jsonl").read_text())
        assert (line["step"], line["staleness"], line["trained_groups"], line["wait_s"]) == (1, {"0": 4}, 2, 0.5)
        assert progress_record(journal.state, loop.state.version) == {
            "version": 1, "consumed_groups": 2, "trained_groups": 2, "dropped_groups": 0,
            "received_groups": 2}


def test_a_refused_batch_is_dropped_whole_and_nothing_is_published(tmp_path, tiny_model):
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        journal.append_trajectories([scored(p, k, 1.0) for p in (0, 1) for k in (0, 1)])
        recorder = Recorder()
        loop = make_loop(tmp_path, tiny_model, journal, FakeLearner(refuse=True), recorder)
        loop.step(["p0", "p1"], Counter({0: 4}), wait_s=0.0)
        assert {g: r for g, (r, _) in journal.state.dropped.items()} == {"p0": "invalid", "p1": "invalid"}
        assert recorder.calls == [] and loop.state.version == 0
        assert not (tmp_path / "metrics.jsonl").exists()


def test_a_flood_of_refusals_is_answered_each_and_logged_once(tmp_path, caplog):
    """Every refused arrival gets its negative ack with the reason; the log gets one line
    per kind of refusal and interval (an insider sending a flood cannot flood the log)."""
    with ExperienceJournal(tmp_path / "j.bin", fsync=False) as journal:
        intake = Intake(journal, bind_host="127.0.0.1", group_size=lambda: 2, vocab_size=38,
                        counts=Counter(), on_data=lambda: None)
        receiver = Receiver(journal)
        with caplog.at_level("WARNING", logger="rlfleet.trainer"):
            intake.ingest(receiver, arrivals(*(scored(p, 7, 1.0) for p in range(50))))
        refused = [a for a in receiver.acks if not a[1]]
        assert len(refused) == 50 and all(a[2].startswith("identity: ") for a in refused)
        assert intake.counts["refused"] == 50
        assert [r.getMessage()[:15] for r in caplog.records] == ["refused p0-g7: "]


def test_redundant_samples_have_slots_and_the_first_g_make_the_group():
    """With env_host.redundant_samples a prompt launches G + R trajectories (p0-g0..g2 for
    G=2, R=1): a spare is no squat; the first G to arrive make the group, a later one is
    refused as before, and g3 has no slot at all."""
    got = arrivals(scored(0, 2, 1.0), scored(0, 0, 0.0), scored(0, 1, 1.0), scored(0, 3, 1.0))
    decided = triage(got, [False] * 4, {}, group_size=2, vocab_size=38, launched=3)
    assert [st.trajectory.trajectory_id for st in decided.new] == ["p0-g2", "p0-g0"]
    assert [(k, why[:40]) for k, why in decided.refused] == [
        ("p0-g1", "group p0 already holds 2 trajectories"),
        ("p0-g3", "identity: trajectory_id 'p0-g3' is not p")]
