"""Intake: scored trajectories from the socket -> validated -> journaled (fsync) -> acked.

The order is the trainer's promise to the reward-host: a trajectory is acked only
once the journal holds it (or holds its group's drop), so a trainer killed at any
instant loses nothing that was acked. `triage` decides, without I/O, what becomes of
each arrival; `Intake.ingest` carries the decision out in the promised order.

Upstream-dropped and invalid trajectories drop their whole group, durably, before the
ack. A trajectory that can never be taken (empty ids, a group already full) is refused
for good (a negative ack carrying the reason), not dropped: its group is unaffected.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common import failpoints
from rlfleet.common.log_throttle import LogThrottle
from rlfleet.common.wire.messages import ScoredTrajectory, count_rejection
from rlfleet.common.wire.validation import confined

from .batching import INVALID, check_trajectory, drop_reason, identity_problem
from .claimed import ClaimedPrompts
from .journal import ExperienceJournal, until_written

log = logging.getLogger("rlfleet.trainer")


REFUSED_LOG_EVERY_S = 10.0  # one "refused" line per kind of refusal this often
MAX_BATCH = 512  # arrivals journaled (one fsync) and acked together, at most
LINGER_S = 0.001  # after a first arrival, how long to wait for more before journaling


@dataclass
class Triage:
    """What to do with one batch of arrivals, in the order they must be done."""

    new: list[ScoredTrajectory] = field(default_factory=list)  # journal as pending
    drops: list[tuple[str, str, str]] = field(default_factory=list)  # (group, reason, detail)
    ok: list[str] = field(default_factory=list)  # ack once the above is journaled
    # (key, why): negative ack. Content the trainer cannot train drops its group (in
    # ``drops``) and is refused after that is journaled; a trajectory that can never be
    # taken (bad ids, a full group) is refused and leaves its group as it was.
    refused: list[tuple[str, str]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # new, dropped, duplicate


def triage(got: Sequence[tuple[str, ScoredTrajectory]], duplicate: Sequence[bool | str],
           group_sizes: dict[str, int], group_size: int, vocab_size: int | None,
           max_version: int | None = None, launched: int | None = None,
           claimed_below: int | None = None) -> Triage:
    """Decide each arrival. ``duplicate[i]``: the journal already holds ``got[i]`` (a
    string: holds another trajectory under its id, and why, ExperienceJournal.duplicates);
    ``group_sizes``: trajectories the journal holds per group (not modified);
    ``max_version``: the newest version the trainer made (a later weight_version is forged);
    ``launched``: trajectories a prompt launches (group_size + redundant samples; default G);
    ``claimed_below``: prompts below it were claimed (claimed.py; None: not checked)."""
    out = Triage()
    counts = dict(group_sizes)
    seen: set[tuple[str, str]] = set()
    for (key, st), dup in zip(got, duplicate):
        t = st.trajectory
        if not t.trajectory_id or not t.group_id:
            out.refused.append((key, "trajectory_id and group_id must be non-empty"))
            continue
        if problem := identity_problem(st, launched or group_size):
            out.refused.append((key, f"identity: {problem}"))
            continue
        if claimed_below is not None and t.prompt_id >= claimed_below:
            out.refused.append((key, f"identity: prompt {t.prompt_id} was never claimed "
                                     f"(the cursor is at {claimed_below})"))
            continue
        if isinstance(dup, str):  # a squat, or its victim arriving second: refused, never merged
            out.refused.append((key, f"identity: {dup}"))
            continue
        if dup or (t.group_id, t.trajectory_id) in seen:
            out.counts["duplicate"] += 1
            out.ok.append(key)
            continue
        if counts.get(t.group_id, 0) >= group_size:
            # Checked before drops too: a complete group may be in training right now.
            out.refused.append((key, f"group {t.group_id} already holds {group_size} trajectories"))
            continue
        seen.add((t.group_id, t.trajectory_id))
        reason, detail = drop_reason(st)
        if not reason and (problem := check_trajectory(st, vocab_size, max_version)):
            reason, detail = INVALID, problem
        if reason:
            out.drops.append((t.group_id, reason, detail))
            out.counts["dropped"] += 1
        else:
            counts[t.group_id] = counts.get(t.group_id, 0) + 1
            out.new.append(st)
            out.counts["new"] += 1
        if reason == INVALID:  # the sender learns why its content was not taken
            out.refused.append((key, f"invalid: {detail}"))
        else:
            out.ok.append(key)
    return out


class Intake:
    """Owns the trainer's ReliableReceiver socket, on the thread that calls ``run``."""

    def __init__(self, journal: ExperienceJournal, *, bind_host: str, group_size: Callable[[], int],
                 vocab_size: int | None, counts: Counter[str], on_data: Callable[[], None],
                 on_bound: Callable[[], None] = lambda: None,
                 launched: Callable[[], int] | None = None,
                 claimed: ClaimedPrompts | None = None) -> None:
        """``group_size`` is asked per batch (a reloaded spec applies at once);
        ``on_data`` wakes the training loop when something was journaled; ``on_bound``
        tells the daemon the address to publish is known."""
        self.journal, self.bind_host = journal, bind_host
        self.group_size, self.vocab_size = group_size, vocab_size
        self.launched = launched or group_size  # a prompt's trajectories: G + redundant samples
        self.counts, self.on_data, self.on_bound = counts, on_data, on_bound
        self.claimed = claimed  # None: prompt ids are not checked against the cursor (unit tests)
        self.endpoint: str | None = None
        self.bound = threading.Event()
        self._refused_log = LogThrottle(REFUSED_LOG_EVERY_S)

    def run(self, stop: threading.Event) -> None:
        from rlfleet.common.wire.reliable import ReliableReceiver

        receiver = ReliableReceiver(f"tcp://{self.bind_host}:0", expect=ScoredTrajectory,
                                    name="trainer-trajectories", edge="trainer-trajectories")
        try:
            self.endpoint = receiver.endpoint
            self.bound.set()
            self.on_bound()
            log.info("receiving trajectories on %s", receiver.endpoint, extra={"event": "bind"})
            while not stop.is_set():
                got = list(receiver.drain(timeout=0.2, max_n=MAX_BATCH))
                if got and len(got) < MAX_BATCH:
                    # Linger a moment for the rest of a burst: one journal write, fsync
                    # and ack for all of it (the fixed cost per batch is ~2x that of a
                    # trajectory). Acks wait at most LINGER_S more.
                    got += receiver.drain(timeout=LINGER_S, max_n=MAX_BATCH - len(got))
                if got:
                    # A journal that cannot be written (a full disk, docs/operations/disk-full.md) holds
                    # this batch, unacked, until it can: the senders wait or resend; acking
                    # first would lose it, ending the intake would crash-loop the trainer.
                    until_written(lambda: self.ingest_confined(receiver, got), stop)
        finally:
            self.endpoint = None
            receiver.close()

    def ingest_confined(self, receiver: Any, got: list[tuple[str, Any]]) -> None:
        """``ingest``, with a failure confined to the arrival that caused it: a batch that
        raises is taken again one by one, and an arrival that still raises alone is
        refused for good (counted and logged by ``confined``), so neither the intake
        thread nor the rest of its batch goes down with it. A journal that cannot be
        written (OSError) is no arrival's fault: it is raised, nothing acked, for ``run``
        to try the batch again (a retry finds what was journaled already a duplicate)."""
        try:
            self.ingest(receiver, got)
            return
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 — find the one arrival (below)
            if len(got) == 1:
                self._refuse_failed(receiver, got[0][0], exc)
                return
        for one in got:
            try:
                self.ingest(receiver, [one])
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 — counted and logged in _refuse_failed
                self._refuse_failed(receiver, one[0], exc)

    @staticmethod
    def _refuse_failed(receiver: Any, key: str, exc: Exception) -> None:
        with confined(getattr(receiver, "name", "trainer-trajectories"), "ScoredTrajectory"):
            raise exc  # counted as handler_error, its traceback logged once per kind
        receiver.ack([key], ok=False, error=f"the trainer failed handling it: {type(exc).__name__}")

    def ingest(self, receiver: Any, got: list[tuple[str, Any]]) -> None:
        """Journal what is new, drop what cannot be trained, then ack: in that order."""
        journal = self.journal
        arrived = [st for _, st in got]
        sizes = journal.group_sizes({st.trajectory.group_id for st in arrived})
        newest = max((st.trajectory.prompt_id for st in arrived), default=-1)
        claimed_below = self.claimed.below(newest) if self.claimed is not None else None
        decided = triage(got, journal.duplicates(arrived), sizes, self.group_size(), self.vocab_size,
                         journal.state.max_version, self.launched(), claimed_below)
        self.counts.update(decided.counts)
        for _, reason, _ in decided.drops:  # untrainable content (NaN reward, out-of-vocab ids):
            if reason == INVALID:  # its group is dropped durably, and the rejection counted
                count_rejection(getattr(receiver, "name", "trainer-trajectories"), "invalid")
        journal.append_trajectories(decided.new)
        journal.record_dropped(decided.drops)
        if failpoints.trainer_exits_after_journal() and (decided.new or decided.drops):
            log.warning("failpoint: exiting after journaling, before the ack")
            os._exit(17)
        receiver.ack(decided.ok)
        for key, why in decided.refused:
            self.counts["refused"] += 1
            # one line per kind ("identity", "invalid", ...) and interval; counts["refused"] has them all
            self._refused_log.warning(log, why.split(":", 1)[0], "refused %s: %s", key, why,
                                      extra={"event": "refuse"})
            receiver.ack([key], ok=False, error=why)
        if decided.new or decided.drops:
            self.on_data()
