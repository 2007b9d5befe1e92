"""The training thread's loop; one step reads like the algorithm.

    every pass: first a step lost to a restore, in its original batch (resume.py); else
    evict what is beyond the staleness bound α or the buffer's (1 + α) x B (buffer.py)
    whenever B/G complete groups are pending (after_batch filtering: of finished rounds):
        take them in buffer_order, select (no-signal filter)  -> learner.train_step  -> journal the trained groups
        -> hand the version to the publisher -> metrics line -> checkpoint every N steps
        -> held-out evaluation when due

A step that meets a non-finite number (guard.py) is skipped before the update: its groups
are dropped as ``non_finite``; ``max_skipped_steps`` in a row restore the last checkpoint
(``rewind``), as does an update that made the weights non-finite, before any publication.

A full disk (docs/operations/disk-full.md): a journal record that cannot be written is retried
(``until_written``) with the loop's status ``stalled: journal ...``; a step whose TRAINED
record is not written yet is neither published nor checkpointed, nor is another batch
taken, so a trainer stopped meanwhile resumes as if the step never ran. A checkpoint that
fails is skipped (``checkpoint_error``) and tried again ``checkpoint_every`` versions later.

Paused (`rlfleet pause`, docs/operations/maintenance-mode.md): checked at the top of each pass,
i.e. at a step boundary: the step in progress has finished; the last version is
checkpointed, and no batch is taken until resumed. The intake goes on journaling and
acknowledging what arrives (nothing is lost); it waits, pending, for the resume.

``RLFLEET_TRAINER_STEP_DELAY_S`` (tests and tools/bench/losses.py only; common/failpoints.py):
the loop waits that many seconds after every step, a slow trainer, so that staleness really
reaches α.

A version is journaled (TRAINED) before it is published, so a restarted trainer's
versions start above every version the relays have seen. When everything arriving
is too stale to train, the current version is published again (``republish_if_starved``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common import failpoints
from rlfleet.common.spec.job import JobSpec

from .batching import (
    INVALID,
    NO_SIGNAL,
    NON_FINITE,
    STALENESS,
    NonFiniteStep,
    in_finished_rounds,
    select_groups,
    staleness,
)
from .buffer import capacity_groups, evict_overflow, evict_stale, ordered
from .checkpointing import Checkpointer, checkpoints
from .evaluation import policy_to_evaluate
from .journal import ExperienceJournal, JournalUnwritable, until_written
from .metrics_log import PAUSED, MetricsLog, batch_versions, step_line
from .resume import Replay, restore

log = logging.getLogger("rlfleet.trainer")

REPUBLISH_AFTER_S = 5.0  # of only-stale arrivals before the current version is pushed again
PAUSE_CHECKPOINT_RETRY_S = 5.0  # paused, its checkpoint refused (leadership unconfirmed): try again after


@dataclass
class TrainerState:
    """What the member record shows (``training`` status, versions) and the logs count.

    ``status``: starting, resuming, waiting (for complete groups), training, done
    (max_steps reached: still receiving and journaling, not training), pausing
    (paused, its checkpoint not written yet), paused, stopped, or error: <why>.
    ``paused``: held at a step boundary with the current version checkpointed.
    Written by the trainer's threads, read by the daemon's cycle."""

    status: str = "starting"
    error: str = ""
    version: int = 0
    checkpoint_version: int = 0
    paused: bool = False
    counts: Counter[str] = field(default_factory=Counter)  # intake outcomes, republishes
    checkpoint_error: str = ""  # the last failed checkpoint's sentence; "" after one succeeds
    non_finite_steps: int = 0  # steps skipped for a non-finite number (guard.py), since start
    non_finite_groups: int = 0  # groups dropped as non_finite (their reward, or a skipped step)
    non_finite: str = ""  # the last one's sentence, with its values
    rewinds: int = 0  # checkpoints restored after skipped steps
    journal: ExperienceJournal | None = field(default=None, repr=False)  # for journal_error

    @property
    def journal_error(self) -> str:
        """Why the journal's last write failed ("" when it succeeded): intake and training wait."""
        return self.journal.write_error if self.journal is not None else ""

    def failed(self, error: str) -> None:
        self.error = error
        self.status = f"error: {error}"[:200]


