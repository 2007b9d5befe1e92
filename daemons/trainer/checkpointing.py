"""Checkpoints of the learner: their folders, their etcd record, and the journal
compaction they allow. Torch-free, so every trainer backend shares it.

A checkpoint is a folder ``step-<version:08d>/`` whose ``trainer_state.json``
(STATE_FILE, written last) says its version; what else it holds is the backend's
(the torch learner: an HF model, optimizer and RNG state; the sim learner: nothing
more). ``write_checkpoint`` fills it under a temporary name and renames it, so a
folder named ``step-*`` is always complete; ``checkpoints`` lists the complete ones.

A checkpoint is written only while leadership is confirmed: a trainer that may have
been replaced must not write into the shared checkpoint folder. The folder is the
truth; ``trainer/checkpoint`` in etcd is advisory (an unreachable etcd skips it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.common.durable import fsync_path
from rlfleet.common.store import Store, StoreUnavailable

from .journal import Journal

log = logging.getLogger("rlfleet.trainer")

STATE_FILE = "trainer_state.json"


class CheckpointError(Exception):
    """A checkpoint folder that cannot be restored; the message names the file."""


def checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint folders under root, newest version first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def write_checkpoint(root: str | os.PathLike[str], version: int, fill: Callable[[Path], None],
                     keep: int = 2) -> Path:
    """``root/step-<version>/``, filled by ``fill(folder)`` (which writes STATE_FILE last),
    made durable and renamed into place; the newest ``keep`` are kept. Returns the folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{version:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():  # the same version saved again (e.g. on drain): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s written (version %d)", final, version, extra={"event": "checkpoint"})
    return final


class Checkpointer:
    def __init__(self, learner: Any, journal: Journal, folder: Path, *, store: Store, key: str,
                 is_leader: Callable[[], bool]) -> None:
        self.learner, self.journal, self.folder = learner, journal, folder
        self.store, self.key, self.is_leader = store, key, is_leader

    def save(self, version: int) -> Path | None:
        """Write the learner's checkpoint for ``version``; None when not the leader."""
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
