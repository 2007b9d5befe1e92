"""tools/run/run_policy.py: what `rlfleet run` decides, in process, with plain values."""

from __future__ import annotations

from pathlib import Path

from rlfleet.tools.exit_codes import Exit, Outcome
from rlfleet.tools.run.run_policy import Every, RunPolicy

RUN = Path("/runs/job/1")


def test_a_crash_loop_ends_the_run_only_when_asked_to():
    assert RunPolicy(0, 60.0, 10).crash_loop("trainer-0", 5, 14.2, "exit code 1", RUN / "x.log") is None
    out = RunPolicy(5, 60.0, 10).crash_loop("trainer-0", 5, 14.2, "exit code 1", RUN / "x.log")
    assert out == Outcome(Exit.DAEMON_GAVE_UP, "gave up: trainer-0 died 5 times in 14 s (last: exit code 1); "
                                               "see /runs/job/1/x.log")


def test_no_step_for_max_idle_s_ends_a_run_with_a_trainer():
    p = RunPolicy(5, 60.0, 10)
    assert p.idle(now=160.0, last_step_at=100.0, has_trainer=True, last_step=7, logs=RUN / "logs") is None
    out = p.idle(now=160.5, last_step_at=100.0, has_trainer=True, last_step=7, logs=RUN / "logs")
    assert out == Outcome(Exit.NO_PROGRESS, "no training step for 60 s (since step 7; --max-idle-s); "
                                            "see /runs/job/1/logs")
    assert "since the start" in p.idle(500.0, 100.0, True, None, RUN).reason
    assert p.idle(500.0, 100.0, has_trainer=False, last_step=None, logs=RUN) is None  # nothing to wait for
    assert RunPolicy(5, None, 10).idle(1e9, 0.0, True, None, RUN) is None


def test_the_final_outcome():
    p = RunPolicy(5, 60.0, 10)
    broken = Outcome(Exit.ACCOUNTING_FAILED, "accounting invariant broken")
    gave_up = Outcome(Exit.DAEMON_GAVE_UP, "gave up")
    assert p.final(None, True, False, None, None, RUN) == Outcome(
        Exit.OK, "finished 10 steps; accounting ok; results in /runs/job/1")
    assert p.final(None, True, False, None, broken, RUN) == broken
    # A stop is news only when the accounting holds; a broken accounting is the worse news.
    assert p.final(None, False, True, None, None, RUN) == Outcome(
        Exit.STOPPED, "stopped: Ctrl-C or SIGTERM before the trainer finished")
    assert p.final(None, False, False, 30.0, None, RUN).reason == \
        "stopped: --duration 30 s ran out before the trainer finished"
    assert p.final(None, False, True, None, broken, RUN) == broken
    # A failure seen while running stands, whatever the accounting says.
    assert p.final(gave_up, False, False, None, broken, RUN) == gave_up


def test_every_is_due_at_once_then_once_per_period():
    e = Every(2.0)
    assert e.due(100.0) and not e.due(101.9) and e.due(102.0) and not e.due(103.0) and e.due(104.5)
