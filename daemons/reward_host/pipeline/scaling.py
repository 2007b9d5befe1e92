"""History-based simulated scaling (DistRS §5, Algorithms 1 and 2): no I/O.

The question, per plan: how many workers N_j at each stage j, minimising Σ_j N_j·C_j
subject to every active batch finishing within D seconds of its earliest completion T
(Eq. 5, d ≤ D). There is no closed form for d(N_1..N_M), so (Algorithm 1) the planner
replays an estimate of the requests still to come through the simulator (reward_sim.py,
with the service's own queue policy, so the plan knows EBF), starting from N_j = the
number of requests that reach stage j (nothing ever waits), and binary-searches each
stage's count down in order of cost, costliest first, keeping the others where they are.

The estimate (Algorithm 2), for each active batch, from its tenant's last finished batch
(the history; arrival patterns of adjacent batches are alike, DistRS §3.1 Fig. 5c):

    Future     each historical request i with AT + r_i > now, as it was
    Queuing_k  a queued request at stage k: arrives now, with the stage-k-onwards times
               of a historical request that reached stage k, drawn at random
    Running_k  running for e seconds at stage k: arrives now at stage k, with the times
               of a historical request whose s_ik > e, less e (none: it runs to T_k)
    Late       (ours, ``expect_late``) when the batch has received fewer requests than the
               history's batch held, more than Future still brings: the rest arrive now,
               with the times of historical requests drawn at random. Without it a
               request later than any in the history is seen only once it has arrived,
               and a plan made before then may have scaled down under it.

Timeout awareness (§5.1): history says how long requests ran, not which new request will
hang; a queued request that may still run into its timeouts (ts + Σ_{j≥k} T_j > T + D)
makes the counts infeasible, so the plan keeps room for the late requests of each batch.
The ``history``-only variant drops that check (the paper's "History-Based", Fig. 13).

The service calls ``on_batch_arrival`` when a batch's first request arrives and
``on_batch_done`` when its last one finishes (with the batch's record, which becomes that
tenant's history); each returns a ``ScalingPlan``. It also calls ``on_long_running`` when a
request has run at a stage for ``long_running_after_s`` (the longest its tenant's history
shows a request finishing there within the timeout): from that moment Algorithm 2 can
only take it for a long runner (a sample that ran longer, or its timeout), so a plan
made then sees the worker it will hold and keeps room for the requests that would
otherwise queue behind it (ours, not the paper's: DistRS re-plans at batch boundaries
and "periodically", §4; a plan made before the request showed itself counted on a
normal running time). ``expected_done_s`` is the EBF priority of a batch
(queues.EbfQueue). ``zero_queue_workers`` is the ZQ-Dedicated baseline (§6.1).

The history is a ``History``, an immutable value: ``add_history`` swaps in a new one, and
``plan`` takes the one it is given (or the planner's current one). So the pipeline backend
can read priorities and long-running thresholds on its data path while a plan runs on
the planner thread (planner_thread.py) over the snapshot it was handed; the random draws
of Algorithm 2 happen only in ``plan``, on that one thread.
"""

from __future__ import annotations

import dataclasses
import math
import random
import types
from collections.abc import Iterable, Mapping, Sequence

from rlfleet.daemons.reward_host.pipeline.queues import QueuePolicy
from rlfleet.daemons.reward_host.pipeline.simulator import Guard, SimRequest, simulate
from rlfleet.daemons.reward_host.pipeline.stages import ActiveBatch, BatchKey, BatchRecord, Pipeline

PlanBatch = tuple[BatchKey, list[SimRequest], float, float]  # key, requests, priority, T


@dataclasses.dataclass(frozen=True)
class ScalingPlan:
    workers: dict[str, int]  # stage name -> worker count
    why: str
    simulations: int = 0

    def counts(self, pipeline: Pipeline) -> list[int]:
        return [self.workers[name] for name in pipeline.names]


def _run_s(pipeline: Pipeline, q: SimRequest) -> float:
    total = 0.0
    for s, stage in zip(q.service_s, pipeline.stages[q.first_stage:]):
        total += min(s, stage.timeout_s)
        if s > stage.timeout_s:
            break
    return total


