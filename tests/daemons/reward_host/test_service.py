"""RewardService in process, over real sockets: dedup, pass-through, ack only after the trainer."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rlfleet.common.log_throttle import LogThrottle
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender
from rlfleet.daemons.reward_host.service import RewardService
from rlfleet.daemons.reward_host.workers import RewardPool
from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import wait_for

from .fakes import FakeTrainer, trajectory


@pytest.fixture
def service():
    receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=Trajectory, name="rh-test")
    pool = RewardPool(1, 5.0)
    svc = RewardService(receiver=receiver, pool=pool, task_name="arithmetic", task_kwargs={},
                        resend_after_s=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=svc.run, args=(stop,), daemon=True)
    thread.start()
    # Tests count re-sends (resend_after_s=0.5): a worker still importing would make the
    # first copy wait long enough to be sent twice, so they start with the worker ready.
    wait_for("the reward worker to be ready", lambda: pool.ready >= 1, timeout_s=30, every_s=0.02)
    yield svc
    stop.set()
    thread.join(5)
    pool.close()
    receiver.close()


@pytest.fixture
def trainer():
    t = FakeTrainer()
    yield t
    t.close()


def acked_ids(sender: ReliableSender, keys: list[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while sender.pending() and time.monotonic() < deadline:
        sender.poll(0.05)
    return sender.pending() == 0


def test_scores_forwards_and_acks_only_after_the_trainer(service, trainer):
    task = get_task("arithmetic")
    prompts = task.make_prompts("train", 6, seed=2)
    sender = ReliableSender(service.receiver.endpoint, resend_after_s=0.5)
    trajs = [trajectory(p, i, 0, p.answer if i % 2 else "0") for i, p in enumerate(prompts)]
    for t in trajs:
        sender.send(t.trajectory_id, t)
    # No trainer yet: scored trajectories are held, so the env-host is not acked.
    assert not acked_ids(sender, [], 1.5)
    assert sender.pending() == 6 and service.in_flight == 6

    service.set_trainer(trainer.address)
    assert acked_ids(sender, [], 10.0)
    got = trainer.unique()
    assert set(got) == {t.trajectory_id for t in trajs}
    for i, p in enumerate(prompts):
        s = got[f"p{i}-g0"]
        assert s.reward == task.reward(p, [s.trajectory.turns[0].action]) == (1.0 if i % 2 else 0.0)
        assert s.reward_error == ""
    assert service.in_flight == 0 and service.stats["scored"] == 6
    sender.close()


def test_duplicates_are_not_scored_twice_and_every_sender_is_acked(service, trainer):
    service.set_trainer(trainer.address)
    p = get_task("arithmetic").make_prompts("train", 1)[0]
    t = trajectory(p, 0, 0, p.answer)
    # No resend of its own while the (possibly still starting) worker scores: the one
    # duplicate below is the restarted env-host's copy, whatever the machine's load.
    first = ReliableSender(service.receiver.endpoint, resend_after_s=30.0)
    first.send(t.trajectory_id, t)
    assert acked_ids(first, [], 10.0)
    # The same trajectory again, from a restarted env-host (a new socket identity).
    again = ReliableSender(service.receiver.endpoint, resend_after_s=0.5)
    again.send(t.trajectory_id, t)
    assert acked_ids(again, [], 10.0)
    assert len(trainer.copies) == 1  # answered from memory, not forwarded again
    assert service.stats["duplicates"] == 1 and service.stats["scored"] == 1
    first.close()
    again.close()


def test_dropped_pass_through_and_bad_input_is_scored_zero_with_a_reason(service, trainer):
    service.set_trainer(trainer.address)
    p = get_task("arithmetic").make_prompts("train", 1)[0]
    dropped = trajectory(p, 0, 0, p.answer, dropped="env_error")
    no_prompt = trajectory(p, 0, 1, p.answer, with_prompt=False)
    sender = ReliableSender(service.receiver.endpoint, resend_after_s=0.5)
    for t in (dropped, no_prompt):
        sender.send(t.trajectory_id, t)
    assert acked_ids(sender, [], 10.0)
    got = trainer.unique()
    assert got["p0-g0"].trajectory.dropped_reason == "env_error"
    assert (got["p0-g0"].reward, got["p0-g0"].reward_error) == (0.0, "")
    assert got["p0-g1"].reward_error == ("no prompt in the trajectory "
                                         "(a sender older than Trajectory.prompt)")
    assert got["p0-g1"].reward == 0.0
    assert service.stats["passed_dropped"] == 1 and service.stats["reward_errors"] == 1
    sender.close()


def test_a_trainer_refusal_reaches_the_env_host(service, trainer):
    service.set_trainer(trainer.address)
    trainer.refuse.add("p0-g0")
    p = get_task("arithmetic").make_prompts("train", 1)[0]
    sender = ReliableSender(service.receiver.endpoint, resend_after_s=0.5)
    sender.send("p0-g0", trajectory(p, 0, 0, p.answer))
    assert acked_ids(sender, [], 10.0)
    assert sender.failed == [("p0-g0", "trainer says no")]
    sender.close()


def test_reward_errors_are_all_counted_but_logged_once_per_interval(service, trainer, caplog):
    now = [0.0]
    service.error_log = LogThrottle(10.0, clock=lambda: now[0])
    service.set_trainer(trainer.address)
    p = get_task("arithmetic").make_prompts("train", 1)[0]
    sender = ReliableSender(service.receiver.endpoint, resend_after_s=0.5)
    caplog.set_level(logging.WARNING, logger="rlfleet.reward_host")

    def failed_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", "") == "reward_error"]

    for k in range(30):  # no prompt: each is a reward error (scored 0 with the reason)
        t = trajectory(p, 0, k, p.answer, with_prompt=False)
        sender.send(t.trajectory_id, t)
    assert acked_ids(sender, [], 10.0)
    assert service.stats["reward_errors"] == 30
    assert len(failed_lines()) == 1 and failed_lines()[0].suppressed == 0

    now[0] = 10.0  # an interval later: the next one is logged, saying how many were not
    t = trajectory(p, 0, 30, p.answer, with_prompt=False)
    sender.send(t.trajectory_id, t)
    assert acked_ids(sender, [], 10.0)
    line = failed_lines()[-1]
    assert len(failed_lines()) == 2 and line.suppressed == 29
    assert line.getMessage() == ("reward of p0-g30 failed: no prompt in the trajectory (a sender older "
                                 "than Trajectory.prompt) (29 more like this since the last such line, "
                                 "not logged)")
    sender.close()
