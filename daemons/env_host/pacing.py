"""Claim pacing: no more prompts claimed and not yet consumed than the staleness
bound can use (ROLL Flash's bounded asynchrony, AReaL's staleness control).

The trainer writes `trainer/progress` (common/records.TrainerProgress) =
``{version, consumed_groups, trained_groups, dropped_groups, time}`` whenever it
trains or drops a group; ``consumed_groups`` counts groups trained or dropped, job-wide.
A prompt is one group and the cursor's ``next`` counts prompts claimed job-wide, so

    outstanding = next - consumed_groups

is every prompt being generated, scored, or waiting in the trainer's buffer, across
all env-hosts. A claim keeps it at most ``limit``. Without this, env-hosts generate as
fast as the rollouts allow, the trainer's buffer and the pipeline hold more than
``max_staleness`` batches, and the surplus is generated only to be dropped as stale.

Prompts that can never be consumed (an env-host gone for good with its journal) would
hold the budget forever and stop the whole job; so after STALL_S without trainer
progress while claims are refused, the outstanding prompts are written off once more
(a batch of `limit` claims is allowed, with a warning) instead of waiting forever. The
write-off is a loan, not a gift: every group the trainer consumes afterwards pays it
back, one prompt each, so the outstanding prompts return to the limit. A write-off that
stayed (as it did before) widened the pipeline by its size for the rest of the job, and
each stall of a loaded machine widened it more: more generations in flight than α
batches can use, drops for staleness climbing with the run's length (issue 28).

Dynamic filtering (docs/guide/agentic.md, "Queue scheduling and dynamic filtering") is paced
here too. ``queue``: a dropped group is consumed, so its replacement is claimed at once,
and ``trainer.max_extra_prompts`` adds that many prompts to the limit (ROLL Flash's
max_additional_running_prompts). ``after_batch``: prompts are claimed in rounds of one
batch, the next round only once every group of the last one reached the trainer
(``round_limit``); like the barrier modes, a round waits for all of its groups.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import TrainerProgress
from rlfleet.common.control.store import Store, StoreUnavailable
from rlfleet.common.spec.job import JobSpec

log = logging.getLogger("rlfleet.env_host")

STALL_S = 30.0  # without trainer progress while claims are refused: write the outstanding off

OUTSTANDING = Gauge("rlfleet_env_prompts_outstanding",
                    "Prompts claimed job-wide and not yet consumed by the trainer, at this env-host's last claim")
CLAIM_LIMIT = Gauge("rlfleet_env_claim_limit", "Prompts that may be outstanding job-wide (the claim pacer's limit)")


def prompts_per_batch(spec: JobSpec) -> int:
    return max(1, spec.trainer.batch_size // spec.task.group_size)


def claim_limit(spec: JobSpec) -> int | None:
    """Prompts that may be outstanding job-wide: max_staleness batches (at least one),
    plus trainer.max_extra_prompts (one batch when staleness is unbounded); None (no
    pacing) when neither bounds it or env_host.pace_claims is off. A batch-mode round's
    redundant prompts (env_host.redundant_prompts) come with each batch: the round is
    claimed whole, and those it does not need are dropped, so they count as consumed."""
    alpha, extra = spec.trainer.max_staleness, spec.trainer.max_extra_prompts
    if not spec.env_host.pace_claims or (alpha is None and extra is None):
        return None
    per_batch = prompts_per_batch(spec) + spec.env_host.redundant_prompts
    return max(1, alpha or 0) * per_batch + (extra or 0)


def lag_limit(limit: int, prompts_per_batch: int, trainer_version: int, weights_seen: int,
              allowance: int = 0) -> int:
    """The pacer's limit while the rollouts generate with weights ``trainer_version -
    weights_seen`` versions old (their lag): a prompt claimed now is trained about
    outstanding/batch versions later, so its staleness is that plus the lag, and each
    version of lag beyond ``allowance`` (env_host.pace_lag_allowance) takes one batch off
    the limit. At least one batch stays allowed: the turns it brings are what tells the
    lag again."""
    lag = max(0, trainer_version - weights_seen - allowance)
    return max(min(limit, prompts_per_batch), limit - lag * prompts_per_batch)


def round_limit(prompts_per_batch: int, received: int) -> int:
    """after_batch: how far the cursor may go (prompt ids below the result). Round r is
    prompts r*P .. (r+1)*P - 1, claimed once every group of the rounds before it has
    reached the trainer (trained, dropped, or complete and waiting)."""
    return (received // prompts_per_batch + 1) * prompts_per_batch


def pacer_for(spec: JobSpec, store: Store, keys: JobKeys, on_progress: Callable[[], None],
              weights_seen: Callable[[], int] | None = None) -> ClaimPacer | None:
    """The env-host's pacer (not started), or None when nothing paces its claims.
    ``weights_seen``: the newest weight version this env-host's turns were generated with
    (used with env_host.pace_for_lag)."""
    limit = claim_limit(spec)
    gated = spec.rollout.mode in ("sync", "one_step_off") or (
        spec.trainer.no_signal_drops_per_batch > 0 and spec.trainer.filter_schedule == "after_batch")
    if limit is None and not gated:
        return None
    # The barrier and the rounds need the trainer's progress all the same.
    return ClaimPacer(store, keys, 1 << 30 if limit is None else limit, on_progress, mode=spec.rollout.mode,
                      prompts_per_batch=prompts_per_batch(spec),
                      rounds=spec.trainer.no_signal_drops_per_batch > 0
                      and spec.trainer.filter_schedule == "after_batch",
                      weights_seen=weights_seen if spec.env_host.pace_for_lag and limit is not None else None,
                      lag_allowance=spec.env_host.pace_lag_allowance)


def barrier_limit(mode: str, prompts_per_batch: int, version: int, received: int) -> int | None:
    """How far the cursor may go in a barrier mode (prompt ids below the result), or None.

    sync: batch k is generated with version k, so it starts once version k is published.
    one_step_off: batch k is generated with version k-1 while batch k-1 trains, so it
    starts once version k-1 is published and every group of the batches before it has
    reached the trainer."""
    if mode == "sync":
        return (version + 1) * prompts_per_batch
    if mode == "one_step_off":
        return (min(version + 1, received // prompts_per_batch) + 1) * prompts_per_batch
    return None


def consumed_of(value: Any) -> int:
    """consumed_groups from a trainer/progress value; 0 for anything malformed (never
    more claims than an honest value would allow: TrainerProgress's default)."""
    return TrainerProgress.parse(value).consumed_groups


class ClaimPacer:
    """Follows trainer/progress with a watch (its own thread); `budget(next)` says how
    many prompts may be claimed when the cursor stands at `next`."""

    def __init__(self, store: Store, keys: JobKeys, limit: int,
                 on_progress: Callable[[], None] = lambda: None, *, mode: str = "trajectory",
                 prompts_per_batch: int = 1, rounds: bool = False,
                 weights_seen: Callable[[], int] | None = None, lag_allowance: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``rounds``: claim in after_batch rounds (``round_limit``); ``weights_seen``: the
        newest weight version turns were generated with, to pace for the rollouts' lag
        beyond ``lag_allowance`` versions (``lag_limit``); ``clock``: seconds, for the stall
        (tests pass their own)."""
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.store, self.keys, self.limit = store, keys, limit
        self.on_progress = on_progress
        self.mode, self.prompts_per_batch, self.rounds = mode, prompts_per_batch, rounds
        self.weights_seen, self.lag_allowance = weights_seen, lag_allowance
        self.outstanding = 0  # at the last budget asked: claimed job-wide, not consumed
        if limit < 1 << 30:
            CLAIM_LIMIT.set(limit)
        self.version = 0
        self.received = 0
        self.consumed = 0
        self.written_off = 0  # prompts no longer counted as outstanding (STALL_S)
        self._clock = clock
        self._progress_at = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="claim-pacer", daemon=True)

    def start(self) -> ClaimPacer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def budget(self, next_prompt: int) -> int:
        self.outstanding = max(0, next_prompt - self.consumed)
        OUTSTANDING.set(self.outstanding)
        allowed = self._paced(next_prompt)
        barrier = barrier_limit(self.mode, self.prompts_per_batch, self.version, self.received)
        if barrier is not None:
            allowed = min(allowed, barrier - next_prompt)
        if self.rounds:
            allowed = min(allowed, round_limit(self.prompts_per_batch, self.received) - next_prompt)
        return allowed

    def _paced(self, next_prompt: int) -> int:
        limit = self.limit if self.weights_seen is None else lag_limit(
            self.limit, self.prompts_per_batch, self.version, self.weights_seen(), self.lag_allowance)
        outstanding = next_prompt - self.consumed - self.written_off
        if outstanding >= limit and self._clock() - self._progress_at > STALL_S:
            log.warning("no trainer progress for %.0f s with %d prompts outstanding (limit %d): "
                        "claiming past them", STALL_S, outstanding, self.limit,
                        extra={"event": "pacing_stall"})
            self.written_off += outstanding
            self._progress_at = self._clock()
            outstanding = 0
        return min(limit, limit - outstanding)

    def _set(self, progress: TrainerProgress) -> None:
        # Never backwards: a stale event must not shrink them.
        moved = progress.consumed_groups > self.consumed or progress.version > self.version or (
            progress.received_groups > self.received)
        if progress.consumed_groups > self.consumed:
            # consumption pays back the write-off first (module docstring)
            self.written_off = max(0, self.written_off - (progress.consumed_groups - self.consumed))
            self.consumed = progress.consumed_groups
            self._progress_at = self._clock()
        self.version = max(self.version, progress.version)
        self.received = max(self.received, progress.received_groups)
        if moved:
            self.on_progress()

    def _follow(self) -> None:
        key = self.keys.trainer_progress
        watch = None
        while not self._stop.is_set():
            try:
                if watch is None:
                    # The revision before the read: a put between the read and the watch is
                    # replayed (a value seen twice is harmless, _set never goes back); a watch
                    # from "now" after the read lost it, and with it the trainer's first step.
                    since = self.store.revision()
                    kv = self.store.get(key)
                    if kv is not None:
                        self._set(TrainerProgress.from_kv(kv))
                    watch = self.store.watch_prefix(key, start_revision=since + 1)
                event = watch.get(timeout=0.5)
                if event is not None and event.key == key and event.kind == "put":
                    self._set(TrainerProgress.parse(event.value))
            except StoreUnavailable as exc:
                log.warning("claim pacing: etcd unreachable (%s); claims wait for the trainer's "
                            "progress", exc)
                watch = None
                self._stop.wait(0.5)
            except Exception:  # noqa: BLE001 — pacing must outlive any surprise
                log.exception("claim pacing: following trainer progress failed; retrying")
                watch = None
                self._stop.wait(0.5)
        if watch is not None:
            watch.cancel()
