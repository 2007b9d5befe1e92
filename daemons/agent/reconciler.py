"""One reconcile step: what is placed against what runs, through a backend.

Shared by the agent daemon (daemon.py) and the single-machine supervisor
(tools/run/supervisor.py), so `rlfleet run` and a cluster host act on placement the
same way. Decisions come from policy.py; this module only observes, starts and
stops through the backend and says what happened as `Event`s, which each caller
words its own way (the supervisor's event lines, the agent's log). While the job is
paused it observes only: deaths are recorded and reported, nothing is started or
stopped (docs/operations/maintenance-mode.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlfleet.common.control.placement import Placed
from rlfleet.daemons.agent import policy
from rlfleet.daemons.agent.backend import Backend
from rlfleet.daemons.agent.policy import CrashLoop, Tracked


@dataclass(frozen=True)
class Event:
    kind: str          # started | died | crash_loop | stopping | stopped | error
    placed: Placed
    restarts: int = 0  # deaths so far (a "started" with restarts > 0 is a restart)
    how: str = ""      # started: "pid 4242" or the unit; error: what failed
    exit: str = ""     # died: "exit code 1", "signal 9"
    backoff_s: float = 0.0
    deaths: int = 0    # crash_loop: how many deaths ...
    span_s: float = 0.0  # ... within this many seconds
    held: bool = False   # died while the job is paused: not restarted until the resume

    @property
    def name(self) -> str:
        return self.placed.member_id

    def sentence(self) -> str:
        if self.kind == "started":
            return (f"restarted {self.name} (restart #{self.restarts}, {self.how})" if self.restarts
                    else f"started {self.name} ({self.how})")
        if self.kind == "died":
            if self.held:
                return f"{self.name} died ({self.exit}); paused: the agent starts nothing until `rlfleet resume`"
            return f"{self.name} died ({self.exit}); restarting in {self.backoff_s:.1f}s"
        if self.kind == "crash_loop":
            return f"{self.name} keeps dying: {self.deaths} deaths in {self.span_s:.0f}s (failing)"
        if self.kind == "stopping":
            return f"stopping {self.name}: no longer placed on {self.placed.host}"
        if self.kind == "stopped":
            return f"{self.name} stopped"
        return f"{self.name}: {self.how}"


class Reconciler:
    def __init__(self, backend: Backend, crash_loop: CrashLoop | None = None) -> None:
        self.backend, self.crash_loop = backend, crash_loop or CrashLoop()
        self.tracked: dict[str, Tracked] = {}
        self.paused = False  # as of the last step

    def adopt(self, hosts: Iterable[str], now: float) -> list[Event]:
        """Take over what the backend runs already (units that outlived an agent restart):
        kept if still placed, stopped at the next step if not."""
        for placed in self.backend.existing(frozenset(hosts)):
            self.tracked.setdefault(placed.member_id, Tracked(placed, active=True, started_at=now))
        return []

    def step(self, desired: Iterable[Placed], now: float, paused: bool = False) -> list[Event]:
        """``paused``: the job is paused; observe only."""
        self.paused = paused
        want = {p.member_id: p for p in desired if policy.placeable(p.role)}
        events = self._observe(want, now)
        decided = policy.plan(want.values(), self.tracked, now, paused)
        for placed in decided.stop:
            try:
                self.backend.stop(placed)
            except (OSError, RuntimeError, ValueError) as exc:
                events.append(Event("error", placed, how=f"could not stop it: {exc}"))
                continue
            self.tracked[placed.member_id].stopping = True
            events.append(Event("stopping", placed))
        for placed in decided.start:
            t = self.tracked.get(placed.member_id)
            if t is None or t.placed != placed:
                t = self.tracked[placed.member_id] = Tracked(placed)
            try:
                how = self.backend.start(placed)
            except (OSError, RuntimeError, ValueError) as exc:
                # A start that fails is a death: retried with backoff, and `failing` if it keeps failing.
                events += self._died(t, f"start failed: {exc}", now)
                continue
            policy.started(t, now)
            events.append(Event("started", placed, t.restarts, how))
        return events

    def _observe(self, want: dict[str, Placed], now: float) -> list[Event]:
        events: list[Event] = []
        for mid, t in list(self.tracked.items()):
            try:
                seen = self.backend.observe(t.placed)
            except (OSError, RuntimeError, ValueError) as exc:
                events.append(Event("error", t.placed, how=f"could not read its state: {exc}"))
                continue
            wanted = want.get(mid) == t.placed
            if not wanted or t.stopping:
                if not seen.active:  # gone: forget it (a later placement starts it afresh)
                    del self.tracked[mid]
                    if t.stopping:
                        events.append(Event("stopped", t.placed))
                else:
                    t.active = True
                continue
            for exit in seen.deaths:
                events += self._died(t, exit, now)
            if seen.active:
                if t.started_at is None:  # restarted by the backend itself (systemd)
                    t.started_at = now
                t.active = True
                policy.still_running(t, now)
            else:
                t.active, t.started_at = False, None
        return events

    def _died(self, t: Tracked, exit: str, now: float) -> list[Event]:
        wait = policy.died(t, exit, now, self.crash_loop)
        events = [Event("died", t.placed, t.restarts, exit=exit, backoff_s=wait, held=self.paused)]
        span = policy.crash_loop_span(t, self.crash_loop, now)
        if span is not None:
            events.append(Event("crash_loop", t.placed, t.restarts, exit=exit,
                                deaths=max(1, self.crash_loop.deaths), span_s=span))
        return events

    def report(self, now: float, host: str | None = None) -> dict[str, dict[str, Any]]:
        """The node record's `daemons` field (of one host, or all)."""
        return {mid: policy.daemon_report(t, self.crash_loop, now, self.paused)
                for mid, t in sorted(self.tracked.items())
                if host is None or t.placed.host == host}

    def running(self) -> list[Placed]:
        return [t.placed for t in self.tracked.values() if t.active]
