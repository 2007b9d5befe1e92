"""The leader's training machinery: journal, learner, intake thread, training loop.

A TrainingWorker lives while its daemon leads. Starting it resumes from the
newest loadable checkpoint and the journal; stopping it closes the socket and
the journal (releasing the journal lock for whoever leads next).

Two threads, so that acks never wait for a training step:
- intake (owns the ReliableReceiver socket): receive ScoredTrajectory →
  validate → journal (fsync) → ack. Upstream-dropped and invalid trajectories
  drop their whole group, durably, before the ack.
- train: whenever B/G complete groups are pending: select (staleness bound) →
  ``Learner.train_step`` → journal the trained groups → hand the version to the
  publisher thread (publishing.py) → metrics line → checkpoint every N steps
  (then compact the journal).

A version is journaled (TRAINED) before it is published, so a restarted
trainer's versions start above every version the relays have seen.

Files (``Paths``): ``$RLFLEET_RUN_DIR`` or ``<job.runs_dir>/<job>``, holding
``checkpoints/step-<version>/``, ``checkpoints/journal.bin`` and ``metrics.jsonl``,
one JSON line per step: time, step (= version: step n makes version n),
reward_mean/std, loss, trajectories, groups, tokens (generated tokens trained on),
tokens_per_s (over the step's compute), step_s, snapshot_s (the copy handed to the
publisher), wait_s (waiting for data), published_version / push_s (the last push
that finished), staleness {versions behind: trajectories in this step}, dropped
{reason: groups, job total}, trained_groups / pending_groups (job totals),
ratio_mean, clip_frac, approx_kl, entropy, grad_norm, checkpoint (path or null).

``status`` (shown as ``training`` in the member record): resuming, waiting (for
complete groups), training, done (max_steps reached: still receiving and
journaling, not training), stopped, or error: <why>.

Restart semantics: the version counter resumes at max(checkpoint version, the
highest version the journal says was trained), so versions never go backwards;
groups trained after the checkpoint lost their effect on the weights and are
journaled as pending again (REOPENED) to be trained once more.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlfleet.common.run_dir import job_run_dir
from rlfleet.common.keys import JobKeys
from rlfleet.common.spec import JobSpec
from rlfleet.common.store import Store, StoreUnavailable
from rlfleet.common.wire import ScoredTrajectory

from .batching import INVALID, STALENESS, check_trajectory, drop_reason, select_groups
from .journal import Journal

log = logging.getLogger("rlfleet.trainer")

REPUBLISH_AFTER_S = 5.0  # of only-stale arrivals before the current version is pushed again
PROGRESS_EVERY_S = 0.02  # trainer/progress is written at most this often

# Test-only fault injection: "exit_after_journal" ends the process right after a
# batch is journaled and before it is acked (tests/trainer/test_daemon.py).
FAILPOINT_ENV = "RLFLEET_TRAINER_FAILPOINT"


@dataclass(frozen=True)
class Paths:
    run_dir: Path

    @classmethod
    def for_job(cls, spec: JobSpec) -> Paths:
        return cls(job_run_dir(spec))

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def journal(self) -> Path:
        return self.checkpoints / "journal.bin"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"


class TrainingWorker:
    def __init__(self, spec: JobSpec, store: Store, keys: JobKeys, *,
                 publisher: Any = None, is_leader: Callable[[], bool] = lambda: True) -> None:
        """``publisher``: anything with ``publish(version, tensors)`` to use instead of
        the relay's WeightPublisher (an in-process relay, a test's recorder).
        ``is_leader`` is asked before each checkpoint: a trainer that may have been
        replaced must not write into the shared checkpoint folder."""
        self.is_leader = is_leader
        self.spec = spec  # replaced on SIGHUP (max_steps, max_staleness take effect at once)
        self.store, self.keys = store, keys
        self.paths = Paths.for_job(spec)
        self.status = "starting"
        self.error = ""
        self.version = 0
        self.checkpoint_version = 0
        self.endpoint: str | None = None
        self.checkpoint_on_stop = False
        self.counts: Counter[str] = Counter()  # intake outcomes, for logs and tests
        self._republished_at = 0.0
        self._stop = threading.Event()
        self._data = threading.Event()  # intake -> train: new trajectories arrived
        self._bound = threading.Event()
        self._journal: Journal | None = None
        self._learner: Any = None
        self._publisher: Any = None
        self._publisher_override = publisher
        self._main = threading.Thread(target=self._run, name="trainer-train", daemon=True)
        self._intake = threading.Thread(target=self._intake_loop, name="trainer-intake", daemon=True)
        self._progress_thread = threading.Thread(target=self._progress_loop, name="trainer-progress",
                                                 daemon=True)

    # -- lifecycle (called from the daemon's cycle) ------------------------------------
    def start(self) -> None:
        self._main.start()

    def stop(self, checkpoint: bool = False) -> None:
        self.checkpoint_on_stop = checkpoint
        self._stop.set()
        self._data.set()

    @property
    def alive(self) -> bool:
        return self._main.is_alive() or self._intake.is_alive()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in (self._main, self._intake):
            if t.is_alive() or t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        return not self.alive

    # -- the training thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._resume()
            if self._stop.is_set():
                return
            self._intake.start()
            self._progress_thread.start()
            self._bound.wait(30)
            self._train_loop()
            if self.checkpoint_on_stop and self.version > self.checkpoint_version:
                self._checkpoint()
        except Exception as exc:  # noqa: BLE001 — reported in member_info; the daemon retries
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = f"error: {self.error}"[:200]
            log.exception("training stopped: %s", self.error, extra={"event": "train_error"})
        finally:
            self._stop.set()
            if self._intake.ident is not None:
                self._intake.join()
            if self._progress_thread.ident is not None:
                self._progress_thread.join()
            if self._publisher is not None:
                self._publisher.close()
            if self._journal is not None:
                self._journal.close()
            if not self.error:
                self.status = "stopped"

    def _resume(self) -> None:
        from rlfleet.common.seams import POLICY_LOSSES

        from .learner import Learner, checkpoints  # torch: imported only by a leader

        self.status = "resuming"
        self._journal = journal = Journal(self.paths.journal)
        t = self.spec.trainer
        raw = os.environ.get("RLFLEET_TORCH_THREADS", "1")
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"RLFLEET_TORCH_THREADS must be an integer >= 1, got {raw!r}")
        threads = int(raw)
        learner = Learner(self.spec.model.path, lr=t.learning_rate,
                          loss=POLICY_LOSSES.build(t.loss),
                          seed=self.spec.job.seed, threads=threads,
                          lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                          total_steps=t.max_steps,
                          # The rollout reports behaviour log-probs at temperature 1 (the
                          # policy itself, see daemons/rollout/engine.py); the ratio must
                          # compare like with like, whatever temperature sampling used.
                          temperature=1.0)
        for ckpt in checkpoints(self.paths.checkpoints):
            try:
                learner.load_checkpoint(ckpt)
                break
            except Exception as exc:  # noqa: BLE001 — fall back to the older one
                log.warning("checkpoint %s unreadable (%s); trying an older one", ckpt, exc)
        self.checkpoint_version = learner.version
        reopened = journal.reopen_trained_after(learner.version)
        learner.version = max(learner.version, journal.state.max_version)
        self.version = learner.version
        self._learner = learner
        self._publisher = self._make_publisher()
        from .evaluation import Evaluator, can_evaluate
        if can_evaluate(self.spec):
            self._evaluator = Evaluator(self.spec, self.paths.metrics)
            self._maybe_evaluate()
        else:
            log.warning("held-out evaluation off: no tokenizer in %s", self.spec.model.path,
                        extra={"event": "no_eval"})
        log.info("resumed at version %d (checkpoint version %d, %d groups to re-train, "
                 "%d pending groups in the journal)", self.version, self.checkpoint_version,
                 len(reopened), len(journal.state.pending), extra={"event": "resume"})

    def _make_publisher(self) -> Any:
        from .publishing import AsyncPublisher

        if self._publisher_override is not None:
            return AsyncPublisher(self._publisher_override)
        try:
            from rlfleet.relay.publisher import WeightPublisher
        except ImportError as exc:
            log.warning("weight publishing disabled: rlfleet.relay.publisher unavailable (%s)", exc,
                        extra={"event": "no_publisher"})
            return None
        r = self.spec.relay
        return AsyncPublisher(WeightPublisher(self.store, self.keys.job, transport=r.transport,
                                              chunk_bytes=r.chunk_mib << 20))

    def _train_loop(self) -> None:
        assert self._journal is not None and self._learner is not None
        journal, learner = self._journal, self._learner
        waited_from = time.monotonic()
        stale_since: float | None = None  # waiting, and what arrives is too stale to train
        while not self._stop.is_set():
            t, g = self.spec.trainer, self.spec.task.group_size
            if learner.version >= t.max_steps:
                if self.status != "done":
                    log.info("done: reached max_steps %d", t.max_steps, extra={"event": "done"})
                self.status = "done"
                self._data.wait(1.0)
                self._data.clear()
                continue
            self._data.clear()
            complete = [(gid, journal.group(gid)) for gid in journal.complete_groups(g)]
            sel = select_groups(complete, t.batch_size // g, learner.version, t.max_staleness)
            if sel.drops:
                journal.record_dropped(sel.drops)
                for gid, reason, detail in sel.drops:
                    log.info("dropped group %s: %s (%s)", gid, reason, detail,
                             extra={"event": "drop", "reason": reason})
            if len(sel.groups) < t.batch_size // g:
                self.status = "waiting"
                if any(reason == STALENESS for _, reason, _ in sel.drops):
                    stale_since = stale_since or time.monotonic()
                    self._republish_if_starved(stale_since)
                self._data.wait(0.5)
                continue
            stale_since = None
            self.status = "training"
            wait_s = time.monotonic() - waited_from
            self._step(sel.groups, sel.staleness, wait_s)
            waited_from = time.monotonic()

    def _step(self, groups: list[str], ages: Counter[int], wait_s: float) -> None:
        assert self._journal is not None
        journal, learner = self._journal, self._learner
        batch = [journal.group(gid) for gid in groups]
        try:
            stats = learner.train_step(batch)
        except ValueError as exc:  # the data, not the trainer: account and go on
            journal.record_dropped([(gid, INVALID, str(exc)[:500]) for gid in groups])
            log.warning("dropped %d groups, batch refused: %s", len(groups), exc,
                        extra={"event": "drop", "reason": INVALID})
            return
        journal.record_trained(learner.version, groups)
        self.version = learner.version
        snapshot_s = self._publish()
        ckpt = None
        if self.version % self.spec.trainer.checkpoint_every == 0:
            ckpt = self._checkpoint()
        summary = journal.summary()
        line = {
            "time": round(time.time(), 3), "step": self.version, "version": self.version,
            "reward_mean": stats["reward_mean"], "reward_std": stats["reward_std"],
            "loss": stats["loss"], "trajectories": stats["trajectories"], "groups": stats["groups"],
            "tokens": int(stats["tokens"]),
            "tokens_per_s": round(stats["tokens"] / max(stats["step_s"], 1e-9), 1),
            "step_s": round(stats["step_s"], 4), "snapshot_s": round(snapshot_s, 4),
            "wait_s": round(wait_s, 4),
            # the push runs behind training: these describe the last push that finished
            "published_version": getattr(self._publisher, "published_version", None),
            "push_s": round(getattr(self._publisher, "last_publish_s", 0.0), 4),
            "staleness": {str(k): v for k, v in sorted(ages.items())},
            **summary,  # dropped {reason: groups}, trained_groups, pending_groups: job totals
            **{k: stats[k] for k in ("ratio_mean", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr")
               if k in stats},
            "checkpoint": str(ckpt) if ckpt else None,
        }
        self.paths.metrics.parent.mkdir(parents=True, exist_ok=True)
        with open(self.paths.metrics, "a") as f:
            f.write(json.dumps(line) + "\n")
        log.info("step %d: loss %.4f reward %.3f, %d tokens in %.2f s", self.version, stats["loss"],
                 stats["reward_mean"], stats["tokens"], stats["step_s"], extra={"event": "step"})
        self._maybe_evaluate()

    def _maybe_evaluate(self) -> None:
        evaluator = getattr(self, "_evaluator", None)
        if evaluator is not None and evaluator.due(self.version):
            evaluator.run(self._learner.model, self.version)

    def _republish_if_starved(self, stale_since: float) -> None:
        """Everything arriving is too stale and no batch forms: the rollouts serve weights
        older than max_staleness, e.g. a relay restarted empty after a trainer restart,
        and without a step no new version would ever reach them. Push the current version
        again (a relay holding it already takes no chunks), at most every REPUBLISH_AFTER_S."""
        now = time.monotonic()
        if now - stale_since < REPUBLISH_AFTER_S or now - self._republished_at < REPUBLISH_AFTER_S:
            return
        self._republished_at = now
        self.counts["republished"] += 1
        log.warning("only stale groups for %.0f s: publishing version %d again for rollouts that "
                    "lack it", now - stale_since, self.version, extra={"event": "republish"})
        self._publish()

    def _publish(self) -> float:
        """Hand a snapshot to the publisher thread; returns the trainer's stall (the copy)."""
        if self._publisher is None:
            return 0.0
        started = time.monotonic()
        self._publisher.submit(self.version, self._learner.state_tensors())
        return time.monotonic() - started

    def _checkpoint(self) -> Path | None:
        from .learner import checkpoints

        assert self._journal is not None
        if not self.is_leader():
            log.warning("not checkpointing version %d: leadership not confirmed", self.version)
            return None
        path = self._learner.save_checkpoint(self.paths.checkpoints, self.version,
                                             extra={"step": self.version})
        self.checkpoint_version = self.version
        record = {"version": self.version, "path": str(path.resolve()), "step": self.version,
                  "time": round(time.time(), 3)}
        try:
            self.store.put(self.keys.trainer_checkpoint, record)
        except StoreUnavailable as exc:  # advisory: the folder is the truth
            log.warning("checkpoint record not written (etcd unreachable: %s)", exc)
        kept = checkpoints(self.paths.checkpoints)
        # Compact only what even the oldest kept checkpoint covers: if the newest one
        # turns out unreadable, resuming from the older one still finds its groups.
        saved = self._journal.compact(int(kept[-1].name.removeprefix("step-")))
        log.info("journal compacted by %d bytes", saved, extra={"event": "compact"})
        return path

    # -- the intake thread ----------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        """What trainer/progress says: env-hosts pace their claims by consumed_groups."""
        assert self._journal is not None
        state = self._journal.state
        trained, dropped = len(state.trained), len(state.dropped)
        return {"version": self.version, "consumed_groups": trained + dropped,
                "trained_groups": trained, "dropped_groups": dropped}

    def _progress_loop(self) -> None:
        """Put trainer/progress whenever it changes (coalesced: at most every PROGRESS_EVERY_S),
        on its own thread so an etcd outage never holds up a training step."""
        last: dict[str, int] | None = None
        failing = False
        while not self._stop.wait(PROGRESS_EVERY_S):
            now = self.progress()
            if now == last:
                continue
            try:
                self.store.put(self.keys.trainer_progress, {**now, "time": round(time.time(), 3)})
                last, failing = now, False
            except StoreUnavailable as exc:
                if not failing:
                    log.warning("cannot write %s (etcd unreachable: %s); env-hosts wait",
                                self.keys.trainer_progress, exc, extra={"event": "progress_failed"})
                failing = True

    def _intake_loop(self) -> None:
        from rlfleet.common.sockets import ReliableReceiver

        receiver = ReliableReceiver(f"tcp://{self.spec.trainer.bind_host}:0", expect=ScoredTrajectory,
                                    name="trainer-trajectories")
        try:
            self.endpoint = receiver.endpoint
            self._bound.set()
            log.info("receiving trajectories on %s", receiver.endpoint, extra={"event": "bind"})
            while not self._stop.is_set():
                got = list(receiver.drain(timeout=0.2, max_n=512))
                if got:
                    self._ingest(receiver, got)
        except Exception as exc:  # noqa: BLE001
            self.error = f"intake: {type(exc).__name__}: {exc}"
            self.status = f"error: {self.error}"[:200]
            log.exception("intake stopped: %s", exc, extra={"event": "intake_error"})
            self._stop.set()
            self._data.set()
        finally:
            self.endpoint = None
            receiver.close()

    def _ingest(self, receiver: Any, got: list[tuple[str, Any]]) -> None:
        """Journal what is new, drop what cannot be trained, then ack: in that order."""
        assert self._journal is not None
        journal, g = self._journal, self.spec.task.group_size
        vocab = getattr(self._learner, "vocab_size", None)
        new: list[ScoredTrajectory] = []
        drops: list[tuple[str, str, str]] = []
        ok: list[str] = []
        refused: list[tuple[str, str]] = []
        counts, duplicate = journal.group_sizes(), journal.duplicates([st for _, st in got])
        seen: set[tuple[str, str]] = set()
        for (key, st), dup in zip(got, duplicate):
            t = st.trajectory
            if not t.trajectory_id or not t.group_id:
                refused.append((key, "trajectory_id and group_id must be non-empty"))
                continue
            if dup or (t.group_id, t.trajectory_id) in seen:
                self.counts["duplicate"] += 1
                ok.append(key)
                continue
            if counts.get(t.group_id, 0) >= g:
                # Checked before drops too: a complete group may be in training right now.
                refused.append((key, f"group {t.group_id} already holds {g} trajectories"))
                continue
            seen.add((t.group_id, t.trajectory_id))
            reason, detail = drop_reason(st)
            if not reason and (problem := check_trajectory(st, vocab)):
                reason, detail = INVALID, problem
            if reason:
                drops.append((t.group_id, reason, detail))
                self.counts["dropped"] += 1
            else:
                counts[t.group_id] = counts.get(t.group_id, 0) + 1
                new.append(st)
                self.counts["new"] += 1
            ok.append(key)
        journal.append_trajectories(new)
        journal.record_dropped(drops)
        if os.environ.get(FAILPOINT_ENV) == "exit_after_journal" and (new or drops):
            log.warning("failpoint: exiting after journaling, before the ack")
            os._exit(17)
        receiver.ack(ok)
        for key, why in refused:
            self.counts["refused"] += 1
            log.warning("refused %s: %s", key, why, extra={"event": "refuse"})
            receiver.ack([key], ok=False, error=why)
        if new or drops:
            self._data.set()
