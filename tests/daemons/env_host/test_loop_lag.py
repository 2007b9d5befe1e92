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


def test_a_blocked_loop_is_measured() -> None:
    async def main() -> LoopLagProbe:
        probe = LoopLagProbe("lag-test-blocked", interval_s=0.02, running=lambda: 7)
        task = asyncio.create_task(probe.run())
        await _until(lambda: probe.samples >= 3)
        quiet_max = probe.max_s
        before = probe.samples
        time.sleep(0.2)  # the fault: a callback that holds the loop for 0.2 s
        await _until(lambda: probe.samples > before)
        task.cancel()
        return probe, quiet_max

    probe, quiet_max = asyncio.run(main())
    assert quiet_max < 0.1, f"an idle loop measured {quiet_max:.3f} s late"
    assert probe.max_s >= 0.15, probe.max_s
    name = "lag-test-blocked"
    # Published: the histogram has the late sample above 0.1 s, the gauge holds the max.
    above = _sample("rlfleet_env_loop_lag_seconds_count", name) - _sample(
        "rlfleet_env_loop_lag_seconds_bucket", name, le="0.1")
    assert above == 1
    assert _sample("rlfleet_env_loop_lag_max_seconds", name) == probe.max_s
    # The in-flight integral: 7 running for the probe's life (about 0.2 s + the ticks).
    running_s = _sample("rlfleet_env_running_trajectory_seconds_total", name)
    assert running_s >= 7 * 0.2, running_s


def test_an_idle_loop_shows_little_lag() -> None:
    async def main() -> LoopLagProbe:
        probe = LoopLagProbe("lag-test-idle", interval_s=0.01)
        task = asyncio.create_task(probe.run())
        await _until(lambda: probe.samples >= 20)
        task.cancel()
        return probe

    probe = asyncio.run(main())
    assert _sample("rlfleet_env_loop_lag_seconds_count", "lag-test-idle") == probe.samples
    # Loose: a busy CI machine can deschedule us, but not by the 0.2 s the other test injects.
    assert probe.max_s < 0.15, probe.max_s
