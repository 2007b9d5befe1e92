"""How late the env-host's event loop runs its callbacks: the loop-lag probe.

Every EnvManager, every rollout reply and every journal write runs on one event loop;
when the loop has more to do than it can, each of them waits. A periodic callback
measures that wait directly: it asks to be woken ``interval_s`` from now and records how
much later than that it actually ran (``rlfleet_env_loop_lag_seconds``, a histogram, and
``rlfleet_env_loop_lag_max_seconds``, the largest lag of the last 10 to 20 s).

It also integrates the number of running trajectories over time
(``rlfleet_env_running_trajectory_seconds_total``): its rate is the mean number of
trajectories in flight, which tools/bench/env_scale.py checks against max_concurrent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

LOOP_LAG = Histogram("rlfleet_env_loop_lag_seconds",
                     "How late the env-host's event loop ran a callback due at a known time",
                     ["id"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
LOOP_LAG_MAX = Gauge("rlfleet_env_loop_lag_max_seconds",
                     "The largest event-loop lag of the last 10 to 20 s", ["id"])
RUNNING_SECONDS = Counter("rlfleet_env_running_trajectory_seconds_total",
                          "Running trajectories integrated over time (its rate: the mean in flight)", ["id"])

MAX_WINDOW_S = 10.0  # the max gauge covers the current and the previous window


class LoopLagProbe:
    """``await probe.run()`` on the loop it measures (a task; cancel it to stop).

    ``running()`` is read on every tick for the in-flight integral. ``samples`` and
    ``max_s`` are kept for tests and logs."""

    def __init__(self, name: str, interval_s: float = 0.1, running: Callable[[], int] = lambda: 0) -> None:
        self.interval_s = interval_s
        self.running = running
        self._lag = LOOP_LAG.labels(id=name)
        self._max_gauge = LOOP_LAG_MAX.labels(id=name)
        self._running_seconds = RUNNING_SECONDS.labels(id=name)
        self.samples = 0
        self.max_s = 0.0  # over the probe's whole life
        self._window_max = self._previous_max = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        window_end = loop.time() + MAX_WINDOW_S
        last = loop.time()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self.observe(max(0.0, now - due))
            self._running_seconds.inc(self.running() * (now - last))
            last = now
            if now >= window_end:
                self._previous_max, self._window_max = self._window_max, 0.0
                window_end = now + MAX_WINDOW_S

    def observe(self, lag_s: float) -> None:
        self.samples += 1
        self._lag.observe(lag_s)
        self.max_s = max(self.max_s, lag_s)
        self._window_max = max(self._window_max, lag_s)
        self._max_gauge.set(max(self._window_max, self._previous_max))
