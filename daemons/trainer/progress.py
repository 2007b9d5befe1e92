"""trainer/progress: how many groups the trainer consumed, which env-hosts pace their
claims by (docs/design/dataflow.md, "Staleness: the bound and the pacing").

Written on its own thread whenever it changes (coalesced: at most every
PROGRESS_EVERY_S), so an etcd outage never holds up a training step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rlfleet.common.control.store import Store, StoreUnavailable

from .journal import JournalState

log = logging.getLogger("rlfleet.trainer")

PROGRESS_EVERY_S = 0.02  # trainer/progress is written at most this often


def progress_record(state: JournalState, version: int, group_size: int = 0) -> dict[str, int]:
    """What trainer/progress says: env-hosts pace their claims by consumed_groups, and
    in the one_step_off mode start a batch once every earlier group was received
    (``received_groups``: trained, dropped, or complete and waiting)."""
    trained, dropped = len(state.trained), len(state.dropped)
    waiting = sum(1 for ts in list(state.pending.values()) if group_size and len(ts) >= group_size)
    return {"version": version, "consumed_groups": trained + dropped,
            "trained_groups": trained, "dropped_groups": dropped,
            "received_groups": trained + dropped + waiting}


class ProgressWriter:
    def __init__(self, store: Store, key: str, read: Callable[[], dict[str, int]], *,
                 may_write: Callable[[], bool] = lambda: True) -> None:
        """``may_write``: confirmed leadership; a failsafe leader (docs/operations/failsafe.md) writes
        what it trained once its leadership is confirmed, a superseded one never."""
        self.store, self.key, self.read, self.may_write = store, key, read, may_write

    def run(self, stop: threading.Event) -> None:
        last: dict[str, int] | None = None
        failing = False
        while not stop.wait(PROGRESS_EVERY_S):
            now = self.read()
            if now == last or not self.may_write():
                continue
            try:
                self.store.put(self.key, {**now, "time": round(time.time(), 3)})
                last, failing = now, False
            except StoreUnavailable as exc:
                if not failing:
                    log.warning("cannot write %s (etcd unreachable: %s); env-hosts wait",
                                self.key, exc, extra={"event": "progress_failed"})
                failing = True
