"""The ``pipeline`` reward backend at run time (spec: pipeline.py; docs/design/reward.md).

A RewardBackend like any other, driven from its owner's thread (the data path: the
reward service's thread, or the shared service's ``reward-scorer``), which ``submit``s a
RewardJob and ``poll``s outcomes. Inside, each trajectory goes through the stages in
order:

    submit ─► queue[0] ─► stage 0's backend ─► queue[1] ─► stage 1's backend ─► outcome
               (EBF|FCFS)  (≤ workers[0] jobs)   ...

- Per-stage queues (queues.py): EBF orders by the expected completion of the job's batch
  (the planner's ``expected_done_s``, fixed when queued), FCFS by arrival.
- A stage's backend is any reward backend kind (or ``sim``) and is never handed more
  jobs than the stage's current worker count, so the count is the stage's concurrency
  whatever the kind; ``resize`` lets a kind that owns workers follow it for real
  (rule_pool starts and stops processes). A stage's ``timeout_s`` is enforced here as
  well as passed down, so a kind that never answers still frees its slot.
- Batches (batches.py): jobs carry (tenant, batch); a plan (scaling.py) is asked for on
  each batch's first arrival, on each batch done, and when a running job outlives the
  planner's ``long_running_after_s`` for its stage (once per job and stage). Until a
  tenant has a finished batch (no history: the planner would see only the requests
  already here), every stage holds max_workers, decided at once. ``scaling = "none"``:
  max_workers always, and no planner thread.

Threads: the owner's, which alone touches everything here but the planner's plan; and
``reward-planner`` (planner_thread.py), which computes the plans. A plan takes up to
~1.5 s, so the data path never waits for one: it hands the planner an immutable
snapshot (the open batches, the history) and goes on scoring with the worker counts it
has; the plan's result wakes it through an fd in ``fds()``, and the next ``poll`` applies
it (counts clamped to [min_workers, max_workers], ``scale_down_after_s`` held) unless a
newer decision came first. Requests asked while the planner is busy collapse into the
newest one. A plan that raises keeps the counts the stages have (counted and logged).

Metrics (Prometheus, per stage): workers applied, busy, queue length, requests by outcome,
plan changes; per batch: the extra delay (the planner's own: planner_thread.py).
``status()`` is the short form the daemon publishes in its member registration.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import select
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from rlfleet.common.spec.seams import REWARD_BACKENDS
from rlfleet.daemons.reward_host.backends import RewardBackend
from rlfleet.daemons.reward_host.pipeline.batches import BatchTracker, ClosedBatch
from rlfleet.daemons.reward_host.pipeline.planner_thread import PlannerThread, PlanRequest
from rlfleet.daemons.reward_host.pipeline.queues import StageQueue, make_queue
from rlfleet.daemons.reward_host.pipeline.scaling import ScalingPlanner
from rlfleet.daemons.reward_host.pipeline.sim_worker import SimWorker
from rlfleet.daemons.reward_host.pipeline.spec import PipelineConfig, StageConfig
from rlfleet.daemons.reward_host.pipeline.stages import Pipeline, RequestKey, Stage
from rlfleet.daemons.reward_host.workers import RewardJob, RewardOutcome

log = logging.getLogger("rlfleet.reward_host")

STAGE_WORKERS = Gauge("rlfleet_reward_stage_workers", "Workers a reward stage holds (the plan applied)", ["stage"])
STAGE_BUSY = Gauge("rlfleet_reward_stage_busy", "Requests running at a reward stage", ["stage"])
STAGE_QUEUE = Gauge("rlfleet_reward_stage_queue_length", "Requests waiting for a reward stage", ["stage"])
STAGE_DONE = Counter("rlfleet_reward_stage_requests_total",
                     "Requests that left a reward stage, by outcome: ok, error, timeout", ["stage", "outcome"])
PLAN_CHANGES = Counter("rlfleet_reward_plan_changes_total",
                       "Scaling plans that changed a stage's worker count", ["stage"])
EXTRA_DELAY = Histogram("rlfleet_reward_batch_extra_delay_seconds",
                        "Per batch: completion minus its earliest completion T (DistRS Eq. 1-2)",
                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))

# A stage's worker kind for the planner's model (stages.WorkerKind: documentation only).
_MODEL_KIND = {"sim": "accelerator", "remote_http": "remote"}


def build_stage(stage: StageConfig) -> RewardBackend:
    """The stage's backend, holding max_workers (the cold start) with the stage's timeout:
    its kind's ``timeout_s`` and capacity (``workers``, ``concurrency``) come from the stage."""
    worker = stage.worker
    if worker.kind == "sim":
        return SimWorker(worker)  # type: ignore[arg-type]
    fields = type(worker).model_fields
    update: dict[str, Any] = {}
    if "timeout_s" in fields:
        update["timeout_s"] = stage.timeout_s
    for capacity in ("workers", "concurrency"):
        if capacity in fields:
            update[capacity] = stage.max_workers
    return REWARD_BACKENDS.build(worker.model_copy(update=update))  # type: ignore[no-any-return]


