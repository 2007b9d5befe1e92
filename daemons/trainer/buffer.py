"""The trainer's buffer policy (RollArt §6.2): what is evicted before a batch is taken,
and in which order the complete groups waiting in the journal are taken.

Pure functions over (group id, trajectories) pairs, no I/O; the training loop
(training.py) calls them on every pass, i.e. before every batch:

1. ``evict_stale``: every pending group, complete or still arriving, holding a
   trajectory staler than α = ``trainer.max_staleness`` is dropped ("staleness").
   Staleness only grows while a group waits, so such a group could never be trained;
   dropping it at once frees its place and, through the trainer's progress record,
   lets the env-hosts claim a fresh prompt (daemons/env_host/pacing.py).
2. ``ordered``: the complete groups in the order ``trainer.buffer_order`` takes them:
   ``fifo`` (oldest completion first, the default and the behaviour before the option
   existed), ``newest`` (newest completion first: the freshest data trains, older
   groups age out), ``staleness`` (the stalest first: a long-tail group that started
   on an old version is trained before it crosses α).
3. ``evict_overflow``: the buffer holds at most (1 + α) x batch_size trajectories,
   (1 + α) x B/G complete groups; the groups beyond it at the tail of that order, the
   ones the strategy would take last, are dropped ("buffer_full"). With claim pacing
   on, the env-hosts keep at most α batches outstanding and this never fires; it bounds
   the buffer when pacing is off (``env_host.pace_claims = false``) or widened
   (``trainer.max_extra_prompts``).

Every eviction is a drop with a reason, journaled like any other
(Journal.record_dropped), so the accounting invariant holds: every claimed prompt
ends trained, dropped with a reason, or still in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rlfleet.common.wire.messages import ScoredTrajectory

from .batching import STALENESS, staleness

BUFFER_FULL = "buffer_full"

BufferOrder = Literal["fifo", "newest", "staleness"]
ORDERS: tuple[str, ...] = ("fifo", "newest", "staleness")

Group = tuple[str, Sequence[ScoredTrajectory]]
Drop = tuple[str, str, str]  # (group, reason, detail), as Journal.record_dropped takes them


def capacity_groups(batch_groups: int, max_staleness: int | None) -> int | None:
    """How many complete groups the buffer may hold: (1 + α) batches; None when α is unset."""
    return None if max_staleness is None else (1 + max_staleness) * batch_groups


def evict_stale(pending: Sequence[Group], trainer_version: int, max_staleness: int | None) -> list[Drop]:
    """The groups holding a trajectory staler than α, with the stalest one named."""
    if max_staleness is None:
        return []
    drops = []
    for group_id, trajectories in pending:
        ages = [staleness(st, trainer_version) for st in trajectories]
        if ages and max(ages) > max_staleness:
            worst = max(range(len(ages)), key=ages.__getitem__)
            drops.append((group_id, STALENESS, f"{trajectories[worst].trajectory.trajectory_id}: staleness "
                                               f"{ages[worst]} > max_staleness {max_staleness}"))
    return drops


def ordered(complete: Sequence[Group], order: str, trainer_version: int) -> list[Group]:
    """``complete`` (oldest completion first, as Journal.complete_groups gives it) in the
    order ``order`` takes it; ties keep completion order."""
    if order == "fifo":
        return list(complete)
    if order == "newest":
        return list(reversed(complete))
    if order == "staleness":
        def oldest(group: Group) -> int:
            return -max((staleness(st, trainer_version) for st in group[1]), default=0)
        return sorted(complete, key=oldest)  # sorted is stable: equal staleness stays FIFO
    raise ValueError(f"buffer_order must be one of {', '.join(ORDERS)}, got {order!r}")


def evict_overflow(in_order: Sequence[Group], capacity: int | None, order: str) -> list[Drop]:
    """The groups beyond ``capacity`` at the tail of ``in_order``."""
    if capacity is None or len(in_order) <= capacity:
        return []
    held = len(in_order)
    return [(group_id, BUFFER_FULL, f"{held} complete groups > (1 + max_staleness) x batch = {capacity}; "
                                    f"the last in {order!r} order")
            for group_id, _ in in_order[capacity:]]
