"""The ``pipeline`` reward backend in process: stages in order, errors named by stage,
EBF and FCFS stage queues, batches closed into history, scaling plans applied for real
(rule_pool processes started and stopped), and the spec's errors for bad stages."""

from __future__ import annotations

import json
import math
import time

import pytest

from rlfleet.common.spec.job import load_spec
from rlfleet.common.spec.seams import REWARD_BACKENDS
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender
from rlfleet.daemons.reward_host.backends import RewardBackend
from rlfleet.daemons.reward_host.pipeline.backend import PipelineBackend, held_count
from rlfleet.daemons.reward_host.pipeline.spec import PipelineConfig
from rlfleet.daemons.reward_host.service import RewardService, batch_of
from rlfleet.daemons.reward_host.workers import RewardJob, RewardPool
from rlfleet.daemons.tasks import get_task
from tests.common.spec.test_spec import REPO
from tests.integration.helpers import spec_errors, wait_for

from .fakes import trajectory

PROMPTS = get_task("arithmetic").make_prompts("train", 64, seed=5)


def job(i: int, batch: int = 0, right: bool = True, tenant: str = "t") -> RewardJob:
    p = PROMPTS[i % len(PROMPTS)]
    return RewardJob(f"p{i}-g0", "arithmetic", {}, p, [p.answer if right else "x"], tenant, batch)


def pipeline(*stages: dict, expected: int = 0, **keys) -> PipelineBackend:
    config = PipelineConfig.model_validate({"kind": "pipeline", "stages": list(stages), **keys})
    return REWARD_BACKENDS.build(config, batch_requests=expected)


def sim(name: str, median_s: float = 0.005, **keys) -> dict:
    return {"name": name, "timeout_s": keys.pop("timeout_s", 5.0), "cost": keys.pop("cost", 1.0),
            "min_workers": keys.pop("min_workers", 1), "max_workers": keys.pop("max_workers", 4),
            "worker": {"kind": "sim", "median_s": median_s, "sigma": keys.pop("sigma", 0.0), **keys}}


