"""The ``sim`` stage worker: a simulated accelerator (a judge model, a test runner on a
GPU) as a latency model, for benchmarks and examples on machines without one.

Each job takes a lognormal time (``median_s`` · e^{σ·N(0,1)}, times ``time_scale``): most
are near the median, a few run far past it — the long tail that makes a batch wait for
its slowest request (DistRS §3.1). A ``fail_rate`` fraction ends with an error. No
processes and no fds: jobs wait in a heap until due, and ``next_deadline_in`` tells the
owner's loop when to ask. How many run at once is the pipeline's business (its plan's
worker slots): every job submitted here is running.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import Any

from rlfleet.daemons.reward_host.backends import RewardBackend
from rlfleet.daemons.reward_host.pipeline.spec import SimWorkerConfig


class SimWorker(RewardBackend):
    def __init__(self, config: SimWorkerConfig, *, clock: Any = time.monotonic) -> None:
        self.config, self._clock = config, clock
        self._rng = random.Random(config.seed)
        self._due: list[tuple[float, int, str, float]] = []  # (due, seq, key, seconds)
        self._seq = 0

    def latency_s(self) -> float:
        c = self.config
        return c.median_s * math.exp(c.sigma * self._rng.gauss(0.0, 1.0)) * c.time_scale

    def submit(self, job: Any) -> None:
        seconds = self.latency_s()
        self._seq += 1
        heapq.heappush(self._due, (self._clock() + seconds, self._seq, job.key, seconds))

    def poll(self, timeout: float = 0.0) -> list[Any]:
        from rlfleet.daemons.reward_host.workers import RewardOutcome

        if timeout > 0 and self._due:
            time.sleep(max(0.0, min(timeout, self.next_deadline_in())))
        now, out = self._clock(), []
        while self._due and self._due[0][0] <= now:
            _, _, key, seconds = heapq.heappop(self._due)
            failed = self.config.fail_rate and self._rng.random() < self.config.fail_rate
            # reward 0.0: a sim stage models time only; the pipeline keeps the reward it had
            out.append(RewardOutcome(key, 0.0, "sim: injected failure" if failed else "", seconds))
        return out

    def fds(self) -> list[int]:
        return []

    def next_deadline_in(self) -> float:
        return max(0.0, self._due[0][0] - self._clock()) if self._due else math.inf

    def close(self) -> None:
        self._due.clear()