def _reaches(pipeline: Pipeline, q: SimRequest, j: int) -> bool:
    if j < q.first_stage or j - q.first_stage >= len(q.service_s):
        return False
    return all(s <= st.timeout_s for s, st in zip(q.service_s[:j - q.first_stage],
                                                   pipeline.stages[q.first_stage:]))


def search_workers(pipeline: Pipeline, batches: Sequence[PlanBatch], *, max_delay_s: float,
                   policy: QueuePolicy, timeout_aware: bool) -> tuple[list[int], int]:
    """Algorithm 1 over ``batches`` (key, requests, EBF priority, T): the worker count
    of each stage, and how many simulations it took. Each batch's deadline is
    max(T, its requests' earliest completion) + D, so the start (no request ever waits)
    is always feasible."""
    m = len(pipeline)
    upper = [sum(_reaches(pipeline, q, j) for _, reqs, _, _ in batches for q in reqs) for j in range(m)]
    deadline = {key: max([t] + [q.arrival_s + _run_s(pipeline, q) for q in reqs]) + max_delay_s
                for key, reqs, _, t in batches}
    guard = Guard(deadline, timeout_aware)
    sims = [(key, reqs, prio) for key, reqs, prio, _ in batches]
    num = list(upper)
    runs = 0
    for j in pipeline.costliest_first():
        low, high = (1 if upper[j] else 0), upper[j]
        while low < high:
            num[j] = (low + high) // 2
            runs += 1
            if simulate(pipeline, num, policy, sims, guard).feasible:
                high = num[j]
            else:
                low = num[j] + 1
        num[j] = low
    return num, runs


def zero_queue_workers(pipeline: Pipeline, records: Iterable[BatchRecord]) -> list[int]:
    """ZQ: per stage, the most requests ever running at once when none waits (their
    peak overlap), over the records; that many workers never queue a request."""
    peak = [0] * len(pipeline)
    for rec in records:
        for j in range(len(pipeline)):
            edges = []
            for r, s in zip(rec.offsets_s, rec.service_s):
                if len(s) <= j:
                    continue
                start = r + pipeline.run_s(s[:j])
                edges += [(start, 1), (start + min(s[j], pipeline.stages[j].timeout_s), -1)]
            level = 0
            for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts
                level += step
                peak[j] = max(peak[j], level)
    return peak


@dataclasses.dataclass(frozen=True)
class History:
    """Each tenant's last ``window`` finished batches and, per stage, the longest running
    time they show that ended within the timeout. Immutable (the mappings are read-only
    views that are never changed): ``with_record`` returns a new one, so a snapshot can be
    handed to another thread as it is."""

    window: int
    records: Mapping[str, tuple[BatchRecord, ...]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    long_after: Mapping[str, tuple[float | None, ...]] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))  # tenant -> per stage

    def with_record(self, record: BatchRecord, pipeline: Pipeline) -> History:
        tenant = record.key.tenant
        kept = (self.records.get(tenant, ()) + (record,))[-self.window:]
        longest: list[float | None] = []
        for k, timeout in enumerate(pipeline.timeouts):
            normal = [s[k] for rec in kept for s in rec.service_s if len(s) > k and s[k] < timeout]
            longest.append(max(normal) if normal else None)
        return History(self.window, types.MappingProxyType({**self.records, tenant: kept}),
                       types.MappingProxyType({**self.long_after, tenant: tuple(longest)}))

    def expected_done_s(self, pipeline: Pipeline, batch: BatchKey, arrived_at_s: float) -> float:
        kept = self.records.get(batch.tenant)
        if not kept:
            return arrived_at_s + sum(pipeline.timeouts)
        return arrived_at_s + kept[-1].earliest_done_s(pipeline)


