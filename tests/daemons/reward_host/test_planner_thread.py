"""The scaling planner off the data path (planner_thread.py): the reward service goes on
dispatching and scoring while a plan is computed, a planner that raises keeps the last
plan, requests asked while the planner is busy collapse into the newest, and closing
joins the thread."""

from __future__ import annotations

import logging
import select
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender
from rlfleet.daemons.reward_host.pipeline.planner_thread import PlannerThread, PlanRequest
from rlfleet.daemons.reward_host.pipeline.scaling import History, ScalingPlan, ScalingPlanner
from rlfleet.daemons.reward_host.service import RewardService
from tests.integration.helpers import wait_for

from .fakes import FakeTrainer, trajectory
from .test_pipeline import PROMPTS, collect, job, pipeline, sim

BLOCK_S = 10.0  # the slow plan's longest block; the test releases it well before


@pytest.fixture
def slow_plans(monkeypatch):
    """Every ScalingPlanner.plan blocks until ``release`` is set (at most BLOCK_S), then
    plans as usual. Patched on the class, so it holds for the backend's own planner
    wherever that planner runs (on the data path before this change, on its thread after)."""
    slow = SimpleNamespace(entered=threading.Event(), release=threading.Event(), left=threading.Event())
    original = ScalingPlanner.plan

    def plan(self, *args, **kwargs):
        slow.entered.set()
        slow.release.wait(BLOCK_S)
        slow.left.set()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ScalingPlanner, "plan", plan)
    yield slow
    slow.release.set()


def test_the_service_scores_and_forwards_while_a_plan_is_computed(slow_plans):
    """The real RewardService over a pipeline backend and real sockets. Batch 0 (prompt 0)
    closes into history and asks for a plan, which blocks; batch 1's trajectories are
    still dispatched to the judge, scored and delivered to the trainer meanwhile."""
    trainer = FakeTrainer()
    receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=Trajectory, name="rh-test")
    backend = pipeline(sim("judge", median_s=0.01, min_workers=1, max_workers=2), expected=2)
    svc = RewardService(receiver=receiver, pool=backend, task_name="arithmetic", task_kwargs={},
                        resend_after_s=0.5, tenant="job-a", prompts_per_batch=1)
    svc.set_trainer(trainer.address)
    stop = threading.Event()
    thread = threading.Thread(target=svc.run, args=(stop,), name="reward-service", daemon=True)
    thread.start()
    sender = ReliableSender(receiver.endpoint, resend_after_s=0.5)
    try:
        def delivered(*keys: str) -> bool:
            sender.poll(0.01)  # re-sends what went before the connection was up
            return set(keys) <= set(trainer.unique())

        for k in range(2):  # batch 0: prompt 0's group of two
            sender.send(f"p0-g{k}", trajectory(PROMPTS[0], 0, k, PROMPTS[0].answer))
        wait_for("batch 0 done and its plan started", lambda: delivered("p0-g0") and slow_plans.entered.is_set(),
                 timeout_s=20)
        for k in range(2):  # batch 1: its arrival asks for a plan too (the planner is busy)
            sender.send(f"p1-g{k}", trajectory(PROMPTS[1], 1, k, PROMPTS[1].answer))
        wait_for("batch 1 scored and delivered while the plan is blocked",
                 lambda: delivered("p0-g1", "p1-g0", "p1-g1") or slow_plans.left.is_set(), timeout_s=BLOCK_S - 2)
        assert not slow_plans.left.is_set(), "the trajectories were delivered only once the plan had finished"
        got = trainer.unique()
        assert all(got[k].reward_error == "" for k in ("p0-g1", "p1-g0", "p1-g1")), got
        assert svc.stats["scored"] == 4 and backend.status()["judge"]["ok"] == 4

        slow_plans.release.set()  # the plans then run: the newest request is planned
        wait_for("the plans computed", lambda: backend.planning.idle() and backend.planning.computed >= 1,
                 timeout_s=20)
        planning = backend.planning
        assert planning.asked >= 2 and planning.failures == 0
        assert planning.asked == planning.computed + planning.superseded
    finally:
        slow_plans.release.set()
        stop.set()
        thread.join(10)
        sender.close()
        backend.close()
        receiver.close()
        trainer.close()
    assert not thread.is_alive()
    assert not backend.planning.alive()  # close() joined the planner thread


