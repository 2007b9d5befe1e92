"""Every exit code of the `rlfleet` command, in one place.

A script that starts a job reads the code; the one-line reason printed beside it
is for the person. Codes 4–8 are `rlfleet run`'s own outcomes; docs/guide/running.md's
"Exit codes" table and `rlfleet run --help` list the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Exit(IntEnum):
    OK = 0                 # run: the trainer finished max_steps and the accounting invariant holds
    FAILURE = 1            # a read command saw a problem (status), an accounting check failed, ...
    BAD_SPEC = 2           # bad usage or a spec that does not validate (click's usage errors are 2 too)
    ETCD_UNREACHABLE = 3   # the etcd given could not be reached, or the private one did not start
    ACCOUNTING_FAILED = 4  # run: the job ended but the accounting invariant is broken or could not be checked
    DAEMON_GAVE_UP = 5     # run: a daemon died --give-up-after times within its window
    NO_PROGRESS = 6        # run: no training step within --max-idle-s
    STOPPED = 7            # run: stopped before the end at the operator's request (--duration, Ctrl-C, SIGTERM)
    JOB_OWNED = 8          # run: another live `rlfleet run` owns the job (refused), or took it over (--take-over)
    REFUSED = 9            # an operator command (node, switchover, pause, etcd) refused: its target cannot take it
    TIMED_OUT = 10         # an operator command's request was written but not done within --timeout (it stays in effect)


# What `rlfleet run --help` and docs/guide/running.md say about each code of `rlfleet run`.
RUN_CODES: dict[Exit, str] = {
    Exit.OK: "the trainer finished and the accounting invariant holds",
    Exit.FAILURE: "an unexpected error (its traceback says where)",
    Exit.BAD_SPEC: "the spec (or an option) does not validate",
    Exit.ETCD_UNREACHABLE: "etcd unreachable (--etcd), or the private etcd did not start",
    Exit.ACCOUNTING_FAILED: "accounting invariant broken, or not checked",
    Exit.DAEMON_GAVE_UP: "a daemon kept dying (--give-up-after)",
    Exit.NO_PROGRESS: "no training step within --max-idle-s",
    Exit.STOPPED: "stopped early by --duration, Ctrl-C or SIGTERM",
    Exit.JOB_OWNED: "another live run owns the job (refused; --take-over replaces it), or took this one over",
}


# What the operator commands (`rlfleet node`, `switchover`, `pause`, `resume`, `stop`, `start`, `etcd`) exit
# with; docs/operations/live-fleet.md lists the same codes.
OPERATOR_CODES: dict[Exit, str] = {
    Exit.OK: "done: the request took effect and what it waits for was seen",
    Exit.FAILURE: "an unexpected error (its message says what)",
    Exit.BAD_SPEC: "bad usage: an unknown option, host or role",
    Exit.ETCD_UNREACHABLE: "etcd unreachable",
    Exit.REFUSED: "refused: the target is not in a state that allows it (the message says which and why)",
    Exit.TIMED_OUT: "written, but not done within --timeout; the request stays in effect",
}


# A benchmark that caps a run with --duration takes either ending as a run whose results count.
RUN_ENDED = (Exit.OK, Exit.STOPPED)


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the exit code and the one line that explains it."""
    code: Exit
    reason: str

    def line(self) -> str:
        return f"rlfleet run: {self.reason} (exit {int(self.code)}, {self.code.name.lower().replace('_', ' ')})"
