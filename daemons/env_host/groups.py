"""Redundant rollouts (ROLL Flash §5.2.2, RollArt §6.3): which finished trajectory of a
prompt is handed on, which is kept as a spare, and when a round has enough groups.

Pure bookkeeping, no I/O: the runner asks and does what it is told.

A prompt launches ``group_size + redundant_samples`` trajectories. The first
``group_size`` that finish well are handed on as its group; when they have, the others
still running are cancelled and kept as spares (``redundant``). A failed trajectory is
kept as a spare too while the ones still running can still make the group whole (a
failed environment does not cost the group); once they cannot, it is handed on, and the
trainer drops the group with its reason, as without redundancy.

In the ``batch`` env mode a round is the prompts claimed together, ``redundant_prompts``
more than a batch needs: once ``needed`` of them have complete groups, the rest of the
round is abandoned: its running trajectories are cancelled and handed on as dropped
``redundant``, so the trainer records the group as dropped (accounted, never lost).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

REDUNDANT = "redundant"

Verdict = Literal["hand_on", "spare"]


@dataclasses.dataclass
class PromptGroup:
    group_size: int
    launched: int
    handed: int = 0  # handed on (or to be re-sent after a restart)
    good: int = 0  # of those, finished well
    running: int = 0
    abandoned: bool = False  # its round has enough groups: everything left is dropped

    @property
    def complete(self) -> bool:
        """A whole group of good trajectories has been handed on."""
        return self.good >= self.group_size

    def finished(self, ok: bool) -> Verdict:
        """One of its trajectories ended (``ok``: not dropped); counts it and says what to do."""
        self.running -= 1
        if self.handed >= self.group_size:
            return "spare"  # the group is whole: a late finisher is not needed
        if not ok and not self.abandoned and self.handed + self.running >= self.group_size:
            return "spare"  # the others still running can make the group whole
        self.handed += 1
        self.good += ok
        return "hand_on"

    def cancel_now(self) -> bool:
        """Whether its running trajectories are no longer needed."""
        return self.running > 0 and (self.handed >= self.group_size or self.abandoned)


@dataclasses.dataclass
class Round:
    """The prompts of one ``batch``-mode claim and how many complete groups it needs."""
    prompts: list[int]
    needed: int
    abandoned: bool = False
    # Remembered here: the runner forgets a group once all its trajectories are acked,
    # often before the round's next group is whole.
    complete: set[int] = dataclasses.field(default_factory=set)

    def group_complete(self, prompt_id: int) -> bool:
        """Count ``prompt_id``'s group as whole; True once the round has enough."""
        self.complete.add(prompt_id)
        return len(self.complete) >= self.needed
