"""Fixtures of the fuzz tests: hypothesis settings that keep a real-daemon test under a
minute and repeatable in CI (derandomized: the same examples every run)."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

# No shrinking against a live daemon: a failure is reported as found (shrinking replays
# hundreds of examples through the process and can run for many minutes).
DAEMON_FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                       phases=(Phase.explicit, Phase.generate),
                       suppress_health_check=list(HealthCheck))
