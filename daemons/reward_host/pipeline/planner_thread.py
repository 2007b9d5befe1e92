"""The scaling planner off the data path: one thread, ``reward-planner``, computes the
plans; the data path (the pipeline backend's owner: the reward service's thread, or the
shared service's ``reward-scorer``) asks for one and reads the last one, never waiting.

    data path ──ask(PlanRequest)──► slot (latest wins) ──► reward-planner: plan() ──► latest: PlanResult
        ▲                                                                               │
        └──────────── wake fd (readable: a new plan) ◄─ reads ``latest`` on its next poll ┘

Why a thread and not a process: a plan is pure Python (the simulator, scaling.py) and
holds the GIL while it runs, up to ~1.5 s at the benchmark's worst case, but CPython
hands the GIL to a waiting thread every switch interval (5 ms), so the data path waits
at most that long per wake-up instead of for the whole plan, however long the plan
(measured in docs/design/reward.md, "The planner's thread": ~15-20 ms more per trajectory at
the median while the worst plan runs). A process would need the history and every open
batch sent across as typed messages for each plan, for those milliseconds saved.

The hand-off: a ``PlanRequest`` is immutable (open batches as ``ActiveBatch`` tuples, the
history as a ``scaling.History`` value), built on the data path and put in a one-item
slot under a lock; a request not yet taken is replaced by a newer one (counted as
superseded: only the newest state is worth planning for). The result is a ``PlanResult``,
also immutable, stored in one attribute (``latest``), so the data path reads a whole plan
or the one before; then a byte on a pipe (``fd``) wakes the data path, which selects on it.

A plan that raises is counted (``failures``, ``rlfleet_reward_plan_failures_total``) and
logged, with its traceback the first time and then at most once a minute; ``latest``
stays the last good plan and the thread goes on with the next request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter, Histogram

from rlfleet.common.log_throttle import LogThrottle
from rlfleet.daemons.reward_host.pipeline.scaling import History, ScalingPlan
from rlfleet.daemons.reward_host.pipeline.stages import ActiveBatch

log = logging.getLogger("rlfleet.reward_host")

PLANS = Counter("rlfleet_reward_plans_total", "Scaling plans computed (batch arrivals and completions)")
PLAN_SECONDS = Histogram("rlfleet_reward_plan_seconds", "Time to compute one scaling plan",
                         buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2))
PLAN_FAILURES = Counter("rlfleet_reward_plan_failures_total",
                        "Scaling plans that raised (the last good plan stays applied)")
PLAN_SUPERSEDED = Counter("rlfleet_reward_plan_requests_superseded_total",
                          "Plan requests replaced by a newer one before the planner took them")

PLAN_FAILURE_LOG_EVERY_S = 60.0  # a planner that fails, fails on every request: one line per this

PlanFn = Callable[[float, Sequence[ActiveBatch], History], ScalingPlan]


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What the planner needs, as the data path saw it at ``now``."""

    seq: int  # the data path's decision number: a result is applied only if newer
    now: float
    why: str  # what asked: "batch arrival", "batch job/3 done", ...
    active: tuple[ActiveBatch, ...]
    history: History


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """The last plan computed, for the data path to apply."""

    seq: int  # the request it answers
    plan: ScalingPlan
    why: str  # the request's
    tenants: frozenset[str]  # whose open batches it planned for
    seconds: float  # to compute it


class PlannerThread:
    def __init__(self, plan: PlanFn, *, name: str = "reward-planner") -> None:
        self._plan = plan
        self.latest: PlanResult | None = None  # replaced whole by the planner thread only
        self.asked = self.superseded = self.computed = self.failures = 0
        self.last_error = ""
        self.handled_seq = 0  # the newest request planned or failed
        self._cond = threading.Condition()
        self._pending: PlanRequest | None = None
        self._busy = False
        self._stop = False
        self._errors = LogThrottle(PLAN_FAILURE_LOG_EVERY_S)
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the data path's side: never waits on a plan ---------------------------------------
    def ask(self, request: PlanRequest) -> None:
        with self._cond:
            if self._pending is not None:
                self.superseded += 1
                PLAN_SUPERSEDED.inc()
            self._pending = request
            self.asked += 1
            self._cond.notify()

    def fd(self) -> int:
        """Readable when a new plan is in ``latest``; ``drain_wakeups`` clears it."""
        return self._rfd

    def drain_wakeups(self) -> None:
        try:
            while os.read(self._rfd, 4096):
                pass
        except BlockingIOError:
            pass

    def idle(self) -> bool:
        """Nothing asked is waiting or being planned (for tests and status)."""
        with self._cond:
            return self._pending is None and not self._busy

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the plan in progress (a plan cannot be interrupted) and join."""
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._pending = None
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("reward planner thread still running after %.0f s; left behind (a daemon thread)",
                        timeout_s)
            return  # it may still write its wake-up byte: keep the pipe open
        for fd in (self._rfd, self._wfd):
            os.close(fd)

    # -- the planner thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                request, self._pending = self._pending, None
                self._busy = True
            try:
                self._one(request)
            finally:
                with self._cond:
                    self._busy = False
                    self.handled_seq = request.seq

    def _one(self, request: PlanRequest) -> None:
        started = time.perf_counter()
        try:
            plan = self._plan(request.now, request.active, request.history)
        except Exception as exc:  # a planner bug must not stop scaling for good, nor scoring
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            PLAN_FAILURES.inc()
            if self.failures == 1:  # the traceback once; the throttle's interval starts here
                self._errors.admit("plan_failed")
                log.exception("reward planner: plan for %s failed; keeping the last plan", request.why,
                              extra={"event": "reward_plan_failed"})
            else:
                self._errors.warning(log, "plan_failed", "reward planner: plan for %s failed (%d so far): %s; "
                                     "keeping the last plan", request.why, self.failures, self.last_error,
                                     extra={"event": "reward_plan_failed"})
            return
        seconds = time.perf_counter() - started
        PLAN_SECONDS.observe(seconds)
        PLANS.inc()
        self.computed += 1
        self.latest = PlanResult(request.seq, plan, request.why,
                                 frozenset(a.key.tenant for a in request.active), seconds)
        try:
            os.write(self._wfd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the data path is woken already
