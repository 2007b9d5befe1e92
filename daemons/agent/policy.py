"""What the node agent decides, apart from how it acts (STYLE: policy apart from I/O).

Pure code over plain values and a clock the caller passes in: which placed daemons
to start and which to stop, the backoff after a death, and when a daemon counts as
crash-looping (`failing`), and that a paused job (`rlfleet pause`) is observed only:
nothing is started or stopped until it is resumed (docs/operations/maintenance-mode.md). The backends (process.py, systemd.py) and the
reconciler (reconciler.py) do the I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control.placement import Placed
from rlfleet.common.spec.placement import ROLES

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_AFTER_S = 30.0      # a daemon that ran this long gets its backoff reset
CRASH_LOOP_DEATHS = 5       # this many deaths within CRASH_LOOP_WINDOW_S: the daemon is failing
CRASH_LOOP_WINDOW_S = 60.0


@dataclass(frozen=True)
class CrashLoop:
    """N deaths within a window: the daemon is reported `failing` while this holds."""
    deaths: int = CRASH_LOOP_DEATHS
    window_s: float = CRASH_LOOP_WINDOW_S


@dataclass
class Tracked:
    """What the agent remembers of one daemon it started (or found running)."""
    placed: Placed
    restarts: int = 0           # deaths seen (each one is followed by a restart while placed)
    backoff_s: float = BACKOFF_START_S
    next_start_at: float = 0.0  # monotonic time before which it is not started again
    started_at: float | None = None  # when it was last seen to start; None: not running
    deaths: deque = field(default_factory=deque)  # monotonic times of recent deaths
    last_exit: str = ""
    active: bool = False        # running (or being restarted by the backend itself)
    stopping: bool = False      # asked to drain because it is no longer placed

    @property
    def name(self) -> str:
        return self.placed.member_id


@dataclass(frozen=True)
class ReconcilePlan:
    start: tuple[Placed, ...] = ()
    stop: tuple[Placed, ...] = ()


def plan(desired: Iterable[Placed], tracked: dict[str, Tracked], now: float, paused: bool = False) -> ReconcilePlan:
    """Start what is placed and not running (once its backoff has passed), stop what
    runs and is no longer placed. A member id placed under another role or host than
    the one running is stopped first and started once the old one is gone.
    Paused: nothing either way. A daemon that died, or that an operator stopped for
    maintenance, stays down until the resume; one no longer placed keeps running."""
    if paused:
        return ReconcilePlan()
    want = {p.member_id: p for p in desired}
    start = [p for mid, p in sorted(want.items())
             if (t := tracked.get(mid)) is None
             or (not t.active and not t.stopping and (t.placed != p or now >= t.next_start_at))]
    stop = [t.placed for mid, t in sorted(tracked.items())
            if t.active and not t.stopping and want.get(mid) != t.placed]
    return ReconcilePlan(tuple(start), tuple(stop))


def started(t: Tracked, now: float) -> None:
    t.active, t.started_at, t.stopping = True, now, False


def died(t: Tracked, exit: str, now: float, crash_loop: CrashLoop) -> float:
    """Record one death; returns the backoff before the next start."""
    t.active, t.started_at = False, None
    t.restarts += 1
    t.last_exit = exit
    t.deaths.append(now)
    while len(t.deaths) > max(1, crash_loop.deaths):
        t.deaths.popleft()
    wait = t.backoff_s
    t.next_start_at = now + wait
    t.backoff_s = min(t.backoff_s * 2, BACKOFF_MAX_S)
    return wait


def still_running(t: Tracked, now: float) -> None:
    """A daemon that stayed up HEALTHY_AFTER_S starts over from the shortest backoff."""
    if t.started_at is not None and now - t.started_at > HEALTHY_AFTER_S:
        t.backoff_s = BACKOFF_START_S


def crash_loop_span(t: Tracked, crash_loop: CrashLoop, now: float) -> float | None:
    """Seconds the last N deaths took when they fall within the window, else None."""
    n = max(1, crash_loop.deaths)
    if len(t.deaths) < n:
        return None
    first = list(t.deaths)[-n]
    return now - first if now - first < crash_loop.window_s else None


def exit_description(code: int) -> str:
    """A Popen return code as a phrase: "exit code 1", "signal 9"."""
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def daemon_report(t: Tracked, crash_loop: CrashLoop, now: float, paused: bool = False) -> dict[str, Any]:
    """The `daemons.<id>` entry of the node record (docs/operations/agent.md); `held`: down, and not
    started again while the job is paused."""
    state = "stopping" if t.stopping else "running" if t.active else "held" if paused else "waiting"
    return {"role": t.placed.role, "state": state, "restarts": t.restarts, "last_exit": t.last_exit,
            "failing": crash_loop_span(t, crash_loop, now) is not None}


def placeable(role: str) -> bool:
    """Only the job's roles are started from placement keys (never a typo, never an agent)."""
    return role in ROLES


def bootstrap(spec_placed: Iterable[Placed], hosts: Iterable[str]) -> list[Placed]:
    """The resource-managers the spec places on these hosts: the agent starts them itself,
    everything else is placed through them (placement/<host>/...)."""
    wanted = set(hosts)
    return [p for p in spec_placed if p.role == "resource-manager" and p.host in wanted]


def parse_labels(text: str) -> dict[str, str]:
    """$RLFLEET_LABELS: "roles=trainer,rollout;cpu=x86" -> {"roles": "trainer,rollout", "cpu": "x86"}
    (pairs separated by ';', a value may hold commas). ValueError on a pair without '='."""
    labels = {}
    for pair in text.split(";"):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {pair.strip()!r}: expected KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def node_value(inventory: dict[str, Any], labels: dict[str, str], agent: dict[str, Any],
               daemons: dict[str, dict[str, Any]], paused: bool = False) -> dict[str, Any]:
    """`nodes/<host>`: the machine's inventory, its labels, who acts for it (the agent's
    process identity, backend and endpoint) and what it runs there (docs/operations/agent.md);
    `paused: true` while its agent observes only (`rlfleet pause` waits for it)."""
    return {**inventory, "labels": dict(labels), "agent": dict(agent), "daemons": daemons,
            **({"paused": True} if paused else {})}