def collect(backend: PipelineBackend, n: int, timeout_s: float = 30.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += backend.poll(0.05)
    assert len(out) == n, f"{len(out)} outcomes of {n} in {timeout_s} s"
    return out


def test_a_trajectory_passes_every_stage_and_keeps_the_rule_reward_through_a_sim_stage():
    backend = pipeline({"name": "check", "timeout_s": 10.0, "max_workers": 2, "worker": {"kind": "rule_pool"}},
                       sim("judge"))
    try:
        for i in range(6):
            backend.submit(job(i, right=i % 2 == 0))
        out = {o.key: o for o in collect(backend, 6)}
        assert {k: (o.reward, o.error) for k, o in out.items()} == {
            f"p{i}-g0": (1.0 if i % 2 == 0 else 0.0, "") for i in range(6)}
        status = backend.status()
        assert status["check"]["ok"] == status["judge"]["ok"] == 6, status
    finally:
        backend.close()


def test_a_stage_timeout_or_error_ends_the_trajectory_naming_the_stage():
    backend = pipeline(sim("fast"), sim("slow", median_s=5.0, timeout_s=0.2),
                       sim("never", median_s=0.001))
    try:
        backend.submit(job(1))
        (outcome,) = collect(backend, 1)
        assert (outcome.reward, outcome.error) == (0.0, "stage 'slow': timeout after 0.2s")
        assert backend.status()["never"]["ok"] == 0 and backend.status()["slow"]["timeout"] == 1
    finally:
        backend.close()
    backend = pipeline(sim("judge", fail_rate=0.999))
    try:
        backend.submit(job(2))
        (outcome,) = collect(backend, 1)
        assert outcome.error == "stage 'judge': sim: injected failure"
    finally:
        backend.close()


@pytest.mark.parametrize("queue,expected", [
    ("ebf", ["p0-g0", "p1-g0", "p9-g0", "p10-g0", "p11-g0"]),   # batch 0's late job before batch 1's
    ("fcfs", ["p0-g0", "p9-g0", "p10-g0", "p1-g0", "p11-g0"]),
])
def test_stage_queues_order_earliest_batch_first_or_by_arrival(queue, expected):
    backend = pipeline(sim("judge", median_s=0.02, min_workers=1, max_workers=1), queue=queue, scaling="none")
    try:
        backend.submit(job(0, batch=0))  # starts at once; the rest wait for the one worker
        backend.submit(job(9, batch=1))
        backend.submit(job(10, batch=1))
        backend.submit(job(1, batch=0))
        backend.submit(job(11, batch=1))
        assert [o.key for o in collect(backend, 5)] == expected
    finally:
        backend.close()


def arrival_plan(backend: PipelineBackend):
    """The plan asked for by the batch just submitted, once the planner thread has it.
    Nothing else is asked until the next poll, so it is the newest plan."""
    return wait_for("the plan for the batch's arrival", lambda: backend.planning.idle() and (
        backend.planning.latest if backend.planning.latest.why == "batch arrival" else None), timeout_s=20)


def test_batches_close_into_history_and_the_plan_scales_a_stage_down_for_real():
    """Cold start: max_workers (no history). After batch 0 is done the planner sees
    how long its requests ran, and one fast batch does not need four sim workers (the
    timeout, 0.5 s, is inside D: a request that waits cannot make its batch late). The
    plan is computed on the planner thread and applied by the next poll."""
    backend = pipeline(sim("judge", median_s=0.01, min_workers=1, max_workers=4, timeout_s=0.5),
                       expected=4, max_extra_delay_s=2.0)
    try:
        assert backend.status()["judge"]["workers"] == 4
        for i in range(4):
            backend.submit(job(i, batch=0))
        collect(backend, 4)
        (closed,) = backend.closed_batches
        assert len(closed.record) == 4 and closed.extra_delay_s >= 0
        for i in range(4, 8):
            backend.submit(job(i, batch=1))
        assert arrival_plan(backend).plan.workers["judge"] < 4
        first = backend.poll(0.0)
        assert backend.status()["judge"]["workers"] < 4  # applied (or a newer plan, for fewer still)
        collect(backend, 4 - len(first))
        wait_for("every plan applied", lambda: backend.poll(0.01) == [] and backend.planning_settled(),
                 timeout_s=20)
        # asked: batch 0 done, batch 1's arrival, batch 1 done; each planned or superseded
        planning = backend.planning
        assert planning.asked == 3 and planning.asked == backend.planner.plans + planning.superseded
        summary = backend.summary()
        assert summary.startswith("stages: judge ") and "(ok 8, error 0, timeout 0;" in summary, summary
        assert "2 batches done" in summary or "1 batches done" in summary, summary
    finally:
        backend.close()


def test_a_job_that_outlives_its_history_asks_for_a_plan_once():
    """Batch 0's judge jobs take 10 ms, so from then on a judge job running longer than
    that is a long runner to the planner: each job of batch 1, which takes 0.8 s here,
    asks for a plan once (in one poll or several), and none is left watched."""
    backend = pipeline(sim("judge", median_s=0.01, min_workers=1, max_workers=4, timeout_s=2.0),
                       expected=2, max_extra_delay_s=2.0)
    try:
        for i in range(2):
            backend.submit(job(i, batch=0))
        collect(backend, 2)
        longest = backend.planner.long_running_after_s(backend.closed_batches[0].record.key, 0)
        assert longest is not None and longest < 0.8
        backend.stages[0].backend.latency_s = lambda: 0.8  # batch 1's jobs run long
        for i in range(2, 4):
            backend.submit(job(i, batch=1))
        asked = backend.planning.asked  # up to batch 1's arrival
        stage = backend.stages[0]
        assert stage.long_due and stage.long_due.keys() == stage.running.keys()  # as many as the plan runs
        collect(backend, 2)
        # each job turns long once (both in one poll, or one poll each), then batch 1 is done
        assert asked + 2 <= backend.planning.asked <= asked + 3
        assert backend.stages[0].long_due == {}
    finally:
        backend.close()


def test_a_stage_scales_up_at_once_and_down_only_after_the_hold():
    import collections

    plans: collections.deque = collections.deque()
    assert held_count(plans, 0.0, 4, hold_s=10) == 4
    assert held_count(plans, 3.0, 1, hold_s=10) == 4  # 4 was asked for 3 s ago: keep it
    assert held_count(plans, 5.0, 6, hold_s=10) == 6  # more: at once
    assert held_count(plans, 14.0, 2, hold_s=10) == 6  # 6 (t=5) is 9 s old
    assert held_count(plans, 15.5, 2, hold_s=10) == 2  # every higher plan is older than 10 s
    assert held_count(collections.deque(), 1.0, 3, hold_s=0) == 3


def test_with_a_hold_the_plan_after_one_fast_batch_keeps_the_workers():
    """The same two batches as above with a 10 s hold: the planner asks for fewer judges
    on batch 1's arrival, but the stage keeps its four for now."""
    backend = pipeline(sim("judge", median_s=0.01, min_workers=1, max_workers=4, timeout_s=0.5),
                       expected=4, max_extra_delay_s=2.0, scale_down_after_s=10.0)
    try:
        for i in range(4):
            backend.submit(job(i, batch=0))
        collect(backend, 4)
        for i in range(4, 8):
            backend.submit(job(i, batch=1))
        assert arrival_plan(backend).plan.workers["judge"] < 4  # the planner asks for fewer...
        collect(backend, 4)
        wait_for("every plan applied", lambda: backend.poll(0.01) == [] and backend.planning_settled(),
                 timeout_s=20)
        planned = [n for _, n in backend.stages[0].plans]
        assert min(planned) < 4, planned
        assert backend.status()["judge"]["workers"] == 4  # ...and the stage holds on
    finally:
        backend.close()


def test_an_idle_batch_closes_without_its_expected_count():
    backend = pipeline(sim("judge"), expected=100, batch_idle_s=0.1)
    try:
        backend.submit(job(0))
        collect(backend, 1)
        wait_for("the idle batch to close", lambda: backend.poll(0.02) == [] and backend.closed_batches,
                 timeout_s=5)
        assert len(backend.closed_batches[0].record) == 1
    finally:
        backend.close()


def test_rule_pool_resize_starts_and_stops_processes_letting_a_running_job_finish():
    pool = RewardPool(1, 10.0, reward_fn="tests.daemons.reward_host.scorers:faulty")
    try:
        pool.resize(3)
        wait_for("three ready workers", lambda: pool.poll(0.02) == [] and pool.ready == 3, timeout_s=60)
        p = PROMPTS[0]
        pool.submit(RewardJob("slow", "arithmetic", {}, p, ["slow"]))  # sleeps 0.3 s in its worker
        wait_for("the job to start", lambda: pool.poll(0.01) == [] and pool.busy == 1, timeout_s=10)
        pool.resize(0)
        assert len(pool.pids()) == 1  # the idle two stopped; the busy one runs on
        outcomes = []
        wait_for("the running job's outcome", lambda: outcomes.extend(pool.poll(0.05)) or outcomes, timeout_s=10)
        assert [(o.key, o.error) for o in outcomes] == [("slow", "")]
        wait_for("the last worker to stop", lambda: pool.poll(0.01) == [] and pool.pids() == [], timeout_s=5)
    finally:
        pool.close()


def test_scaling_none_holds_max_workers():
    backend = pipeline(sim("judge", min_workers=1, max_workers=3), scaling="none", expected=2)
    try:
        for b in range(3):
            for i in range(2):
                backend.submit(job(2 * b + i, batch=b))
            collect(backend, 2)
        assert backend.status()["judge"]["workers"] == 3 and backend.planner.plans == 0
        assert backend.planning is None  # nothing to plan: no planner thread
    finally:
        backend.close()


# ------------------------------------------------------------------ the spec
BASE = (REPO / "examples" / "arithmetic-multistage.toml").read_text().replace(
    'path = "../models/tiny-qwen2"', f'path = "{REPO / "models" / "tiny-qwen2"}"')


def errors_of(tmp_path, text: str) -> list[str]:
    return spec_errors(tmp_path / "bad.toml", text)


@pytest.mark.parametrize("old,new,error", [
    ('worker = { kind = "rule_pool" }', 'worker = { kind = "gpu" }',
     "reward_host.backend.stages[0].worker: kind: unknown kind 'gpu' (registered: 'remote_http', 'rule_pool', 'user_code', 'sim')"),
    ('worker = { kind = "rule_pool" }', 'worker = { kind = "pipeline" }',
     "reward_host.backend.stages[0].worker: kind 'pipeline' cannot serve a stage (a stage is one worker kind)"),
    ('worker = { kind = "rule_pool" }', 'worker = { kind = "rule_pool", workers = 3 }',
     "reward_host.backend.stages[0].worker: workers: set on the stage (timeout_s, min_workers, max_workers), "
     "which passes it down to its worker"),
    ("min_workers = 1\nmax_workers = 2", "min_workers = 3\nmax_workers = 2",
     "reward_host.backend.stages[0]: min_workers (3) above max_workers (2)"),
    ('name = "judge"', 'name = "check"',
     "reward_host.backend.stages: stage name 'check' used twice: each stage needs its own"),
    ("timeout_s = 2.0", "timeout_s = 0", "reward_host.backend.stages[1].timeout_s: must be > 0, got 0"),
    ("median_s = 0.15", "median_s = -1", "reward_host.backend.stages[1].worker: median_s: must be > 0, got -1"),
    ('queue = "ebf"', 'queue = "lifo"', "reward_host.backend.queue: must be one of 'ebf', 'fcfs', got 'lifo'"),
    ('queue = "ebf"', 'queue = "ebf"\nhistory_batches = 0',
     "reward_host.backend.history_batches: must be >= 1, got 0"),
])
def test_bad_stage_configs_are_spec_errors(tmp_path, old, new, error):
    assert old in BASE
    assert errors_of(tmp_path, BASE.replace(old, new, 1)) == [error]


def test_the_planner_keeps_history_batches_per_tenant():
    backend = pipeline(sim("judge"), history_batches=5)
    try:
        assert backend.planner.window == 5
    finally:
        backend.close()
    backend = pipeline(sim("judge"))
    try:
        assert backend.planner.window == 3  # the default: what the bench measured
        assert backend.planner.expect_late
    finally:
        backend.close()
    backend = pipeline(sim("judge"), expect_late=False)
    try:
        assert not backend.planner.expect_late
    finally:
        backend.close()


def test_the_example_round_trips_through_its_json_form():
    """The spec travels through etcd as JSON: each stage's worker keeps its own keys."""
    from rlfleet.common.spec.job import parse_spec

    spec = load_spec(REPO / "examples" / "arithmetic-multistage.toml")
    again = parse_spec(json.loads(json.dumps(spec.to_dict())))
    stages = again.reward_host.backend.stages
    assert [s.worker.kind for s in stages] == ["rule_pool", "sim"]
    assert stages[1].worker.median_s == 0.15 and again == spec


# ------------------------------------------------------------------ (tenant, batch) on each job
class Recording(RewardBackend):
    """Keeps what it is given; answers nothing."""

    def __init__(self) -> None:
        self.jobs: list[RewardJob] = []

    def submit(self, job: RewardJob) -> None:
        self.jobs.append(job)

    def poll(self, timeout: float = 0.0) -> list:
        return []

    def fds(self) -> list[int]:
        return []

    def next_deadline_in(self) -> float:
        return math.inf

    def close(self) -> None:
        pass


def test_the_service_tags_each_job_with_its_tenant_and_estimated_batch():
    """Prompt ids are the job-wide claim cursor: with 4 prompts per batch, ids 0-3 are
    batch 0, 4-7 batch 1 (docs/design/reward.md, the batch estimate)."""
    assert [batch_of(i, 4) for i in (0, 3, 4, 7, 8, 41)] == [0, 0, 1, 1, 2, 10]
    receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=Trajectory, name="rh-test")
    backend = Recording()
    svc = RewardService(receiver=receiver, pool=backend, task_name="arithmetic", task_kwargs={},
                        tenant="job-a", prompts_per_batch=4)
    sender = ReliableSender(receiver.endpoint, resend_after_s=0.2)
    try:
        for pid in (1, 5, 9):
            sender.send(f"p{pid}-g0", trajectory(PROMPTS[pid], pid, 0, "1"))
        # the sender re-sends from its poll (a first send may go before it is connected)
        wait_for("three jobs", lambda: sender.poll(0.0) >= 0 and svc.step(0.05) is None
                 and len(backend.jobs) == 3, timeout_s=10)
        assert [(j.key, j.tenant, j.batch) for j in backend.jobs] == [
            ("p1-g0", "job-a", 0), ("p5-g0", "job-a", 1), ("p9-g0", "job-a", 2)]
    finally:
        sender.close()
        svc.outbox.close()
        receiver.close()