class TrainingLoop:
    def __init__(self, *, spec: Callable[[], JobSpec], journal: ExperienceJournal, learner: Any,
                 publisher: Any, checkpointer: Checkpointer, evaluator: Any,
                 metrics: MetricsLog, state: TrainerState, wake: threading.Event,
                 pause: threading.Event | None = None, replay: Replay | None = None,
                 stop: threading.Event | None = None) -> None:
        """``spec`` is asked each pass (a SIGHUP reload applies at the next step);
        ``publisher``: an AsyncPublisher or None; ``evaluator``: an Evaluator or None;
        ``wake`` is set by the intake when new trajectories were journaled (and when the
        pause is lifted); ``pause``: set while the job is paused; ``replay``: the steps a
        restored learner trains again (resume.py)."""
        self.spec, self.journal, self.learner = spec, journal, learner
        self.replay = replay if replay is not None else Replay(made_up_to=learner.version)
        self.skipped_in_a_row = 0  # consecutive steps skipped for non-finite numbers (guard.py)
        self.publisher, self.checkpointer, self.evaluator = publisher, checkpointer, evaluator
        self.metrics, self.state, self.wake = metrics, state, wake
        self.pause = pause if pause is not None else threading.Event()
        self._republished_at = 0.0
        self._stop = stop or threading.Event()  # run()'s: ends a wait for the journal, an evaluation
        state.journal = journal
        self._pause_checkpoint_at = 0.0  # the last checkpoint attempt while paused
        self.step_delay_s = failpoints.trainer_step_delay_s()
        if self.step_delay_s:
            log.warning("%s=%g: the trainer waits that long after every step (a test knob)",
                        failpoints.TRAINER_STEP_DELAY_S, self.step_delay_s, extra={"event": "step_delay"})

    def run(self, stop: threading.Event) -> None:
        journal, learner = self.journal, self.learner
        waited_from = time.monotonic()
        stale_since: float | None = None  # waiting, and what arrives is too stale to train
        no_signal_dropped = 0  # for the batch being gathered
        self._stop = stop
        while not stop.is_set():
            if self.pause.is_set():
                self.hold()
                continue
            if self.state.paused:
                self.resume()
                waited_from, stale_since = time.monotonic(), None  # the pause is no wait for data
            self._pause_checkpoint_at = 0.0  # (lifted before it held: the next pause checkpoints at once)
            t, g = self.spec().trainer, self.spec().task.group_size
            if learner.version >= t.max_steps:
                if self.state.status != "done":
                    log.info("done: reached max_steps %d", t.max_steps, extra={"event": "done"})
                self.state.status = "done"
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            self.wake.clear()
            again = self.replayable(self.replay.take(learner.version + 1), g)
            if again:  # a step lost to a restore: its original batch, at its original version
                self.state.status = "training"
                self.step(again, self.ages(again), 0.0, replayed=True)
                waited_from = time.monotonic()
                continue
            evicted, complete = self.evict(t.max_staleness, t.batch_size // g, t.buffer_order)
            if t.no_signal_drops_per_batch > 0 and t.filter_schedule == "after_batch":
                # an evicted group has reached the trainer too: its round may be finished
                received = [gid for gid, _ in complete] + [gid for gid, _, _ in evicted]
                kept = set(self.in_finished_rounds(received, t.batch_size // g))
                complete = [(gid, ts) for gid, ts in complete if gid in kept]
            budget = int(t.no_signal_drops_per_batch * (t.batch_size // g)) - no_signal_dropped
            sel = select_groups(complete, t.batch_size // g, learner.version, t.max_staleness,
                                no_signal_budget=max(0, budget), max_abs_reward=t.max_abs_reward)
            no_signal_dropped += sum(1 for _, reason, _ in sel.drops if reason == NO_SIGNAL)
            drops = evicted + sel.drops
            if drops:
                if not self.journaled(lambda: journal.record_dropped(drops)):
                    return  # stopped; nothing was trained
                for gid, reason, detail in drops:
                    if reason == NON_FINITE:
                        self.state.non_finite_groups += 1
                        self.state.non_finite = f"group {gid}: {detail}"[:300]
                    # no_signal drops are routine (counted in the metrics line), not news;
                    # a reward no float32 batch can hold is (a reward function's bug, an insider)
                    log.log(logging.DEBUG if reason == NO_SIGNAL else logging.ERROR if reason == NON_FINITE
                            else logging.INFO, "dropped group %s: %s (%s)", gid, reason, detail,
                            extra={"event": "drop", "reason": reason})
            if len(sel.groups) < t.batch_size // g:
                self.state.status = f"stalled: {journal.write_error}"[:200] if journal.write_error \
                    else "waiting"
                if any(reason == STALENESS for _, reason, _ in drops):
                    stale_since = stale_since or time.monotonic()
                    self.republish_if_starved(stale_since)
                self.wake.wait(0.5)
                continue
            stale_since, no_signal_dropped = None, 0
            self.state.status = "training"
            self.step(sel.groups, sel.staleness, time.monotonic() - waited_from)
            if self.step_delay_s and stop.wait(self.step_delay_s):
                return
            waited_from = time.monotonic()

    def evict(self, max_staleness: int | None, batch_groups: int,
              order: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, Any]]]:
        """(drops, the complete groups left in ``order``): every pending group beyond α, then
        the complete groups beyond the buffer's (1 + α) batches (buffer.py). Not yet journaled."""
        journal, version = self.journal, self.learner.version
        stale = evict_stale([(gid, journal.group(gid)) for gid in journal.group_sizes()], version,
                            max_staleness) if max_staleness is not None else []
        gone = {gid for gid, _, _ in stale}
        g = self.spec().task.group_size
        complete = ordered([(gid, journal.group(gid)) for gid in journal.complete_groups(g) if gid not in gone],
                           order, version)
        overflow = evict_overflow(complete, capacity_groups(batch_groups, max_staleness), order)
        return stale + overflow, complete[:len(complete) - len(overflow)]

    def in_finished_rounds(self, complete: list[str], prompts_per_round: int) -> list[str]:
        """after_batch: only the groups of rounds whose every group has arrived."""
        state, done = self.journal.state, set(complete)
        return in_finished_rounds(complete, prompts_per_round,
                                  lambda gid: gid in done or gid in state.trained or gid in state.dropped)

    def replayable(self, groups: list[str], group_size: int) -> list[str]:
        """Of a replayed batch, the groups still pending and complete (all, unless the
        journal changed since: such a step is then made by the ordinary selection)."""
        complete = set(self.journal.complete_groups(group_size)) if groups else set()
        return [gid for gid in groups if gid in complete]

    def ages(self, groups: list[str]) -> Counter[int]:
        version = self.learner.version
        return Counter(staleness(st, version) for gid in groups for st in self.journal.group(gid))

    def step(self, groups: list[str], ages: Counter[int], wait_s: float, *, replayed: bool = False) -> None:
        batch = [self.journal.group(gid) for gid in groups]
        try:
            stats = self.learner.train_step(batch)
        except NonFiniteStep as exc:
            self.skip_non_finite(groups, exc)
            return
        except ValueError as exc:  # the data, not the trainer: account and go on
            why = str(exc)[:500]
            if not self.journaled(lambda: self.journal.record_dropped([(gid, INVALID, why) for gid in groups])):
                return
            log.warning("dropped %d groups, batch refused: %s", len(groups), exc,
                        extra={"event": "drop", "reason": INVALID})
            return
        failpoints.trainer_kill_at("mid_step", self.learner.version)
        if not self.journaled(lambda: self.journal.record_trained(self.learner.version, groups)):
            # The learner's weights hold a step the journal does not: no checkpoint on the
            # way out (the worker's drain would write one), the next leader re-trains it.
            raise JournalUnwritable(f"stopped before the journal could record step "
                                    f"{self.learner.version}: {self.journal.write_error}")
        version = self.state.version = self.learner.version
        self.skipped_in_a_row = 0
        snapshot_s = self.publish()
        every = self.spec().trainer.checkpoint_every
        # Also once a checkpoint is overdue: one skipped while leadership was unconfirmed
        # (an etcd outage, docs/operations/failsafe.md) is written at the first step after; one that
        # failed (a full disk) is tried again `every` versions later.
        due = version % every == 0 or (version - self.state.checkpoint_version >= every
                                       and self.checkpointer.retry_due(version, every))
        ckpt = self.checkpoint() if due else None
        self.metrics.append(step_line(version=version, stats=stats, ages=ages, wait_s=wait_s,
                                      snapshot_s=snapshot_s, publisher=self.publisher,
                                      summary=self.journal.summary(), checkpoint=ckpt,
                                      versions=batch_versions(batch), replayed=replayed))
        log.info("step %d: loss %.4f reward %.3f, %d tokens in %.2f s", version, stats["loss"],
                 stats["reward_mean"], stats["tokens"], stats["step_s"], extra={"event": "step"})
        self.maybe_evaluate()

    def skip_non_finite(self, groups: list[str], exc: NonFiniteStep) -> None:
        """A step refused by the guard (guard.py): its groups dropped as ``non_finite``,
        counted, one log line with the offending values; after ``max_skipped_steps`` in a
        row, or at once if the update already reached the weights, the last checkpoint is
        restored."""
        detail = str(exc)[:500]
        if not self.journaled(lambda: self.journal.record_dropped([(gid, NON_FINITE, detail) for gid in groups])):
            return
        self.skipped_in_a_row += 1
        self.state.non_finite_steps += 1
        self.state.non_finite_groups += len(groups)
        self.state.non_finite = f"step {self.learner.version + 1}: {detail}"[:300]
        limit = self.spec().trainer.max_skipped_steps
        log.error("step %d skipped: %s; its %d groups dropped as %s (%d in a row, %d in all)",
                  self.learner.version + 1, detail, len(groups), NON_FINITE, self.skipped_in_a_row,
                  self.state.non_finite_steps, extra={"event": "non_finite", "reason": NON_FINITE})
        if exc.weights_touched:
            self.rewind("the update made the weights non-finite", weights_broken=True)
        elif self.skipped_in_a_row >= limit:
            self.rewind(f"{limit} steps in a row skipped (trainer.max_skipped_steps)")

    def rewind(self, why: str, *, weights_broken: bool = False) -> None:
        """Restore the newest checkpoint and re-train what came after it (resume.py): the
        same path as a restart, without one. With no checkpoint and broken weights there
        is nothing to restore in-process: the worker fails and its daemon starts it again
        from the base model."""
        if not checkpoints(self.checkpointer.folder):
            if weights_broken:
                raise RuntimeError(f"{why} and no checkpoint to restore: restarting from the base model")
            log.warning("%s, but no checkpoint to restore: going on", why, extra={"event": "rewind"})
            self.skipped_in_a_row = 0
            return
        before = self.learner.version
        self.replay = restore(self.learner, self.journal, self.checkpointer.folder)
        self.state.version = self.state.checkpoint_version = self.learner.version
        self.state.rewinds += 1
        self.skipped_in_a_row = 0
        log.error("%s: restored checkpoint version %d (was at %d); re-training %d steps",
                  why, self.learner.version, before, self.replay.steps_left, extra={"event": "rewind"})

    def hold(self) -> None:
        """One pass while paused, at a step boundary: checkpoint the current version if the
        last checkpoint is older (retried every PAUSE_CHECKPOINT_RETRY_S while leadership is
        unconfirmed: an etcd outage, docs/operations/failsafe.md), then
        report paused; take no batch. What arrives meanwhile stays pending in the journal."""
        now = time.monotonic()
        if (self.state.version > self.state.checkpoint_version
                and now - self._pause_checkpoint_at >= PAUSE_CHECKPOINT_RETRY_S):
            self._pause_checkpoint_at = now
            self.state.status = "pausing"
            self.checkpoint()
        if not self.state.paused and self.state.version <= self.state.checkpoint_version:
            self.state.paused, self.state.status = True, "paused"
            PAUSED.set(1)
            log.info("paused at version %d (checkpoint version %d); %d groups pending", self.state.version,
                     self.state.checkpoint_version, len(self.journal.state.pending), extra={"event": "paused"})
        self.wake.wait(0.5)
        self.wake.clear()

    def resume(self) -> None:
        self.state.paused = False
        PAUSED.set(0)
        log.info("resumed at version %d; %d groups pending", self.state.version,
                 len(self.journal.state.pending), extra={"event": "resumed"})

    def publish(self) -> float:
        """Hand a snapshot to the publisher thread; returns the trainer's stall (the copy)."""
        if self.publisher is None or not self.replay.may_publish(self.state.version):
            return 0.0  # a re-trained version the relays hold already (resume.py)
        started = time.monotonic()
        self.publisher.submit(self.state.version, self.learner.state_tensors(self.spec().model.dtype))
        failpoints.trainer_kill_at("mid_publish", self.state.version)
        return time.monotonic() - started

    def republish_if_starved(self, stale_since: float) -> None:
        """Everything arriving is too stale and no batch forms: the rollouts serve weights
        older than max_staleness, e.g. a relay restarted empty after a trainer restart,
        and without a step no new version would ever reach them. Push the current version
        again (a relay holding it already takes no chunks), at most every REPUBLISH_AFTER_S."""
        now = time.monotonic()
        if now - stale_since < REPUBLISH_AFTER_S or now - self._republished_at < REPUBLISH_AFTER_S:
            return
        self._republished_at = now
        self.state.counts["republished"] += 1
        log.warning("only stale groups for %.0f s: publishing version %d again for rollouts that "
                    "lack it", now - stale_since, self.state.version, extra={"event": "republish"})
        self.publish()

    def journaled(self, write: Callable[[], object]) -> bool:
        """``write`` a journal record, waiting while the journal cannot take it (a full
        disk) with the status saying so; False if stopped meanwhile."""
        def blocked(why: str) -> None:
            self.state.status = f"stalled: {self.journal.write_error or why}"[:200]
        return until_written(write, self._stop, on_blocked=blocked)

    def checkpoint(self) -> Path | None:
        path = self.checkpointer.save(self.state.version)
        if path is not None:
            self.state.checkpoint_version = self.state.version
        self.state.checkpoint_error = self.checkpointer.error
        return path

    def maybe_evaluate(self) -> None:
        if self.evaluator is not None and self.evaluator.due(self.state.version):
            self.evaluator.run(policy_to_evaluate(self.learner), self.state.version, stop=self._stop)
