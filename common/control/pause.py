"""The job's maintenance state as a daemon follows it (docs/operations/maintenance-mode.md).

`rlfleet pause` writes `state` = paused (`rlfleet stop`: stopped); the trainer, every node agent and the
supervisor of `rlfleet run` each read it once per cycle (one Range on one key)
through a `PauseWatch`. An etcd outage keeps the last state read: losing etcd
must neither pause a running job nor resume a paused one by itself.
"""

from __future__ import annotations

import time

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.operations import JobState
from rlfleet.common.control.store import Store, StoreUnavailable


class PauseWatch:
    def __init__(self, store: Store, keys: JobKeys) -> None:
        self.store, self.keys = store, keys
        self.state: JobState | None = None  # the last record read; None: absent (running)

    @property
    def paused(self) -> bool:
        return self.state is not None and self.state.paused

    @property
    def stopped(self) -> bool:
        return self.state is not None and self.state.stopped

    def read(self) -> str | None:
        """One read of `state`; a sentence when the job was paused, stopped, resumed or
        started since the last."""
        was = (self.paused, self.stopped)
        try:
            self.state = JobState.read(self.store, self.keys)
        except StoreUnavailable:
            return None  # keep acting on the last state read
        if (self.paused, self.stopped) == was:
            return None
        if self.paused or self.stopped:
            return describe(self.state)
        return "job resumed" if was[0] else "job started"


def describe(state: JobState | None) -> str:
    """"job paused since 12:03:04 by ann@h1: kernel upgrade" (or "job stopped since ...",
    or "job running")."""
    if state is None or not (state.paused or state.stopped):
        return "job running"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.since)) if state.since else "?"
    reason = f": {state.reason}" if state.reason else ""
    return f"job {state.state} since {since} by {state.by or '?'}{reason}"
