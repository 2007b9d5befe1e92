"""The reward-host's decisions in process (what becomes of an arrival, which job goes
to which worker), without sockets; the last test checks the pool obeys its dispatch."""

from __future__ import annotations

import pytest

from rlfleet.common.wire.messages import Prompt, Trajectory
from rlfleet.daemons.reward_host.dispatch import Dispatch, FifoDispatch, arrival
from rlfleet.daemons.reward_host.workers import RewardJob, RewardPool

PROMPT = Prompt("arithmetic", "train", "u", "1+1", "2")


def job(key: str) -> RewardJob:
    return RewardJob(key, "arithmetic", {}, PROMPT, ["2"])


def drain(d: Dispatch, idle: list[int]) -> list[tuple[int, str]]:
    out = []
    while idle and (picked := d.pick(idle)) is not None:
        idle.remove(picked[0])
        out.append((picked[0], picked[1].key))
    return out


def test_fifo_gives_jobs_in_arrival_order_to_the_idle_workers_offered():
    d = FifoDispatch()
    assert d.pick([0, 1]) is None  # nothing queued
    for key in "abc":
        d.add(job(key))
    assert drain(d, [2, 0]) == [(2, "a"), (0, "b")]  # only workers offered, in that order
    assert len(d) == 1 and d.pick([]) is None  # no idle worker: the job waits
    assert drain(d, [1, 3]) == [(1, "c")] and len(d) == 0


def test_a_job_that_could_not_be_handed_over_goes_first_again():
    d = FifoDispatch()
    for key in "ab":
        d.add(job(key))
    worker, first = d.pick([0])
    d.requeue(first)  # the worker's pipe was gone
    assert drain(d, [1, 2]) == [(1, "a"), (2, "b")]


class Recording(Dispatch):
    """A dispatch the pool must obey: it records what it was offered."""

    def __init__(self) -> None:
        self.inner, self.offered = FifoDispatch(), []

    def add(self, job):
        self.inner.add(job)

    def requeue(self, job):
        self.inner.requeue(job)

    def pick(self, idle):
        self.offered.append(list(idle))
        return self.inner.pick(list(reversed(idle)))  # prefers the last idle worker

    def __len__(self):
        return len(self.inner)


@pytest.mark.timeout(60)
def test_the_pool_asks_its_dispatch_and_scores_what_it_picks():
    d = Recording()
    pool = RewardPool(2, 10.0, dispatch=d)
    try:
        for key in ("a", "b", "c"):
            pool.submit(job(key))
        got = {}
        while len(got) < 3:
            for outcome in pool.poll(30.0):
                got[outcome.key] = outcome
        assert {k: (o.reward, o.error) for k, o in got.items()} == {k: (1.0, "") for k in "abc"}
        # Asked each time a worker was free, and only ever offered the pool's two workers.
        assert len(d.offered) >= 3 and all(set(o) <= {0, 1} and o for o in d.offered)
        assert pool.queued == 0
    finally:
        pool.close()


def traj(tid: str = "p0-g0", *, task: str = "arithmetic", dropped: str = "",
         prompt: Prompt | None = PROMPT) -> Trajectory:
    return Trajectory(tid, 0, "p0", task, [], 0.0, {}, dropped, prompt=prompt)


@pytest.mark.parametrize(("key", "t", "verdict", "why"), [
    ("p0-g9", traj(), "refuse", "key 'p0-g9' is not the trajectory's id 'p0-g0'"),
    ("busy", traj("busy"), "wait", ""),
    ("done", traj("done"), "ack_again", ""),
    ("p0-g0", traj(dropped="env_error", prompt=None), "pass_dropped", ""),
    ("p0-g0", traj(task="frozenlake"), "score_zero",
     "trajectory of task 'frozenlake', this job scores 'arithmetic'"),
    ("p0-g0", traj(prompt=None), "score_zero",
     "no prompt in the trajectory (a sender older than Trajectory.prompt)"),
    ("p0-g0", traj(), "score", ""),
])
def test_what_becomes_of_an_arriving_trajectory(key, t, verdict, why):
    assert arrival(key, t, in_flight={"busy"}, acked={"done"}, task_name="arithmetic") == (verdict, why)


def test_the_fifo_kind_is_the_default_of_the_dispatch_registry():
    from rlfleet.common.spec.seams import REWARD_DISPATCH

    config = REWARD_DISPATCH.default_config()
    assert config.kind == "fifo"
    assert isinstance(REWARD_DISPATCH.build(config), FifoDispatch)


def test_ebf_dispatch_takes_the_batch_due_first_and_keeps_arrival_order_inside_it():
    from rlfleet.daemons.reward_host.dispatch import EbfDispatch

    due = {"a1": 30.0, "a2": 30.0, "b1": 20.0, "b2": 20.0}  # a batch's expected completion
    d = EbfDispatch(lambda j: due[j.key])
    for key in ("a1", "b1", "a2", "b2"):
        d.add(job(key))
    worker, first = d.pick([0])
    assert (worker, first.key) == (0, "b1")
    d.requeue(first)  # could not be handed over: first again
    assert drain(d, [3, 1, 2, 4]) == [(3, "b1"), (1, "b2"), (2, "a1"), (4, "a2")]
    plain = EbfDispatch()  # no priorities given: FIFO
    for key in "xyz":
        plain.add(job(key))
    assert drain(plain, [0, 1, 2]) == [(0, "x"), (1, "y"), (2, "z")]