def held_count(plans: collections.deque[tuple[float, int]], now: float, planned: int,
               hold_s: float) -> int:
    """The worker count to apply: the largest plan of the last ``hold_s`` seconds, so a
    stage scales up at once and down only once the higher plans are that old. ``plans``
    (time, count), oldest first, is updated in place."""
    plans.append((now, planned))
    while plans and plans[0][0] < now - hold_s:
        plans.popleft()
    return max(n for _, n in plans)


@dataclasses.dataclass
class _Stage:
    config: StageConfig
    backend: RewardBackend
    queue: StageQueue
    workers: int
    running: dict[str, float] = dataclasses.field(default_factory=dict)  # key -> started at
    long_due: dict[str, float] = dataclasses.field(default_factory=dict)  # key -> when it turns long
    plans: collections.deque[tuple[float, int]] = dataclasses.field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        name = self.config.name
        self.gauges = (STAGE_WORKERS.labels(stage=name), STAGE_BUSY.labels(stage=name),
                       STAGE_QUEUE.labels(stage=name))
        self.done = {o: STAGE_DONE.labels(stage=name, outcome=o) for o in ("ok", "error", "timeout")}
        self.counts = dict.fromkeys(self.done, 0)
        self.changes = PLAN_CHANGES.labels(stage=name)


@dataclasses.dataclass
class TenantFigures:
    """One tenant's (job's) share of the pipeline: its batches done, their extra delay,
    and the plans applied that a batch of it was open for (the planner saw it)."""

    batches: int = 0
    extra_delay_sum_s: float = 0.0
    extra_delay_max_s: float = 0.0
    plans: int = 0

    def batch_done(self, extra_delay_s: float) -> None:
        self.batches += 1
        self.extra_delay_sum_s += extra_delay_s
        self.extra_delay_max_s = max(self.extra_delay_max_s, extra_delay_s)


