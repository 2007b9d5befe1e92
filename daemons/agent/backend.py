"""The one small interface both ways of running a placed daemon share.

`ProcessBackend` (process.py) runs each daemon as a supervised subprocess: the
single-machine `rlfleet run` and an agent without systemd. `SystemdBackend`
(systemd.py) starts and stops `rlfleet@<job>:<id>.service` units on a cluster
host, where systemd itself restarts a unit that dies (Restart=on-failure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rlfleet.common.control.placement import Placed


@dataclass(frozen=True)
class Observed:
    """One look at a daemon. `active`: running, starting, or being restarted by the
    backend itself; `deaths`: its exits since the last look, each as a phrase
    ("exit code 1", "signal 9"), oldest first."""
    active: bool
    deaths: tuple[str, ...] = ()


class Backend(Protocol):
    name: str

    def start(self, placed: Placed) -> str:
        """Start it (without waiting for it to be ready); returns how, e.g. "pid 4242"."""

    def observe(self, placed: Placed) -> Observed:
        """Is it running, and did it die since the last look?"""

    def stop(self, placed: Placed) -> None:
        """Ask it to drain and exit (SIGTERM / systemctl stop); `observe` shows when it is gone."""

    def existing(self, job_hosts: frozenset[str]) -> list[Placed]:
        """The daemons this backend runs already (an agent restarted under running units)."""

    def release(self, grace_s: float, note: Callable[[str], None]) -> str:
        """The agent itself stops: drain what must stop with it (within grace_s, saying
        what had to be killed through `note`); returns what happened, as a sentence."""


def role_of(member_id: str) -> str:
    """Member ids are `<role>-<n>` (common/control/placement.py)."""
    return member_id.rpartition("-")[0]
