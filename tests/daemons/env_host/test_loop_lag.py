"""The env-host's loop-lag probe (daemons/env_host/loop_lag.py) measures a blocked loop."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from rlfleet.daemons.env_host.loop_lag import LoopLagProbe


def _sample(name: str, probe_id: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"id": probe_id, **labels}) or 0.0


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _probe_for(name: str, interval_s: float, until, running=lambda: 0):
    """Run a probe on a fresh loop until ``until(probe)``; returns the probe, every lag it
    observed, and the loop time that passed while it ran."""
    async def main():
        probe = LoopLagProbe(name, interval_s=interval_s, running=running)
        lags: list[float] = []
        observe = probe.observe
        probe.observe = lambda lag: (lags.append(lag), observe(lag))[1]  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = asyncio.create_task(probe.run())
        await until(probe)
        task.cancel()
        return probe, lags, loop.time() - started
    return asyncio.run(main())


def _accounts_for_the_time(lags: list[float], interval_s: float, elapsed_s: float) -> None:
    """Each tick waited its interval and then its lag: together never more than the time
    that passed (a probe that over-reports fails here, on a quiet machine or a busy one)."""
    assert lags and min(lags) >= 0
    assert sum(interval_s + lag for lag in lags) <= elapsed_s + 1e-6, (lags, elapsed_s)


def test_a_blocked_loop_is_measured() -> None:
    async def block_once(probe: LoopLagProbe) -> None:
        await _until(lambda: probe.samples >= 3)
        before = probe.samples
        time.sleep(0.2)  # the fault: a callback that holds the loop for 0.2 s
        await _until(lambda: probe.samples > before)

    probe, lags, elapsed = _probe_for("lag-test-blocked", 0.02, block_once, running=lambda: 7)
    assert probe.max_s >= 0.15 and probe.max_s == max(lags), lags  # the block, seen as lag
    _accounts_for_the_time(lags, 0.02, elapsed)
    name = "lag-test-blocked"
    # Published: the histogram has the late sample above 0.1 s, the gauge holds the max.
    above = _sample("rlfleet_env_loop_lag_seconds_count", name) - _sample(
        "rlfleet_env_loop_lag_seconds_bucket", name, le="0.1")
    assert above == sum(lag > 0.1 for lag in lags) >= 1
    assert _sample("rlfleet_env_loop_lag_max_seconds", name) == probe.max_s
    # The in-flight integral: 7 running for the probe's life (about 0.2 s + the ticks).
    running_s = _sample("rlfleet_env_running_trajectory_seconds_total", name)
    assert running_s >= 7 * 0.2, running_s


def test_every_tick_of_an_idle_loop_is_observed_and_published() -> None:
    async def twenty_ticks(probe: LoopLagProbe) -> None:
        await _until(lambda: probe.samples >= 20)

    probe, lags, elapsed = _probe_for("lag-test-idle", 0.01, twenty_ticks)
    assert len(lags) == probe.samples == _sample("rlfleet_env_loop_lag_seconds_count", "lag-test-idle")
    assert probe.max_s == max(lags) == _sample("rlfleet_env_loop_lag_max_seconds", "lag-test-idle")
    _accounts_for_the_time(lags, 0.01, elapsed)