class PipelineBackend(RewardBackend):
    def __init__(self, config: PipelineConfig, *, batch_requests: int = 0,
                 clock: Any = time.monotonic) -> None:
        self.config, self._clock = config, clock
        self.model = Pipeline(tuple(Stage(s.name, _MODEL_KIND.get(s.worker.kind, "cpu"),  # type: ignore[arg-type]
                                          s.cost, s.timeout_s) for s in config.stages))
        self.planner = ScalingPlanner(self.model, max_delay_s=config.max_extra_delay_s,
                                      timeout_aware=config.scaling == "timeout_aware",
                                      policy=config.queue, window=config.history_batches,
                                      expect_late=config.expect_late)
        self.batches = BatchTracker(self.model, expected=batch_requests, idle_s=config.batch_idle_s)
        self.stages: list[_Stage] = []
        self.planning: PlannerThread | None = None
        try:
            for s in config.stages:
                self.stages.append(_Stage(s, build_stage(s), make_queue(config.queue), s.max_workers))
            if config.scaling != "none":
                self.planning = PlannerThread(self.planner.plan)
        except BaseException:
            self.close()
            raise
        # Scaling decisions are numbered; a plan is applied only if it answers a newer one
        # than the counts the stages hold (a max_workers decision overtakes a plan in flight).
        self._decided = self._applied = 0
        self._jobs: dict[str, tuple[RewardJob, float]] = {}  # key -> (job, reward so far)
        self._out: list[RewardOutcome] = []
        self._history: set[str] = set()  # tenants with a finished batch
        self.closed_batches: list[ClosedBatch] = []  # the last few, for tests and status
        self.batches_done, self.extra_delay_sum_s, self.extra_delay_max_s = 0, 0.0, 0.0
        self.tenants: dict[str, TenantFigures] = {}  # several jobs may share one pipeline
        self.worker_seconds = [0.0] * len(self.stages)  # Σ workers held × time, per stage
        self._held_since = clock()
        self._publish()

    # -- RewardBackend ---------------------------------------------------------------------
    def submit(self, job: RewardJob) -> None:
        now = self._clock()
        self._jobs[job.key] = (job, 0.0)
        if self.batches.arrive(RequestKey(job.tenant, job.batch, job.key), now):
            self._replan(now, "batch arrival")
        self._enqueue(0, job)
        self._apply_plan(now)
        self._pump(now)

    def poll(self, timeout: float = 0.0) -> list[RewardOutcome]:
        if timeout > 0 and not self._out:
            self._wait(min(timeout, self.next_deadline_in()))
        now = self._clock()
        if self.planning is not None:
            self.planning.drain_wakeups()
        for j, stage in enumerate(self.stages):
            for outcome in stage.backend.poll(0.0):
                if outcome.key in stage.running:  # else a late answer after our timeout
                    self._stage_outcome(j, outcome, now)
            for key, started in list(stage.running.items()):
                if now - started >= stage.config.timeout_s:
                    self._stage_outcome(j, RewardOutcome(key, 0.0, f"timeout after {stage.config.timeout_s:g}s"),
                                        now, timed_out=True)
        for closed in self.batches.close_idle(now):
            self._batch_done(closed, now)
        long = [key for s in self.stages for key, due in s.long_due.items() if due <= now]
        if long:
            for s in self.stages:
                s.long_due = {k: due for k, due in s.long_due.items() if due > now}
            self._replan(now, f"{len(long)} long-running request(s)")
        self._apply_plan(now)
        self._pump(now)
        self._publish()
        out, self._out = self._out, []
        return out

    def fds(self) -> list[int]:
        wake = [self.planning.fd()] if self.planning is not None else []
        return wake + [fd for s in self.stages for fd in s.backend.fds()]

    def next_deadline_in(self) -> float:
        now = self._clock()
        due = [self.batches.next_idle_in(now)]
        for s in self.stages:
            due.append(s.backend.next_deadline_in())
            due += [started + s.config.timeout_s - now for started in s.running.values()]
            due += [t - now for t in s.long_due.values()]
        return max(0.0, min(due))

    def close(self) -> None:
        if self.planning is not None:
            self.planning.close()  # joins the planner thread (after the plan in progress)
        for s in self.stages:
            s.backend.close()

    def expect(self, tenant: str, batch_requests: int) -> None:
        """A tenant's batches hold ``batch_requests`` trajectories (0: closed when idle);
        a shared service (shared_service.py) learns it from each tenant's requests."""
        if batch_requests > 0:
            self.batches.expected_by_tenant[tenant] = batch_requests
        else:
            self.batches.expected_by_tenant.pop(tenant, None)

    # -- what the daemon and tests read ---------------------------------------------------
    def summary(self) -> str:
        """One sentence for the daemon's exit line: what each stage did and cost, the
        batches' extra delay, the plans."""
        self._account(self._clock())
        stages = ", ".join(
            f"{s.config.name} {s.workers} workers (ok {s.counts['ok']}, error {s.counts['error']}, "
            f"timeout {s.counts['timeout']}; {ws:.0f} worker-s)" for s, ws in zip(self.stages, self.worker_seconds))
        mean = self.extra_delay_sum_s / self.batches_done if self.batches_done else 0.0
        failed = self.planning.failures if self.planning is not None else 0
        return (f"stages: {stages}; {self.batches_done} batches done, extra delay mean {mean:.2f} s, "
                f"max {self.extra_delay_max_s:.2f} s; {self.planner.plans} plans"
                + (f" ({failed} failed)" if failed else ""))

    def planning_settled(self) -> bool:
        """Every plan asked for is computed (or failed) and the newest applied; call it
        from the owner's thread (tests wait on it between polls)."""
        if self.planning is None:
            return True
        latest = self.planning.latest
        return self.planning.idle() and (latest is None or latest.seq <= self._applied)

    def status(self) -> dict[str, dict[str, int]]:
        return {s.config.name: {"workers": s.workers, "busy": len(s.running), "queued": len(s.queue),
                                **s.counts} for s in self.stages}

    # -- internals ---------------------------------------------------------------------------
    def _enqueue(self, j: int, job: RewardJob) -> None:
        batch = self.batches.batch_of(job.key)
        self.stages[j].queue.push(job, self.planner.expected_done_s(batch, self.batches.arrived_at(batch)))

    def _pump(self, now: float) -> None:
        """Hand queued jobs to stages with free workers, queue order."""
        for j, stage in enumerate(self.stages):
            while len(stage.queue) and len(stage.running) < stage.workers:
                job = stage.queue.pop()
                stage.running[job.key] = now
                self.batches.start(job.key, j, now)
                after = self.planner.long_running_after_s(self.batches.batch_of(job.key), j)
                if after is not None and self.config.scaling != "none":
                    stage.long_due[job.key] = now + after
                stage.backend.submit(job)

    def _stage_outcome(self, j: int, outcome: RewardOutcome, now: float, timed_out: bool = False) -> None:
        stage = self.stages[j]
        started = stage.running.pop(outcome.key)
        stage.long_due.pop(outcome.key, None)
        job, reward = self._jobs[outcome.key]
        kind = "timeout" if timed_out or outcome.error.startswith("timeout") else (
            "error" if outcome.error else "ok")
        stage.done[kind].inc()
        stage.counts[kind] += 1
        seconds = min(now - started, stage.config.timeout_s)
        last = outcome.error or j == len(self.stages) - 1
        self.batches.stage_done(outcome.key, seconds, queued_next=not last)
        if stage.config.worker.kind != "sim":
            reward = outcome.reward
        if last:
            error = f"stage {stage.config.name!r}: {outcome.error}" if outcome.error else ""
            self._finish(RewardOutcome(outcome.key, 0.0 if error else reward, error), now)
        else:
            self._jobs[outcome.key] = (job, reward)
            self._enqueue(j + 1, job)

    def _finish(self, outcome: RewardOutcome, now: float) -> None:
        job, _ = self._jobs.pop(outcome.key)
        arrived = self.batches.arrived_at(self.batches.batch_of(job.key))
        self._out.append(RewardOutcome(outcome.key, outcome.reward, outcome.error, now - arrived))
        closed = self.batches.finish(outcome.key, now)
        if closed is not None:
            self._batch_done(closed, now)

    def _batch_done(self, closed: ClosedBatch, now: float) -> None:
        EXTRA_DELAY.observe(closed.extra_delay_s)
        self.batches_done += 1
        self.extra_delay_sum_s += closed.extra_delay_s
        self.extra_delay_max_s = max(self.extra_delay_max_s, closed.extra_delay_s)
        self.closed_batches = (self.closed_batches + [closed])[-100:]
        self._tenant(closed.record.key.tenant).batch_done(closed.extra_delay_s)
        self.planner.add_history(closed.record)
        self._history.add(closed.record.key.tenant)
        self._replan(now, f"batch {closed.record.key.tenant}/{closed.record.key.batch} done")

    def _replan(self, now: float, why: str) -> None:
        """Ask the planner thread for Algorithms 2 then 1 over the open batches, or, while
        a tenant has no history, hold max_workers at once. Never waits for a plan."""
        if self.planning is None:
            return
        active = self.batches.active(now)
        self._decided += 1
        if any(a.key.tenant not in self._history for a in active):
            self._applied = self._decided
            self._set_counts(now, {s.config.name: s.config.max_workers for s in self.stages}, why,
                             "a tenant without history: max_workers")
        else:
            self.planning.ask(PlanRequest(self._decided, now, why, tuple(active), self.planner.history))

    def _apply_plan(self, now: float) -> None:
        """The planner thread's last plan, if it answers a newer decision than the counts held."""
        result = self.planning.latest if self.planning is not None else None
        if result is None or result.seq <= self._applied:
            return
        self._applied = result.seq
        for tenant in result.tenants:
            self._tenant(tenant).plans += 1
        self._set_counts(now, result.plan.workers, result.why,
                         f"{result.plan.why}; planned in {result.seconds:.2f} s")

    def _set_counts(self, now: float, counts: dict[str, int], why: str, reason: str) -> None:
        changed = []
        self._account(now)
        for stage in self.stages:
            c = stage.config
            planned = min(max(counts.get(c.name, c.max_workers), c.min_workers), c.max_workers)
            n = held_count(stage.plans, now, planned, self.config.scale_down_after_s)
            if n != stage.workers:
                changed.append(f"{c.name} {stage.workers}->{n}")
                stage.workers = n
                stage.changes.inc()
                stage.backend.resize(n)
        if changed:
            log.info("reward scaling on %s: %s (%s)", why, ", ".join(changed), reason,
                     extra={"event": "reward_plan"})

    def _tenant(self, tenant: str) -> TenantFigures:
        figures = self.tenants.get(tenant)
        if figures is None:
            figures = self.tenants[tenant] = TenantFigures()
        return figures

    def _account(self, now: float) -> None:
        """Charge every stage its workers held since the last change (busy or idle, as
        the simulator charges them)."""
        for j, s in enumerate(self.stages):
            self.worker_seconds[j] += s.workers * (now - self._held_since)
        self._held_since = now

    def _publish(self) -> None:
        for s in self.stages:
            workers, busy, queued = s.gauges
            workers.set(s.workers)
            busy.set(len(s.running))
            queued.set(len(s.queue))

    def _wait(self, timeout: float) -> None:
        fds = self.fds()
        if math.isinf(timeout) and not fds:
            return
        if fds:
            select.select(fds, [], [], None if math.isinf(timeout) else timeout)
        else:
            time.sleep(timeout)
