"""The real reward-host daemon (a subprocess) against real etcd and a fake trainer endpoint:
every trajectory reaches the trainer (after dedup, exactly once per id) with the right
reward, even when the reward-host is SIGKILLed mid-stream and restarted."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import wait_for

from .fakes import FakeTrainer, answered_pairs
from .harness import RewardHostHarness

JOB = "rhtest"
SPEC = """
[reward_host.backend]
kind = "rule_pool"
workers = 2
timeout_s = 5
"""


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, the killed daemon, cannot reap it).
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def trainer():
    t = FakeTrainer()
    yield t
    t.close()


def test_scored_exactly_once_per_id_across_a_sigkill(tmp_path, etcd, trainer):
    rh = RewardHostHarness(tmp_path, etcd, trainer, JOB, SPEC)
    task = get_task("arithmetic")
    prompts, trajs = answered_pairs(task, 150, seed=4)
    try:
        rh.start()
        held = threading.Event()
        # a steady stream: the first half, then the rest once the trainer holds its acks
        feeder = rh.feed(trajs, held)
        wait_for("some acks", lambda: rh.n_acked() >= 30, timeout_s=30, every_s=0.005)
        # Work in flight at the kill, however fast this machine is: the trainer stops acking,
        # so what the reward-host scores from now on waits in it, unacked, until the kill.
        trainer.hold.set()
        held_from = len(trainer.copies)
        held.set()
        wait_for("scored trajectories waiting for the trainer's ack",
                 lambda: len(trainer.copies) > held_from, timeout_s=30, every_s=0.005)
        workers = children(rh.proc.pid)
        assert len(workers) == 2
        os.kill(rh.proc.pid, signal.SIGKILL)  # mid-stream: some trajectories are in flight
        rh.proc.wait(10)
        trainer.hold.clear()
        assert rh.n_acked() < len(trajs), "the stream was over before the kill; nothing was tested"
        # Orphaned workers see their pipe close and exit by themselves.
        wait_for("orphaned reward workers to exit", lambda: not any(alive(w) for w in workers),
                 timeout_s=10)
        feeder.join(10)
        new_address = rh.start()
        wait_for("every trajectory acked", lambda: rh.n_acked() == len(trajs), timeout_s=40)

        got = trainer.unique()
        assert set(got) == {t.trajectory_id for t in trajs}  # none lost, none invented
        for t in trajs:
            s = got[t.trajectory_id]
            prompt = prompts[t.prompt_id]
            assert s.reward == task.reward(prompt, [t.turns[0].action]), t.trajectory_id
            assert s.reward_error == "" and s.trajectory == t
        member = rh.keys.member("reward-host", "rh-0")
        wait_for("counters published", lambda: rh.store.get(member).value.get("scored", 0) > 0, timeout_s=10)
        assert rh.store.get(member).value["addresses"]["trajectories"] == new_address
    finally:
        rh.close()