def test_a_planner_that_raises_keeps_the_last_plan_and_scoring_goes_on(monkeypatch, caplog):
    failing = threading.Event()

    def plan(self, now, active, history=None):
        if failing.is_set():
            raise RuntimeError("planner bug")
        return ScalingPlan({"judge": 3}, "fixed for the test")

    monkeypatch.setattr(ScalingPlanner, "plan", plan)
    failures_before = REGISTRY.get_sample_value("rlfleet_reward_plan_failures_total") or 0.0
    backend = pipeline(sim("judge", median_s=0.01, min_workers=1, max_workers=4), expected=4)
    caplog.set_level(logging.INFO, logger="rlfleet.reward_host")
    try:
        for i in range(4):  # batch 0: cold start (max_workers), then history and a good plan
            backend.submit(job(i, batch=0))
        collect(backend, 4)
        wait_for("the plan applied", lambda: backend.poll(0.01) == [] and backend.planning_settled(), timeout_s=20)
        assert backend.status()["judge"]["workers"] == 3

        failing.set()
        for i in range(4, 8):  # batch 1: its arrival's plan raises...
            backend.submit(job(i, batch=1))
        wait_for("the arrival's plan to fail", lambda: backend.planning.failures == 1, timeout_s=20)
        out = collect(backend, 4)  # ...and scoring goes on; batch 1 done asks again, and fails again
        assert [o.error for o in out] == [""] * 4
        # (a batch 1 job slower than batch 0's slowest also asks, as a long runner, and fails)
        wait_for("every plan asked failed", lambda: backend.poll(0.01) == [] and backend.planning_settled()
                 and backend.planning.handled_seq == backend._decided, timeout_s=20)
        planning = backend.planning
        assert planning.failures >= 2 and planning.computed == 1  # batch 0's plan only
        assert planning.asked == planning.computed + planning.failures + planning.superseded
        assert backend.status()["judge"]["workers"] == 3  # the last good plan stays
        assert planning.alive() and planning.last_error == "RuntimeError: planner bug"
        assert REGISTRY.get_sample_value("rlfleet_reward_plan_failures_total") == failures_before + planning.failures
        assert backend.summary().endswith(f"({planning.failures} failed)"), backend.summary()
        logged = [r for r in caplog.records if r.getMessage().startswith("reward planner: plan for")]
        assert len(logged) == 1 and logged[0].exc_info is not None, logged  # once, with its traceback
    finally:
        backend.close()
    assert not backend.planning.alive()


def test_requests_asked_while_planning_collapse_into_the_newest():
    """The hand-off without a backend: a request not yet taken is replaced by a newer
    one; each result wakes the fd; the data path never waits (ask returns at once)."""
    started, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def plan(now, active, history):
        seen.append(now)
        if now == 1.0:
            started.set()
            release.wait(BLOCK_S)
        return ScalingPlan({"judge": int(now)}, f"at {now}")

    planning = PlannerThread(plan, name="test-planner")
    try:
        planning.ask(PlanRequest(1, 1.0, "first", (), History(1)))
        assert started.wait(10)
        planning.ask(PlanRequest(2, 2.0, "second", (), History(1)))
        planning.ask(PlanRequest(3, 3.0, "third", (), History(1)))
        assert planning.latest is None and not planning.idle()
        release.set()
        wait_for("the newest request planned", lambda: planning.idle() and planning.handled_seq == 3, timeout_s=10)
        assert seen == [1.0, 3.0]  # the second never planned
        assert (planning.asked, planning.superseded, planning.computed) == (3, 1, 2)
        assert planning.latest.seq == 3 and planning.latest.plan.workers == {"judge": 3}
        assert planning.latest.why == "third" and planning.latest.seconds >= 0
        assert select.select([planning.fd()], [], [], 0)[0] == [planning.fd()]
        planning.drain_wakeups()
        assert select.select([planning.fd()], [], [], 0)[0] == []
    finally:
        release.set()
        planning.close()
    assert not planning.alive()
    planning.close()  # twice is harmless
