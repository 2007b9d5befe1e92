"""The trainer daemon: policy weights, optimizer, journaled experience buffer,
checkpoints, weight versions (leader-elected).

Only the elected leader trains. A standby keeps its trajectories socket
*closed* (no "trajectories" address in its member record) rather than
answering with ack(ok=False): an ok=False ack tells the sender to give up on
a trajectory for good, which would lose data, while a closed socket only makes
the reward-host hold on to it until it finds the leader's address. When a
standby becomes leader, its TrainingWorker resumes from the last checkpoint and
the journal (both under the run directory, which must therefore be on storage
every trainer candidate can reach). A leader that loses leadership stops its
worker (socket and journal closed) without checkpointing: the new leader may
already be writing.

An etcd outage is not a loss of leadership (docs/operations/failsafe.md): the session's
failsafe keeps the worker training from its in-memory state while publishing,
checkpoints and trainer/progress wait for leadership to be confirmed. When etcd
answers, the same reign goes on if nobody else led meanwhile; a leader that was
superseded stops its worker (fenced: nothing it trained meanwhile was published),
and one that leads again after someone else did restarts from the checkpoint and
journal. The journal's lock fences the files: a new leader cannot open the journal
while a failsafe leader still holds it, so the failsafe ends after FAILSAFE_MAX_S.

Member record fields: ``training`` (standby, starting, resuming, waiting,
training, done, pausing, paused, stopped, error: <why>), and while leading ``version``,
``checkpoint_version`` and ``paused`` (held at a step boundary, checkpointed).

Maintenance mode (docs/operations/maintenance-mode.md): the leader reads the job's `state` once
per cycle (one Range) and hands it to its worker, which holds at the next step
boundary; an etcd outage keeps the last state read. A failed start (bad model folder, journal held by
another process) is retried with back-off; the daemon itself stays up.

The work itself is in worker.py (the threads, composing intake.py, training.py,
checkpointing.py, progress.py, metrics_log.py) on top of journal.py, batching.py and
the learner [trainer.backend] builds (backends.py: learner.py with grpo.py, or
sim_learner.py); this class only follows leadership, and keeps ``cycle()`` short as
the Daemon base requires.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rlfleet.common.control.pause import PauseWatch
from rlfleet.common.daemon import Daemon
from rlfleet.common.spec.job import JobSpec

from .metrics_log import set_member_id
from .worker import TrainingWorker

log = logging.getLogger("rlfleet.trainer")

RETRY_AFTER_S = (2.0, 30.0)  # back-off after a failed start: first, most
DRAIN_TIMEOUT_S = 120.0
ADDRESS_POLL_S = 0.02  # cycle period while a starting worker's address is unpublished  # finish the step in progress and write the last checkpoint
# Longest a leader that cannot reach etcd keeps training. In a lost quorum nobody can take
# over and nothing is gained by stopping; in a partition of this trainer alone a standby
# may lead already and waits for the journal lock we hold: give it back after this long.
FAILSAFE_MAX_S = 300.0


class Trainer(Daemon):
    role = "trainer"

    def setup(self) -> None:
        self._worker: TrainingWorker | None = None
        self._announced: str | None = None  # the trajectories address in the last member record
        self._stopping: TrainingWorker | None = None  # lost leadership, still finishing a step
        self._retry_at = 0.0
        self._failures = 0
        self._last_error = ""
        self._reign = 0  # the session's reign the running worker was started in
        set_member_id(self.options.member_id)  # the id label of the disk-failure counters
        self._job_state = PauseWatch(self.store, self.keys)  # read by the leader each cycle
        # The session keeps the leader's work through an etcd outage (docs/operations/failsafe.md).
        assert self.session is not None
        self.session.failsafe = True
        # Leader or standby, import what the trainer backend needs now (torch and the
        # model's code): a standby that takes over then starts training seconds sooner.
        threading.Thread(target=_prewarm, args=(self.spec,),
                         name="trainer-prewarm", daemon=True).start()

    def cycle(self) -> str | None:
        assert self.spec is not None
        self._announced = self.addresses.get("trajectories")
        said: list[str] = []
        w = self._worker
        if self._stopping is not None and not self._stopping.alive:
            self._stopping = None
        if w is not None and not w.alive:
            self._worker = None
            self._set_address(None)
            if w.error:
                self._failures += 1
                self._last_error = w.error
                delay = min(RETRY_AFTER_S[1], RETRY_AFTER_S[0] * 2 ** (self._failures - 1))
                self._retry_at = time.monotonic() + delay
                said.append(f"training failed ({w.error}); retrying in {delay:.0f} s")
            w = None
        s = self.session
        assert s is not None
        if not self.is_leader and w is not None and s.failsafe_since is not None:
            held_s = time.monotonic() - s.failsafe_since
            if held_s < FAILSAFE_MAX_S:
                return "; ".join(said) or None  # training on; publishing waits (AsyncPublisher)
            said.append(f"failsafe for {held_s:.0f} s: stopping training so a standby can lead")
        if not self.is_leader:
            if w is not None:
                w.stop()
                self._stopping, self._worker = w, None
                self._set_address(None)
                said.append("not the leader any more: stopped training, socket closed")
            return "; ".join(said) or None
        if w is not None and self._reign != s.reign:
            # Leading again, but another trainer led in between: what this worker holds
            # in memory is older than the journal and checkpoints that trainer wrote.
            w.stop()
            self._stopping, self._worker = w, None
            self._set_address(None)
            said.append("another trainer led meanwhile: restarting from the checkpoint and journal")
            return "; ".join(said)
        changed = self._job_state.read()
        if changed:
            said.append(changed)
        if w is not None:
            w.set_paused(self._job_state.paused)
        if s.handover_to:
            return "; ".join(said) or None  # handing over (prepare_handover): train no more
        if w is None and self._stopping is None and time.monotonic() >= self._retry_at:
            self._worker = TrainingWorker(self.spec, self.store, self.keys,
                                          is_leader=lambda: self.is_leader, on_bound=self.wake,
                                          term=lambda: s.term if s.is_leader else 0,
                                          paused=self._job_state.paused)
            self._reign = s.reign
            self._worker.start()
            said.append("leader: resuming training from the last checkpoint and journal")
        elif w is not None:
            if w.endpoint and self.addresses.get("trajectories") != w.endpoint:
                self._set_address(w.endpoint)
                self._failures, self._last_error = 0, ""
                said.append(f"receiving trajectories on {w.endpoint} at version {w.version}")
        return "; ".join(said) or None

    def cycle_interval_s(self) -> float | None:
        # A leader whose worker is starting publishes its trajectories address the moment
        # the socket is bound: until then reward-hosts hold every scored trajectory.
        # (The member record is written at the start of a cycle: `_announced` is what the
        # last one published.)
        w = self._worker
        if w is not None and self._announced != w.endpoint:
            return ADDRESS_POLL_S
        return None

    def prepare_handover(self, to: str) -> bool:
        """Switchover to `to`: finish the step in progress and checkpoint it (still the
        leader, so the checkpoint is written), close the socket; ready once the worker is
        gone, journal lock included, so `to` resumes from that checkpoint at once."""
        w = self._worker
        if w is not None:
            w.stop(checkpoint=True)
            self._stopping, self._worker = w, None
            self._set_address(None)
            log.info("switchover to %s: finishing the step and writing a checkpoint at version %d", to, w.version,
                     extra={"event": "handover"})
        return self._stopping is None or not self._stopping.alive

    def _set_address(self, endpoint: str | None) -> None:
        # A new dict, never an in-place change: the session compares the member value
        # with the one it last published, which holds a reference to this dict.
        rest = {k: v for k, v in self.addresses.items() if k != "trajectories"}
        self.addresses = {**rest, "trajectories": endpoint} if endpoint else rest

    def drain(self) -> str | None:
        w = self._worker or self._stopping
        if w is None:
            return None
        # Still the leader while draining (the session closes after): save the work.
        w.stop(checkpoint=self._worker is not None and self.is_leader)
        self._set_address(None)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not w.join(self.spec.etcd.refresh_interval_s if self.spec else 1.0):
            if time.monotonic() >= deadline:
                return f"training thread did not stop in {DRAIN_TIMEOUT_S:g} s (version {w.version})"
            # The step in progress and the last checkpoint may outlast the lease:
            # keep it (and leadership) alive meanwhile, or a standby takes over mid-write.
            if self.session is not None:
                self.session.step(self.member_value())
        return f"training stopped at version {w.version}"

    def reload(self, spec: JobSpec) -> str:
        self.spec = spec
        for w in (self._worker, self._stopping):
            if w is not None:
                w.spec = spec
        return "reloaded spec (trainer limits apply from the next step)"

    def member_info(self) -> dict[str, Any]:
        w = self._worker
        if w is None:
            status = "standby" if not self.is_leader else (
                f"error: {self._last_error}"[:200] if self._last_error else "starting")
            return {"training": status}
        errors = {"checkpoint_error": w.state.checkpoint_error,  # a full disk: docs/operations/disk-full.md
                  "journal_error": w.state.journal_error}
        guard = {"non_finite_groups": w.state.non_finite_groups,
                 "non_finite_steps": w.state.non_finite_steps, "non_finite": w.state.non_finite,
                 "rewinds": w.state.rewinds}  # steps skipped before a NaN reached the weights (guard.py)
        return {"training": w.status, "version": w.version, "checkpoint_version": w.checkpoint_version,
                "paused": w.paused, **{k: v for k, v in {**errors, **guard}.items() if v}}


def _prewarm(spec: JobSpec) -> None:
    from rlfleet.common.spec.seams import TRAINER_BACKENDS

    backend = spec.trainer.backend
    try:
        TRAINER_BACKENDS.get(backend.kind).prewarm(backend, model_path=str(spec.model.path))  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 — only an optimisation; the worker reports errors
        log.debug("prewarm skipped: %s", exc)
