"""What `rlfleet run` decides, apart from processes, etcd and the view (supervisor.py does
the I/O): when a crash loop ends the run, when a run without training steps has stalled,
how often each periodic check runs, and which outcome a run ends with. Plain values in,
an Outcome (or None) out: tested in process (tests/tools/run/test_run_policy.py), as the
trainer's intake triage and the reward-host's dispatch are.

When a daemon is restarted and with which back-off is the node agent's policy
(daemons/agent/policy.py); `rlfleet run` is the agent of its own machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlfleet.tools.exit_codes import Exit, Outcome


@dataclass
class Every:
    """A check that runs at most once per ``period_s`` (``due(now)`` says whether now)."""

    period_s: float
    last: float = float("-inf")

    def due(self, now: float) -> bool:
        if now - self.last < self.period_s:
            return False
        self.last = now
        return True


@dataclass(frozen=True)
class RunPolicy:
    give_up_deaths: int        # 0: a crash loop is reported, never the end of the run
    max_idle_s: float | None   # no training step for this long ends the run (None/0: never)
    max_steps: int

    def crash_loop(self, name: str, deaths: int, span_s: float, last_exit: str, log_path: Path) -> Outcome | None:
        """A daemon died ``deaths`` times within ``span_s``: the end of the run, or not."""
        if not self.give_up_deaths:
            return None
        return Outcome(Exit.DAEMON_GAVE_UP, f"gave up: {name} died {deaths} times in {span_s:.0f} s "
                                            f"(last: {last_exit}); see {log_path}")

    def idle(self, now: float, last_step_at: float, has_trainer: bool, last_step: int | None,
             logs: Path) -> Outcome | None:
        """No training step since ``last_step_at`` (a paused job counts as stepping)."""
        if not (self.max_idle_s and has_trainer and now - last_step_at > self.max_idle_s):
            return None
        since = "since the start" if last_step is None else f"since step {last_step}"
        return Outcome(Exit.NO_PROGRESS, f"no training step for {self.max_idle_s:.0f} s ({since}; --max-idle-s); "
                                         f"see {logs}")

    @staticmethod
    def stopped(by_signal: bool, duration_s: float | None) -> Outcome:
        if by_signal:
            return Outcome(Exit.STOPPED, "stopped: Ctrl-C or SIGTERM before the trainer finished")
        return Outcome(Exit.STOPPED, f"stopped: --duration {duration_s:g} s ran out before the trainer finished")

    def final(self, failure: Outcome | None, finished: bool, by_signal: bool, duration_s: float | None,
              accounting_failure: Outcome | None, run_dir: Path) -> Outcome:
        """The run's outcome once its daemons are stopped and the accounting checked: a
        failure seen while running stands; a stop (signal, --duration) gives way to a broken
        accounting, which is the worse news; a finished run with a sound accounting is OK."""
        if failure is None and not finished:
            failure = self.stopped(by_signal, duration_s)
        if failure is None or (failure.code == Exit.STOPPED and accounting_failure is not None):
            failure = accounting_failure or failure
        return failure or Outcome(Exit.OK, f"finished {self.max_steps} steps; accounting ok; results in {run_dir}")
