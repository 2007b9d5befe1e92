"""The reconcile step over the process backend, with real subprocesses standing in for
daemons: a placed one is started and its log written, one that dies is restarted
after its backoff and reported failing when it keeps dying, one no longer placed
gets SIGTERM and is forgotten once gone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from rlfleet.common.control.placement import Placed
from rlfleet.daemons.agent.policy import CrashLoop
from rlfleet.daemons.agent.process import ProcessBackend
from rlfleet.daemons.agent.reconciler import Reconciler
from tests.integration.helpers import wait_for

SLEEPER = Placed("h1", "relay", "relay-0")
CRASHER = Placed("h1", "rollout", "rollout-0")
# A stand-in daemon: prints its id and pid, then sleeps until SIGTERM (exit 0) - or exits 3 at once.
PROGRAM = """
import os, signal, sys, time
print(sys.argv[1], os.getpid(), flush=True)
if sys.argv[1].startswith("rollout"):
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(1)
"""


def make_backend(tmp_path: Path) -> ProcessBackend:
    return ProcessBackend(lambda p: [sys.executable, "-c", PROGRAM, p.member_id], lambda p: {"PATH": "/usr/bin:/bin"},
                          tmp_path / "logs")


def steps_until(agent: Reconciler, desired, what: str, cond, timeout_s: float = 30.0) -> list:
    """Reconcile (as the agent's loop does) until cond(events so far) holds."""
    seen: list = []

    def step():
        seen.extend(agent.step(desired, time.monotonic()))
        return cond(seen)
    wait_for(what, step, timeout_s=timeout_s)
    return seen


def test_placed_daemons_run_and_an_unplaced_one_is_drained(tmp_path):
    backend = make_backend(tmp_path)
    agent = Reconciler(backend)
    try:
        events = agent.step([SLEEPER], time.monotonic())
        assert [(e.kind, e.name) for e in events] == [("started", "relay-0")]
        pid = backend.pid("relay-0")
        assert events[0].how == f"pid {pid}"
        wait_for("its log line", lambda: f"relay-0 {pid}" in backend.log_tail("relay-0"))
        assert agent.step([SLEEPER], time.monotonic()) == []  # running: nothing to do
        assert agent.running() == [SLEEPER]
        # Unplaced: SIGTERM (a clean drain: exit 0), then forgotten.
        events = steps_until(agent, [], "relay-0 to stop", lambda ev: any(e.kind == "stopped" for e in ev))
        assert [e.kind for e in events] == ["stopping", "stopped"]
        assert agent.tracked == {} and backend.pid("relay-0") is None
    finally:
        backend.stop_all(5.0, print)


def test_a_daemon_that_keeps_dying_is_restarted_with_backoff_and_reported_failing(tmp_path):
    backend = make_backend(tmp_path)
    agent = Reconciler(backend, CrashLoop(deaths=3, window_s=60.0))
    try:
        events = steps_until(agent, [CRASHER], "three deaths", lambda ev: any(e.kind == "crash_loop" for e in ev))
        deaths = [e for e in events if e.kind == "died"]
        assert [e.exit for e in deaths] == ["exit code 3"] * 3
        assert [e.backoff_s for e in deaths] == [0.5, 1.0, 2.0]
        assert [e.sentence() for e in events if e.kind == "started" and e.restarts][0].startswith(
            "restarted rollout-0 (restart #1, pid ")
        crash = next(e for e in events if e.kind == "crash_loop")
        assert crash.deaths == 3 and crash.span_s >= 1.5  # the backoffs in between
        report = agent.report(time.monotonic())["rollout-0"]
        assert report["failing"] is True and report["restarts"] == 3 and report["last_exit"] == "exit code 3"
        assert backend.log_tail("rollout-0").count("rollout-0 ") == 3  # one line per run, appended
    finally:
        backend.stop_all(5.0, print)


def test_stop_all_kills_what_ignores_sigterm(tmp_path):
    stubborn = ProcessBackend(lambda p: [sys.executable, "-c",
                                         "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                         "print('ready', flush=True)\ntime.sleep(60)"],
                              lambda p: {"PATH": "/usr/bin:/bin"}, tmp_path / "logs")
    stubborn.start(SLEEPER)
    wait_for("it to ignore SIGTERM", lambda: "ready" in stubborn.log_tail("relay-0"))
    pid = stubborn.pid("relay-0")
    said: list[str] = []
    stubborn.stop_all(0.5, said.append)
    assert said == ["relay-0 ignored SIGTERM for 0s; killing it"]
    assert stubborn.children["relay-0"].proc is None
    assert stubborn.observe(SLEEPER).active is False
    assert not psutil.pid_exists(pid)  # killed and reaped


def test_paused_the_reconciler_records_a_death_and_starts_nothing_until_resumed(tmp_path):
    backend = make_backend(tmp_path)
    agent = Reconciler(backend)
    try:
        agent.step([SLEEPER], time.monotonic())
        pid = backend.pid("relay-0")
        agent.step([SLEEPER], time.monotonic(), paused=True)
        psutil.Process(pid).kill()  # an operator stops it for maintenance, or it crashed
        events = []
        wait_for("its death", lambda: events.extend(agent.step([SLEEPER], time.monotonic(), paused=True))
                 or any(e.kind == "died" for e in events))
        died = next(e for e in events if e.kind == "died")
        assert died.sentence() == ("relay-0 died (signal 9); paused: the agent starts nothing until "
                                   "`rlfleet resume`")
        held_from = time.monotonic()
        # Steps well past the backoff (0.5 s): still down, reported held, never started.
        wait_for("2 s held down", lambda: not [e for e in agent.step([SLEEPER], time.monotonic(), paused=True)
                                               if e.kind == "started"]
                 and backend.pid("relay-0") is None and time.monotonic() - held_from > 2.0, timeout_s=10)
        assert agent.report(time.monotonic())["relay-0"]["state"] == "held"
        events = agent.step([SLEEPER], time.monotonic())
        assert [(e.kind, e.restarts) for e in events] == [("started", 1)]
        assert backend.pid("relay-0") not in (None, pid)
        # Unplaced while paused: left running; stopped once resumed.
        assert agent.step([], time.monotonic(), paused=True) == [] and agent.running() == [SLEEPER]
        assert [e.kind for e in agent.step([], time.monotonic())] == ["stopping"]
    finally:
        backend.stop_all(5.0, print)
