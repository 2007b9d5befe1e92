"""Checkpoints of the learner, their etcd record, and the journal compaction they allow.

A checkpoint is written only while leadership is confirmed: a trainer that may have
been replaced must not write into the shared checkpoint folder. The folder is the
truth; ``trainer/checkpoint`` in etcd is advisory (an unreachable etcd skips it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.common.store import Store, StoreUnavailable

from .journal import Journal

log = logging.getLogger("rlfleet.trainer")


class Checkpointer:
    def __init__(self, learner: Any, journal: Journal, folder: Path, *, store: Store, key: str,
                 is_leader: Callable[[], bool]) -> None:
        self.learner, self.journal, self.folder = learner, journal, folder
        self.store, self.key, self.is_leader = store, key, is_leader

    def save(self, version: int) -> Path | None:
        """Write the learner's checkpoint for ``version``; None when not the leader."""
        from .learner import checkpoints

        if not self.is_leader():
            log.warning("not checkpointing version %d: leadership not confirmed", version)
            return None
        path = self.learner.save_checkpoint(self.folder, version, extra={"step": version})
        record = {"version": version, "path": str(path.resolve()), "step": version,
                  "time": round(time.time(), 3)}
        try:
            self.store.put(self.key, record)
        except StoreUnavailable as exc:  # advisory: the folder is the truth
            log.warning("checkpoint record not written (etcd unreachable: %s)", exc)
        kept = checkpoints(self.folder)
        # Compact only what even the oldest kept checkpoint covers: if the newest one
        # turns out unreadable, resuming from the older one still finds its groups.
        saved = self.journal.compact(int(kept[-1].name.removeprefix("step-")))
        log.info("journal compacted by %d bytes", saved, extra={"event": "compact"})
        return path
