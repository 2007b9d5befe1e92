"""A discrete-event simulator of a reward pipeline (DistRS §5.1 SIMULATE): no I/O, no
wall clock. One event heap, one thread; time is whatever the requests say.

Each stage has a number of workers (each runs one request at a time) and one queue
(queues.py: EBF or FCFS). A request enters its first stage at its arrival, runs
min(s_ij, T_j), and moves on at once; one that exceeds a stage's timeout stops there,
is recorded as failed (``timed_out``), and its batch no longer waits on it. A batch is
done when all its requests are (Eq. 2); its extra delay is that time minus its
earliest completion T (Eq. 1-2, computed from the requests with no queueing).

Two uses, one engine:

- planning (scaling.py): fixed worker counts and a ``Guard``; the run stops at the first
  violation and says ``feasible=False``. The guard checks each batch's completion against
  its deadline (T + D), and, when timeout-aware (DistRS §5.1), every request that had to
  wait: started at ``ts`` in stage k it may still finish as late as ts + Σ_{j≥k} T_j, and
  if that passes the deadline the worker counts are refused.
- replay (the benchmark): a ``Controller`` is asked for new worker counts at every batch
  arrival and completion, and when a running request passes the controller's
  ``long_running_after_s`` for its batch and stage, as the reward service asks its
  planner. Fewer workers than are busy take effect as the busy ones finish (a running
  request is never killed to scale down). Worker-seconds are charged for every worker
  held, busy or idle.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Protocol

from rlfleet.daemons.reward_host.pipeline.queues import QueuePolicy, make_queue
from rlfleet.daemons.reward_host.pipeline.stages import ActiveBatch, BatchKey, Pipeline

# same-time order: plan first, free workers, then queue; a long runner's plan sees all that
_BATCH, _FINISH, _ARRIVE, _LONG = 0, 1, 2, 3
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class SimRequest:
    batch: BatchKey
    arrival_s: float
    service_s: tuple[float, ...]  # running time at each stage from ``first_stage`` on
    first_stage: int = 0  # a request already past some stages (DistRS Alg. 2, Queuing_k)


@dataclasses.dataclass(frozen=True)
class Guard:
    """Planning constraints: each batch's deadline (T + D, absolute) and whether a
    request that waited may still run into its timeouts (DistRS §5.1, LT > T + D)."""

    deadline_s: dict[BatchKey, float]
    timeout_aware: bool = True


@dataclasses.dataclass
class SimResult:
    feasible: bool
    why: str
    done_s: dict[BatchKey, float]  # completion of each finished batch
    earliest_s: dict[BatchKey, float]  # T of each batch
    failed: int  # requests that timed out at some stage
    worker_seconds: list[float]  # per stage, workers held × time (not cost-weighted)
    busy_seconds: list[float]  # per stage, workers running a request × time

    def extra_delay_s(self) -> dict[BatchKey, float]:
        return {b: max(0.0, t - self.earliest_s[b]) for b, t in self.done_s.items()}


class Controller(Protocol):
    def on_batch_arrival(self, sim: PipelineSim, batch: BatchKey, now: float) -> Sequence[int] | None: ...

    def on_batch_done(self, sim: PipelineSim, batch: BatchKey, now: float) -> Sequence[int] | None: ...

    def long_running_after_s(self, batch: BatchKey, stage: int) -> float | None:
        """Seconds at ``stage`` after which a running request of ``batch`` asks for a plan
        (``on_long_running``); None: never."""

    def on_long_running(self, sim: PipelineSim, batch: BatchKey, now: float) -> Sequence[int] | None: ...


class PipelineSim:
    def __init__(self, pipeline: Pipeline, workers: Sequence[int], policy: QueuePolicy,
                 guard: Guard | None = None) -> None:
        if len(workers) != len(pipeline):
            raise ValueError(f"{len(workers)} worker counts for {len(pipeline)} stages")
        self.pipeline, self.policy, self.guard = pipeline, policy, guard
        m = len(pipeline)
        self._timeouts = pipeline.timeouts
        # Σ_{j≥k} T_j: the latest a request that starts stage k can still finish
        self._tail = [sum(self._timeouts[k:]) for k in range(m)] + [0.0]
        self.target = [max(0, int(n)) for n in workers]
        self.busy = [0] * m
        self.queues = [make_queue(policy) for _ in range(m)]
        self.now = 0.0
        self._events: list[tuple[float, int, int, int, int]] = []  # (t, order, seq, request/batch, stage)
        self._seq = 0
        # requests, as parallel lists (the hot loop reads them by index)
        self._arrival: list[float] = []
        self._service: list[tuple[float, ...]] = []
        self._offset: list[int] = []  # first_stage: service_s[0] is this stage's time
        self._batch_of: list[int] = []
        self._stage: list[int] = []  # current stage; -1 not arrived; m when done
        self._since: list[float] = []  # entered its current queue / started running
        self._running: list[bool] = []
        # batches
        self.batches: list[BatchKey] = []
        self._priority: list[float] = []
        self._members: list[list[int]] = []
        self._left: list[int] = []
        self._first: list[float] = []
        self._done_at: list[float] = []
        self._earliest: list[float] = []
        self._failed = 0
        self._ws = [0.0] * m
        self._busy_s = [0.0] * m
        self._last_t: float | None = None
        self._controller: Controller | None = None

    # -- input ----------------------------------------------------------------------------
    def add_batch(self, key: BatchKey, requests: Sequence[SimRequest], priority: float) -> None:
        """A batch and all its requests; ``priority``: its expected completion (EBF)."""
        if not requests:
            raise ValueError(f"batch {key}: no requests")
        b = len(self.batches)
        self.batches.append(key)
        self._priority.append(priority)
        members: list[int] = []
        earliest = 0.0
        for q in requests:
            i = len(self._arrival)
            members.append(i)
            self._arrival.append(q.arrival_s)
            self._service.append(q.service_s)
            self._offset.append(q.first_stage)
            self._batch_of.append(b)
            self._stage.append(-1)
            self._since.append(q.arrival_s)
            self._running.append(False)
            self._push(q.arrival_s, _ARRIVE, i, q.first_stage)
            run = 0.0
            for s, t_out in zip(q.service_s, self._timeouts[q.first_stage:]):
                run += min(s, t_out)
                if s > t_out:
                    break
            earliest = max(earliest, q.arrival_s + run)
        first = min(q.arrival_s for q in requests)
        self._members.append(members)
        self._left.append(len(members))
        self._first.append(first)
        self._done_at.append(math.nan)
        self._earliest.append(earliest)
        self._push(first, _BATCH, b, 0)

    def set_workers(self, workers: Sequence[int]) -> None:
        """New worker counts, effective now: more start taking queued requests at once;
        fewer retire as their requests finish."""
        self.target = [max(0, int(n)) for n in workers]
        for j in range(len(self.target)):
            self._start_queued(j)

    # -- what a planner may see -----------------------------------------------------------------
    def active(self) -> list[ActiveBatch]:
        """Batches arrived and not done, as the service would report them (stages.ActiveBatch)."""
        out = []
        for b, key in enumerate(self.batches):
            if self._first[b] > self.now or not math.isnan(self._done_at[b]):
                continue
            queued, running, done = [], [], 0
            for i in self._members[b]:
                k = self._stage[i]
                if k < 0:
                    continue
                if k >= len(self.target):
                    done += 1
                elif self._running[i]:
                    running.append((k, self.now - self._since[i]))
                else:
                    queued.append(k)
            out.append(ActiveBatch(key, self._first[b], tuple(queued), tuple(running), done))
        return out

    def earliest_s(self, key: BatchKey) -> float:
        return self._earliest[self.batches.index(key)]

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, controller: Controller | None = None) -> SimResult:
        guard = self.guard
        self._controller = controller
        events = self._events
        while events:
            t, kind, _, x, j = heapq.heappop(events)
            self._account(t)
            self.now = t
            if kind == _BATCH or kind == _LONG:
                if controller is not None:
                    if kind == _BATCH:
                        plan = controller.on_batch_arrival(self, self.batches[x], t)
                    else:
                        plan = controller.on_long_running(self, self.batches[self._batch_of[x]], t)
                    if plan is not None:
                        self.set_workers(plan)
                continue
            if kind == _FINISH:
                self.busy[j] -= 1
                self._running[x] = False
                if self._service[x][j - self._offset[x]] > self._timeouts[j]:
                    self._failed += 1
                    why = self._finish(x, t, controller)
                else:
                    why = self._enter(x, j + 1, t, controller)
                if why is None:
                    why = self._start_queued(j)
            else:
                why = self._enter(x, j, t, controller)
            if why:
                return self._result(False, why)
        if guard is not None:
            late = [b for b in range(len(self.batches)) if math.isnan(self._done_at[b])]
            if late:
                return self._result(False, f"batch {self.batches[late[0]]} never finished (0 workers)")
        return self._result(True, "")

    def _push(self, t: float, kind: int, x: int, j: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, x, j))

    def _account(self, t: float) -> None:
        if self._last_t is not None and t > self._last_t:
            dt = t - self._last_t
            for j in range(len(self.target)):
                self._ws[j] += max(self.target[j], self.busy[j]) * dt
                self._busy_s[j] += self.busy[j] * dt
        self._last_t = t

    def _enter(self, i: int, j: int, t: float, controller: Controller | None) -> str | None:
        """Request ``i`` reaches stage ``j`` at ``t`` (or leaves the pipeline)."""
        self._stage[i] = j
        if j - self._offset[i] >= len(self._service[i]) or j >= len(self.target):
            return self._finish(i, t, controller)
        self._since[i] = t
        if self.busy[j] < self.target[j] and not len(self.queues[j]):
            return self._start(i, j, t)
        self.queues[j].push(i, self._priority[self._batch_of[i]])
        return None

    def _start(self, i: int, j: int, t: float) -> str | None:
        guard = self.guard
        if guard is not None and guard.timeout_aware and t > self._since[i] + _EPS:
            deadline = guard.deadline_s.get(self.batches[self._batch_of[i]], math.inf)
            if t + self._tail[j] > deadline + _EPS:
                return (f"a request of {self.batches[self._batch_of[i]]} waited until {t:.2f} s at "
                        f"stage {self.pipeline.stages[j].name}; with its timeouts it may finish at "
                        f"{t + self._tail[j]:.2f} s, past the deadline {deadline:.2f} s")
        self.busy[j] += 1
        self._running[i] = True
        self._since[i] = t
        s = self._service[i][j - self._offset[i]]
        self._push(t + min(s, self._timeouts[j]), _FINISH, i, j)
        if self._controller is not None:
            after = self._controller.long_running_after_s(self.batches[self._batch_of[i]], j)
            if after is not None and min(s, self._timeouts[j]) > after:  # still running then
                self._push(t + after, _LONG, i, j)
        return None

    def _start_queued(self, j: int) -> str | None:
        q = self.queues[j]
        while self.busy[j] < self.target[j] and len(q):
            why = self._start(q.pop(), j, self.now)
            if why:
                return why
        return None

    def _finish(self, i: int, t: float, controller: Controller | None) -> str | None:
        self._stage[i] = len(self.target)
        b = self._batch_of[i]
        self._left[b] -= 1
        if self._left[b]:
            return None
        self._done_at[b] = t
        guard = self.guard
        if guard is not None:
            deadline = guard.deadline_s.get(self.batches[b], math.inf)
            if t > deadline + _EPS:
                return f"batch {self.batches[b]} done at {t:.2f} s, past its deadline {deadline:.2f} s"
        if controller is not None:
            plan = controller.on_batch_done(self, self.batches[b], t)
            if plan is not None:
                self.set_workers(plan)
        return None

    def _result(self, feasible: bool, why: str) -> SimResult:
        done = {self.batches[b]: t for b, t in enumerate(self._done_at) if not math.isnan(t)}
        return SimResult(feasible, why, done, dict(zip(self.batches, self._earliest)), self._failed,
                         list(self._ws), list(self._busy_s))


def simulate(pipeline: Pipeline, workers: Sequence[int], policy: QueuePolicy,
             batches: Sequence[tuple[BatchKey, Sequence[SimRequest], float]],
             guard: Guard | None = None) -> SimResult:
    """One run with fixed worker counts: ``batches`` as (key, requests, EBF priority)."""
    sim = PipelineSim(pipeline, workers, policy, guard)
    for key, requests, priority in batches:
        sim.add_batch(key, requests, priority)
    return sim.run()
