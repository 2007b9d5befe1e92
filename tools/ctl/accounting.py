"""The accounting invariant (ARCHITECTURE §3), checked from the job's own records.

Every prompt the job claimed (the etcd cursor) must be exactly one of:
  trained    its group is in a TRAINED record of the trainer's journal
  dropped    its group is in a DROPPED record, with a reason
  in flight  an env-host journal still holds it, or the trainer holds part of its group
Anything else is lost, and a group both trained and dropped is a conflict.

Read after the daemons stopped (the journals are locked while they run):

    rlfleet accounting RUN_DIR --job J --etcd E
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import PromptCursor
from rlfleet.common.control.store import Store


@dataclass
class Accounting:
    claimed: int
    trained: int
    dropped: dict[str, int]
    in_flight: int
    lost: list[int] = field(default_factory=list)
    conflicts: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.conflicts

    def to_json(self) -> dict[str, Any]:
        return {"claimed": self.claimed, "trained": self.trained, "dropped": self.dropped,
                "dropped_total": sum(self.dropped.values()), "in_flight": self.in_flight,
                "lost": self.lost[:50], "lost_total": len(self.lost),
                "conflicts": self.conflicts[:50], "ok": self.ok}

    def sentence(self) -> str:
        verdict = "invariant holds" if self.ok else f"INVARIANT BROKEN: {len(self.lost)} lost, {len(self.conflicts)} conflicts"
        return (f"{self.claimed} prompts claimed = {self.trained} trained + {sum(self.dropped.values())} dropped "
                f"{dict(self.dropped)} + {self.in_flight} in flight; {verdict}")


def check(store: Store, job: str, run_dir: Path, group_size: int) -> Accounting:
    """``group_size``: trajectories a prompt launches (journal.launched_per_prompt)."""
    from rlfleet.daemons.env_host.journal import TrajectoryJournal as EnvJournal
    from rlfleet.daemons.trainer.journal import ExperienceJournal as TrainerJournal

    cursor = PromptCursor.read(store, JobKeys(job))
    if cursor is not None and cursor.problem:
        raise ValueError(f"cannot tell how many prompts were claimed: {cursor.problem}")
    claimed = cursor.next if cursor is not None else 0

    trained: set[str] = set()
    dropped: dict[str, str] = {}
    pending: set[str] = set()
    trainer_journal = run_dir / "checkpoints" / "journal.bin"
    if trainer_journal.exists():
        with TrainerJournal(trainer_journal, fsync=False) as j:
            trained = set(j.state.trained)
            dropped = {g: reason for g, (reason, _) in j.state.dropped.items()}
            pending = set(j.state.pending)

    live: set[int] = set()
    for path in sorted((run_dir / "env-host").glob("*.jsonl")):
        journal = EnvJournal(path, group_size, fsync_claims=False)
        live.update(journal.live_prompts())
        journal.close()

    result = Accounting(claimed, 0, {}, 0)
    reasons: Counter[str] = Counter()
    for pid in range(claimed):
        gid = f"p{pid}"
        is_trained, is_dropped = gid in trained, gid in dropped
        if is_trained and is_dropped:
            result.conflicts.append(pid)
        elif is_trained:
            result.trained += 1
        elif is_dropped:
            reasons[dropped[gid]] += 1
        elif gid in pending or pid in live:
            result.in_flight += 1
        else:
            result.lost.append(pid)
    result.dropped = dict(sorted(reasons.items()))
    return result