class ScalingPlanner:
    """Algorithms 1 + 2 for any number of tenants sharing one pipeline."""

    def __init__(self, pipeline: Pipeline, *, max_delay_s: float, timeout_aware: bool = True,
                 policy: QueuePolicy = "ebf", window: int = 1, seed: int = 0,
                 expect_late: bool = False) -> None:
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s: must be >= 0, got {max_delay_s}")
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.pipeline, self.max_delay_s = pipeline, max_delay_s
        self.timeout_aware, self.policy, self.window = timeout_aware, policy, window
        self.expect_late = expect_late
        self.history = History(window)  # replaced whole, never changed in place
        self._rng = random.Random(seed)  # Algorithm 2's draws: used by ``plan`` only
        self.plans = 0

    # -- the service's calls ------------------------------------------------------------------
    def add_history(self, record: BatchRecord) -> None:
        self.history = self.history.with_record(record, self.pipeline)

    def long_running_after_s(self, batch: BatchKey, stage: int) -> float | None:
        """How long a request of ``batch`` may run at ``stage`` before it has outlived
        every request of its tenant's history that finished there within the timeout
        (None: no such request in the history, so Algorithm 2 already takes any running
        request there to its timeout). The service calls ``on_long_running`` then."""
        longest = self.history.long_after.get(batch.tenant)
        return None if longest is None else longest[stage]

    def expected_done_s(self, batch: BatchKey, arrived_at_s: float) -> float:
        """The batch's expected completion AT + T_history (Eq. 1-2): its EBF priority. A
        tenant with no history yet: AT + Σ T_j (one request running into every timeout)."""
        return self.history.expected_done_s(self.pipeline, batch, arrived_at_s)

    def on_batch_arrival(self, now: float, active: Sequence[ActiveBatch]) -> ScalingPlan:
        return self.plan(now, active)

    def on_batch_done(self, now: float, record: BatchRecord, active: Sequence[ActiveBatch]) -> ScalingPlan:
        self.add_history(record)
        return self.plan(now, [a for a in active if a.key != record.key])

    def on_long_running(self, now: float, active: Sequence[ActiveBatch]) -> ScalingPlan:
        """A request outlived ``long_running_after_s`` at its stage: re-plan with it
        estimated as a long runner (Algorithm 2, Running_k)."""
        return self.plan(now, active)

    # -- Algorithm 2 then 1 -------------------------------------------------------------------------
    def plan(self, now: float, active: Sequence[ActiveBatch], history: History | None = None) -> ScalingPlan:
        """A plan for ``active`` at ``now`` from ``history`` (default: the planner's own)."""
        self.plans += 1
        history = self.history if history is None else history
        batches = [self._estimate(now, a, history) for a in active]
        batches = [b for b in batches if b[1]]
        if not batches:
            return ScalingPlan({name: 0 for name in self.pipeline.names}, "no active batch", 0)
        counts, runs = search_workers(self.pipeline, batches, max_delay_s=self.max_delay_s,
                                      policy=self.policy, timeout_aware=self.timeout_aware)
        n = sum(len(b[1]) for b in batches)
        return ScalingPlan(dict(zip(self.pipeline.names, counts)),
                    f"{len(batches)} active batches, {n} requests estimated, {runs} simulations", runs)

    def _estimate(self, now: float, a: ActiveBatch, snapshot: History | None = None) -> PlanBatch:
        """Algorithm 2 for one active batch."""
        snapshot = self.history if snapshot is None else snapshot
        history = snapshot.records.get(a.key.tenant)
        timeouts = self.pipeline.timeouts
        out: list[SimRequest] = []
        if history:
            last = history[-1]
            for r, s in zip(last.offsets_s, last.service_s):
                if a.arrived_at_s + r > now:  # Future
                    out.append(SimRequest(a.key, a.arrived_at_s + r, s))
            pool = [s for rec in history for s in rec.service_s]
            received = len(a.queued) + len(a.running) + a.done
            late = len(last) - received - len(out)
            if self.expect_late and late > 0:  # Late
                out += [SimRequest(a.key, now, self._rng.choice(pool)) for _ in range(late)]
        else:
            pool = []
        for k in a.queued:  # Queuing_k
            reached = [s for s in pool if len(s) > k]
            s = self._rng.choice(reached)[k:] if reached else timeouts[k:]
            out.append(SimRequest(a.key, now, tuple(s), k))
        for k, elapsed in a.running:  # Running_k
            longer = [s for s in pool if len(s) > k and s[k] > elapsed]
            if longer:
                s = self._rng.choice(longer)[k:]
                rest = (s[0] - elapsed,) + tuple(s[1:])
            else:  # ran longer than anything in the history: assume it runs to its timeout
                rest = (max(timeouts[k] - elapsed, 0.0),)
            out.append(SimRequest(a.key, now, rest, k))
        priority = snapshot.expected_done_s(self.pipeline, a.key, a.arrived_at_s)
        return a.key, out, priority, priority if history else -math.inf
