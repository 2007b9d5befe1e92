"""Where a restored learner starts, and the steps it trains again (docs/design/dataflow.md,
"Restart: no step lost").

A trainer restarted (kill -9, a new leader) or rewound (guard.py: too many steps skipped
for non-finite numbers) loads the newest loadable checkpoint, version C: its weights,
optimizer and RNG state *and its version*. The journal says which groups were trained
after C, at versions C+1 .. V: their effect on the weights is gone, so they are reopened
and trained again, **in their original batches at their original versions**: step C+1
trains what step C+1 trained before, and so on up to V.

The staleness rule: a group's staleness is the step that trains it minus the version it
was generated for. Re-trained at its original step, a group has exactly the staleness it
was admitted with (<= max_staleness), so none is dropped for it; a pending group that
arrived meanwhile is judged against the restored version, which is never later than the
one it would have met before the restart.

From the same checkpoint, optimizer and RNG state and the same batches, the re-trained
versions reproduce the lost ones up to floating-point nondeterminism, so the versions the
relays already carry (up to V) stay in the trainer's lineage. Versions never go backwards
on the wire: nothing below V is published again (``Replay.may_publish``); V itself is
(a relay that holds it takes no chunks, one that lost it gets it back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpointing import checkpoints
from .journal import ExperienceJournal

log = logging.getLogger("rlfleet.trainer")


@dataclass
class Replay:
    """The steps a restored learner trains again: version -> the groups that version
    trained before the restore (in their order); ``made_up_to``: the highest version
    any step made before it (the journal's), already published or about to be."""

    batches: dict[int, list[str]] = field(default_factory=dict)
    made_up_to: int = 0

    def take(self, version: int) -> list[str]:
        """The groups step ``version`` trained before, once ([] if none are known)."""
        return self.batches.pop(version, [])

    def may_publish(self, version: int) -> bool:
        return version >= self.made_up_to

    @property
    def steps_left(self) -> int:
        return len(self.batches)

    @property
    def groups_left(self) -> int:
        return sum(len(b) for b in self.batches.values())


def restore(learner: Any, journal: ExperienceJournal, folder: Path) -> Replay:
    """Load the newest loadable checkpoint under ``folder`` into ``learner`` (none: the
    learner stays as built, version 0), reopen the groups trained after it, and return
    the replay plan."""
    for ckpt in checkpoints(folder):
        try:
            learner.load_checkpoint(ckpt)
            break
        except Exception as exc:  # noqa: BLE001 — fall back to the older one
            log.warning("checkpoint %s unreadable (%s); trying an older one", ckpt, exc)
    made_up_to = journal.state.max_version
    batches = journal.reopen_trained_after(learner.version)
    if batches:
        log.info("restored version %d: re-training the %d groups of versions %d..%d in their "
                 "original batches; publishing resumes at version %d", learner.version,
                 sum(len(b) for b in batches.values()), min(batches), max(batches), made_up_to,
                 extra={"event": "replay"})
    return Replay(batches, made_up_to)
