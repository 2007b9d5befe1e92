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

A checkpoint that fails for a full disk or another I/O error (docs/operations/disk-full.md) is
removed (the temporary folder and the space it took), the previous complete ones are
kept, and training goes on: ``Checkpointer.save`` logs one error line naming the folder
and the free bytes, counts it (CHECKPOINT_FAILURES), keeps the sentence in ``error``
(the trainer's ``checkpoint_error`` member field) until a checkpoint succeeds, and the
training loop tries again at the next interval (``retry_due``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.common import failpoints
from rlfleet.common.control.store import Store, StoreUnavailable
from rlfleet.common.durable import fsync_path

from .journal import ExperienceJournal
from .metrics_log import CHECKPOINT_FAILURES, io_reason, member_id

log = logging.getLogger("rlfleet.trainer")

STATE_FILE = "trainer_state.json"


class CheckpointError(Exception):
    """A checkpoint folder that cannot be restored; the message names the file."""


class CheckpointWriteError(Exception):
    """A checkpoint not written for an I/O error (a full disk); its partial folder is gone.
    ``free_at_failure`` / ``free_after``: the filesystem's free bytes when it failed and
    after the partial folder was removed."""

    def __init__(self, folder: Path, reason: str, cause: BaseException, free_at_failure: int,
                 free_after: int) -> None:
        super().__init__(f"{folder}: {reason}: {type(cause).__name__}: {cause}")
        self.folder, self.reason, self.cause = folder, reason, cause
        self.free_at_failure, self.free_after = free_at_failure, free_after


# Below this many free bytes when a checkpoint failed, the failure is taken for a full
# disk whatever was raised: torch.save reports ENOSPC as a RuntimeError without an errno.
FULL_BELOW_BYTES = 64 << 10
# What the serialisers' own exceptions say (safetensors: "I/O error: No space left on
# device (os error 28)"; torch.save: "PytorchStreamWriter failed writing file ...").
_NO_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_IO_TEXT = ("i/o error", "file write failed", "failed writing file")


def failure_reason(exc: BaseException, free_at_failure: int) -> str | None:
    """Why a checkpoint write failed: no_space, io_error, or None for an error that is
    neither (a bug in the backend's ``fill``: raised as it is)."""
    if not isinstance(exc, Exception):
        return None
    text = str(exc).lower()
    if isinstance(exc, OSError):
        reason = io_reason(exc)
    elif any(t in text for t in _NO_SPACE_TEXT):
        return "no_space"
    elif any(t in text for t in _IO_TEXT):
        reason = "io_error"
    else:
        reason = None
    if 0 <= free_at_failure < FULL_BELOW_BYTES:
        return "no_space"
    return reason


def free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return -1


def sweep_partial(root: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary folders of checkpoints that never finished (a trainer killed
    while writing one). Only for the journal's lock holder: nobody else writes here."""
    root = Path(root)
    gone = [p for p in root.glob(".tmp-step-*") if p.is_dir()] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


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
    made durable and renamed into place; the newest ``keep`` are kept. Returns the folder.

    An I/O error (a full disk) raises CheckpointWriteError after the temporary folder is
    removed: no partial ``step-*`` folder, the older ones untouched."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{version:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
        failpoints.trainer_kill_at("mid_checkpoint", version)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if final.exists():  # the same version saved again (e.g. on drain): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
    except Exception as exc:
        free_at = free_bytes(root)
        shutil.rmtree(tmp, ignore_errors=True)
        reason = failure_reason(exc, free_at)
        if reason is None:
            raise
        raise CheckpointWriteError(final, reason, exc, free_at, free_bytes(root)) from exc
    for old in checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s written (version %d)", final, version, extra={"event": "checkpoint"})
    return final


class Checkpointer:
    def __init__(self, learner: Any, journal: ExperienceJournal, folder: Path, *, store: Store, key: str,
                 is_leader: Callable[[], bool]) -> None:
        """Built by the journal's lock holder, so the partial folders it sweeps are nobody's."""
        self.learner, self.journal, self.folder = learner, journal, folder
        self.store, self.key, self.is_leader = store, key, is_leader
        self.error = ""  # the last failed checkpoint's sentence; "" after one succeeds
        self.failed_version = -1  # the version whose checkpoint last failed
        for p in sweep_partial(folder):
            log.warning("removed %s: a checkpoint that never finished", p,
                        extra={"event": "checkpoint_swept"})

    def retry_due(self, version: int, every: int) -> bool:
        """After a failed checkpoint, the next try waits ``every`` versions (a full disk
        is not fixed in one step, and each try writes the checkpoint's bytes again)."""
        return version - self.failed_version >= every

    def save(self, version: int) -> Path | None:
        """Write the learner's checkpoint for ``version``; None when not the leader or when
        it failed for an I/O error (logged, counted, kept in ``error``)."""
        if not self.is_leader():
            log.warning("not checkpointing version %d: leadership not confirmed", version)
            return None
        try:
            path = self.learner.save_checkpoint(self.folder, version, extra={"step": version})
        except CheckpointWriteError as exc:
            self._failed(version, exc)
            return None
        if self.error:
            log.info("checkpoint written again (version %d) after the failure at version %d",
                     version, self.failed_version, extra={"event": "checkpoint_ok"})
            self.error = ""
        record = {"version": version, "path": str(path.resolve()), "step": version,
                  "time": round(time.time(), 3)}
        try:
            self.store.put(self.key, record)
        except StoreUnavailable as exc:  # advisory: the folder is the truth
            log.warning("checkpoint record not written (etcd unreachable: %s)", exc)
        kept = checkpoints(self.folder)
        # Compact only what even the oldest kept checkpoint covers: if the newest one
        # turns out unreadable, resuming from the older one still finds its groups.
        try:
            saved = self.journal.compact(int(kept[-1].name.removeprefix("step-")))
        except OSError as exc:  # the journal stays as it was; compaction is tried next time
            log.warning("journal not compacted (%s: %s), %d bytes free", io_reason(exc), exc,
                        free_bytes(self.folder), extra={"event": "compact_error"})
        else:
            log.info("journal compacted by %d bytes", saved, extra={"event": "compact"})
        return path

    def _failed(self, version: int, exc: CheckpointWriteError) -> None:
        CHECKPOINT_FAILURES.labels(id=member_id(), reason=exc.reason).inc()
        kept = checkpoints(self.folder)
        self.failed_version = version
        self.error = (f"checkpoint of version {version} failed ({exc.reason}: {exc.cause}); "
                      f"{exc.free_after} bytes free in {self.folder}; "
                      f"keeping {kept[0].name if kept else 'no checkpoint'}")[:300]
        log.error("checkpoint %s not written (%s: %s): %d bytes free when it failed, %d after "
                  "removing the partial folder; keeping %s; training goes on (docs/operations/disk-full.md)",
                  exc.folder, exc.reason, exc.cause, exc.free_at_failure, exc.free_after,
                  kept[0] if kept else "no checkpoint", extra={"event": "checkpoint_error",
                                                               "reason": exc.reason})
