"""The real reward-host daemon (a subprocess) with the remote_http backend, against real
etcd, two reference endpoints (subprocesses) and a fake trainer endpoint: kill -9 of an
endpoint mid-request, then kill -9 of the reward-host with scored trajectories unacked.
Every trajectory still reaches the trainer exactly once per id (after dedup) with the
right reward, and no endpoint scores a trajectory id twice."""

from __future__ import annotations

import signal
import threading

import pytest

from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import wait_for

from .fakes import FakeTrainer, answered_pairs
from .harness import RewardHostHarness
from .test_remote import Endpoint

JOB = "rhremote"


@pytest.fixture
def trainer():
    t = FakeTrainer()
    yield t
    t.close()


@pytest.fixture
def endpoints():
    slow = Endpoint("--latency-s", "1.0")  # holds requests long enough to be killed mid-request
    fast = Endpoint("--latency-s", "0.01")
    yield slow, fast
    slow.close()
    fast.close()


def test_kill9_of_an_endpoint_and_of_the_reward_host_lose_nothing(tmp_path, etcd, trainer, endpoints):
    slow, fast = endpoints
    rh = RewardHostHarness(tmp_path, etcd, trainer, JOB, f"""
[reward_host.backend]
kind = "remote_http"
endpoints = ["{slow.url}", "{fast.url}"]
max_concurrency = 4
timeout_s = 10
total_timeout_s = 60
[reward_host.backend.retry]
backoff_base_s = 0.05
backoff_max_s = 0.5
[reward_host.backend.breaker]
failures = 2
open_s = 60
""")
    task = get_task("arithmetic")
    prompts, trajs = answered_pairs(task, 60, seed=5)
    try:
        rh.start()
        halfway = threading.Event()  # the second half once the reward-host has been killed
        feeder = rh.feed(trajs, halfway)
        wait_for("requests held by the slow endpoint", lambda: slow.stats()["in_flight"] >= 2,
                 timeout_s=30, every_s=0.01)
        slow.kill9()  # mid-request: its jobs are retried on the fast one
        after_kill = rh.n_acked()
        wait_for("acks again, through the fast endpoint", lambda: rh.n_acked() >= after_kill + 10,
                 timeout_s=30, every_s=0.01)
        # Scored trajectories unacked at the reward-host's kill: the trainer holds its acks.
        trainer.hold.set()
        held_from = len(trainer.copies)
        wait_for("scored trajectories waiting for the trainer's ack",
                 lambda: len(trainer.copies) > held_from, timeout_s=30, every_s=0.005)
        rh.proc.send_signal(signal.SIGKILL)
        rh.proc.wait(10)
        trainer.hold.clear()
        assert rh.n_acked() < len(trajs), "the stream was over before the kill; nothing was tested"
        halfway.set()
        rh.start()
        wait_for("every trajectory acked", lambda: rh.n_acked() == len(trajs), timeout_s=60)
        feeder.join(10)

        got = trainer.unique()
        assert set(got) == {t.trajectory_id for t in trajs}  # none lost, none invented
        for t in trajs:
            s = got[t.trajectory_id]
            assert s.reward == task.reward(prompts[t.prompt_id], [t.turns[0].action]), t.trajectory_id
            assert s.reward_error == "" and s.trajectory == t
        fast_stats = fast.stats()
        assert max(fast_stats["scorings"].values()) == 1  # idempotent by trajectory id
        # ... although the restarted reward-host asked again for what the trainer had not acked.
        assert max(fast_stats["asked"].values()) >= 2
    finally:
        rh.close()
