"""The leader's training machinery, composed: journal, learner, and three threads.

The learner is what ``[trainer.backend]`` builds (backends.py): the torch
``learner.Learner`` or the sim backend's ``sim_learner.SimLearner``; both have the
interface used here (version, vocab_size, model, train_step, state_tensors,
save_checkpoint, load_checkpoint).

A TrainingWorker lives while its daemon leads. Starting it resumes from the
newest loadable checkpoint and the journal; stopping it closes the socket and
the journal (releasing the journal lock for whoever leads next). It only wires
the parts together and runs their threads; each part does one thing:

- intake thread (``intake.Intake``, owns the ReliableReceiver socket): receive
  ScoredTrajectory -> validate -> journal (fsync) -> ack, so acks never wait for
  a training step;
- train thread (``training.TrainingLoop``): select -> ``learner.train_step`` ->
  journal -> publish (``publishing.AsyncPublisher``, its own thread) -> metrics
  line (``metrics_log``) -> checkpoint (``checkpointing``) -> evaluate;
- progress thread (``progress.ProgressWriter``): trainer/progress in etcd.

Files (``Paths``): ``$RLFLEET_RUN_DIR`` or ``<job.runs_dir>/<job>``, holding
``checkpoints/step-<version>/``, ``checkpoints/journal.bin`` and ``metrics.jsonl``
(its lines: metrics_log.py).

``status`` (shown as ``training`` in the member record): see ``TrainerState``.

Restart semantics (resume.py): the learner resumes at the newest checkpoint's version
with its weights; the groups trained after it lost their effect on the weights, are
journaled as pending again (REOPENED) and trained once more in their original batches at
their original versions; nothing below the highest version made before is published again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import Store
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.run_dir import job_run_dir

from .checkpointing import Checkpointer
from .claimed import ClaimedPrompts
from .intake import Intake
from .journal import ExperienceJournal
from .metrics_log import MetricsLog
from .progress import ProgressWriter, progress_record
from .resume import restore
from .training import TrainerState, TrainingLoop

log = logging.getLogger("rlfleet.trainer")


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
                 publisher: Any = None, is_leader: Callable[[], bool] = lambda: True,
                 on_bound: Callable[[], None] = lambda: None,
                 term: Callable[[], int] = lambda: 0, paused: bool = False) -> None:
        """``publisher``: anything with ``publish(version, tensors)`` to use instead of
        the relay's WeightPublisher (an in-process relay, a test's recorder).
        ``is_leader`` (confirmed leadership) is asked before each checkpoint, publication
        and trainer/progress write: a trainer that may have been replaced must not write
        into the shared checkpoint folder nor publish (docs/operations/failsafe.md); while it is
        False the training itself goes on. ``term``: the leader's fencing term, stamped
        into weights/latest. ``paused``: start held (the job is paused); `set_paused`
        changes it."""
        self.is_leader, self.on_bound, self.term = is_leader, on_bound, term
        self.spec = spec  # replaced on SIGHUP (max_steps, max_staleness take effect at once)
        self.store, self.keys = store, keys
        self.paths = Paths.for_job(spec)
        self.state = TrainerState()
        self.checkpoint_on_stop = False
        self._stop = threading.Event()
        self._data = threading.Event()  # intake -> train: new trajectories arrived
        self._pause = threading.Event()  # the job is paused: train -> hold at the step boundary
        if paused:
            self._pause.set()
        self._journal: ExperienceJournal | None = None
        self._intake: Intake | None = None
        self._loop: TrainingLoop | None = None
        self._publisher: Any = None
        self._publisher_override = publisher
        self._main = threading.Thread(target=self._run, name="trainer-train", daemon=True)
        self._intake_thread = threading.Thread(target=self._run_intake, name="trainer-intake",
                                               daemon=True)
        self._progress_thread = threading.Thread(target=self._run_progress, name="trainer-progress",
                                                 daemon=True)

    # -- what the daemon shows (member record) and tests read ----------------------------
    @property
    def status(self) -> str:
        return self.state.status

    @property
    def error(self) -> str:
        return self.state.error

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def checkpoint_version(self) -> int:
        return self.state.checkpoint_version

    @property
    def paused(self) -> bool:
        """Held at a step boundary with its version checkpointed (not merely asked to)."""
        return self.state.paused

    def set_paused(self, paused: bool) -> None:
        """The job's state as the daemon last read it; the train thread acts at its next pass."""
        if paused != self._pause.is_set():
            if paused:
                self._pause.set()
            else:
                self._pause.clear()
            self._data.set()  # wake the train thread now, not at its next poll

    @property
    def counts(self) -> Counter[str]:
        return self.state.counts

    @property
    def endpoint(self) -> str | None:
        return self._intake.endpoint if self._intake is not None else None

    def progress(self) -> dict[str, int]:
        """What trainer/progress says: env-hosts pace their claims by consumed_groups."""
        assert self._journal is not None
        return progress_record(self._journal.state, self.state.version, self.spec.task.group_size)

    # -- lifecycle (called from the daemon's cycle) ------------------------------------
    def start(self) -> None:
        self._main.start()

    def stop(self, checkpoint: bool = False) -> None:
        self.checkpoint_on_stop = checkpoint
        self._stop.set()
        self._data.set()

    @property
    def alive(self) -> bool:
        return self._main.is_alive() or self._intake_thread.is_alive()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in (self._main, self._intake_thread):
            if t.is_alive() or t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        return not self.alive

    # -- the threads ----------------------------------------------------------------------
    def _run(self) -> None:
        """The train thread: resume, start the others, train until stopped."""
        try:
            self._resume()
            if self._stop.is_set():
                return
            assert self._intake is not None and self._loop is not None
            self._intake_thread.start()
            self._progress_thread.start()
            self._intake.bound.wait(30)
            self._loop.run(self._stop)
            if self.checkpoint_on_stop and self.state.version > self.state.checkpoint_version:
                self._loop.checkpoint()
        except Exception as exc:  # noqa: BLE001 — reported in member_info; the daemon retries
            self.state.failed(f"{type(exc).__name__}: {exc}")
            log.exception("training stopped: %s", self.state.error, extra={"event": "train_error"})
        finally:
            self._stop.set()
            for t in (self._intake_thread, self._progress_thread):
                if t.ident is not None:
                    t.join()
            if self._publisher is not None:
                self._publisher.close()
            if self._journal is not None:
                self._journal.close()
            # A learner that holds process-wide state (megatron's process group) gives it back.
            close = getattr(self._loop.learner if self._loop is not None else None, "close", None)
            if close is not None:
                close()
            if not self.state.error:
                self.state.status = "stopped"

    def _run_intake(self) -> None:
        assert self._intake is not None
        try:
            self._intake.run(self._stop)
        except Exception as exc:  # noqa: BLE001
            self.state.failed(f"intake: {type(exc).__name__}: {exc}")
            log.exception("intake stopped: %s", exc, extra={"event": "intake_error"})
            self._stop.set()
            self._data.set()

    def _run_progress(self) -> None:
        ProgressWriter(self.store, self.keys.trainer_progress, self.progress,
                       may_write=self.is_leader).run(self._stop)

    # -- building the parts ------------------------------------------------------------
    def _resume(self) -> None:
        from rlfleet.common.spec.seams import TRAINER_BACKENDS

        from .evaluation import Evaluator, evaluation_off

        self.state.status = "resuming"
        self._journal = journal = ExperienceJournal(self.paths.journal)
        # [trainer.backend]: the torch Learner, or the sim backend's timing model
        # (backends.py); torch is imported only here, by a leader, and only for torch.
        learner = TRAINER_BACKENDS.build(self.spec.trainer.backend, spec=self.spec)
        replay = restore(learner, journal, self.paths.checkpoints)
        self.state.checkpoint_version = self.state.version = learner.version
        self._publisher = self._make_publisher()
        evaluator = None
        off = evaluation_off(self.spec, learner)
        if off is None:
            evaluator = Evaluator(self.spec, self.paths.metrics)
        else:
            log.warning("held-out evaluation off: %s", off, extra={"event": "no_eval"})
        checkpointer = Checkpointer(learner, journal, self.paths.checkpoints, store=self.store,
                                    key=self.keys.trainer_checkpoint, is_leader=self.is_leader)
        self._loop = TrainingLoop(spec=lambda: self.spec, journal=journal, learner=learner,
                                  publisher=self._publisher, checkpointer=checkpointer,
                                  evaluator=evaluator, metrics=MetricsLog(self.paths.metrics),
                                  state=self.state, wake=self._data, pause=self._pause,
                                  replay=replay, stop=self._stop)
        self._loop.maybe_evaluate()  # version 0, or one a restart has not evaluated yet
        self._intake = Intake(journal, bind_host=self.spec.trainer.bind_host,
                              group_size=lambda: self.spec.task.group_size,
                              launched=lambda: self.spec.task.group_size + self.spec.env_host.redundant_samples,
                              vocab_size=getattr(learner, "vocab_size", None),
                              counts=self.state.counts, on_data=self._data.set,
                              on_bound=self.on_bound, claimed=ClaimedPrompts(self.store, self.keys))
        log.info("resumed at version %d (the checkpoint's), %d steps (%d groups) to re-train up to "
                 "version %d, %d pending groups in the journal", self.state.version, replay.steps_left,
                 replay.groups_left, replay.made_up_to, len(journal.state.pending), extra={"event": "resume"})

    def _make_publisher(self) -> Any:
        from .publishing import AsyncPublisher

        if self._publisher_override is not None:
            return AsyncPublisher(self._publisher_override, may_publish=self.is_leader)
        try:
            from rlfleet.relay.publisher import WeightPublisher
        except ImportError as exc:
            log.warning("weight publishing disabled: rlfleet.relay.publisher unavailable (%s)", exc,
                        extra={"event": "no_publisher"})
            return None
        r = self.spec.relay
        return AsyncPublisher(WeightPublisher(self.store, self.keys.job, transport=r.transport,
                                              chunk_bytes=r.chunk_mib << 20, term=self.term),
                              may_publish=self.is_leader)
