"""The reward-host's data path, on one thread (it owns both sockets and the pool):

    env-hosts ──Trajectory──► ReliableReceiver ──► RewardPool ──► Outbox ──ScoredTrajectory──► trainer
                     ◄──────────────── Ack, only after the trainer acked ◄────────────────────┘

- What becomes of each arrival is decided by ``dispatch.arrival`` (no I/O); this class
  does what it says. Dedup by trajectory id: a copy that arrives while the id is being
  scored or waits for the trainer is ignored (the env-host is acked once the trainer
  acks); a copy of an id the trainer already acked (our ack to the env-host was lost)
  is acked at once.
- Dropped trajectories (dropped_reason set) pass through unscored, reward 0.
- The prompt for scoring travels typed in ``Trajectory.prompt`` (common/wire/messages.py), set by
  the env-host, and goes on as it is in the RewardJob, so the reward-host needs no prompt
  stream and stays stateless; a missing prompt, or a task other than the job's, is
  scored 0 with ``reward_error`` saying why — never refused, so nothing is lost.
- Which queued job starts on which idle worker is the pool's Dispatch (dispatch.py).
- The ``pipeline`` backend's scaling plans are computed on its own thread,
  ``reward-planner`` (planner_thread.py); this thread only reads the last plan (woken by
  an fd among ``pool.fds()``), so dispatch never stalls while a plan is computed.
- Each job carries (tenant, batch) for batch-aware backends (``pipeline``): the tenant
  is the job's name, the batch ``batch_of`` its prompt id (docs/design/reward.md says why that
  estimate of the trainer's batch is good enough).
- Stateless: after a crash nothing is lost, because env-hosts re-send everything that
  was not acked, and the trainer drops duplicates by id.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import zmq
from prometheus_client import Counter

from rlfleet.common.log_throttle import LogThrottle
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory
from rlfleet.common.wire.outbox import Outbox
from rlfleet.common.wire.reliable import ReliableReceiver
from rlfleet.common.wire.validation import confined

from .backends import RewardBackend
from .dispatch import arrival
from .workers import RewardJob, RewardOutcome

log = logging.getLogger("rlfleet.reward_host")

HANDLED = Counter("rlfleet_reward_trajectories_total",
                  "Trajectories received by outcome: scored, reward_error, passed_dropped, duplicate",
                  ["outcome"])

# the labelled children, looked up once (labels() costs more than the increment)
_COUNTED = {o: HANDLED.labels(outcome=o.removesuffix("s"))
            for o in ("scored", "reward_errors", "passed_dropped", "duplicates")}

RECENT_IDS = 100_000  # acked ids remembered to answer late duplicates without re-scoring
REWARD_ERROR_LOG_EVERY_S = 10.0  # a failing scorer fails every trajectory: one line per this, not per item


def batch_of(prompt_id: int, prompts_per_batch: int) -> int:
    """The training batch a trajectory is estimated to land in. Prompt ids are the job's
    claim cursor (env_host.pacing): claimed in order, one group each, and the trainer
    fills its batches from groups in about that order, so ids P·b .. P·(b+1)-1 make
    batch b; early or late groups shift by a batch at most."""
    return prompt_id // max(1, prompts_per_batch)


class RewardService:
    def __init__(self, *, receiver: ReliableReceiver, pool: RewardBackend, task_name: str,
                 task_kwargs: dict[str, Any], name: str = "reward-host",
                 resend_after_s: float = 2.0, tenant: str = "", prompts_per_batch: int = 1) -> None:
        self.receiver, self.pool = receiver, pool
        self.tenant, self.prompts_per_batch = tenant, prompts_per_batch
        self.task_name, self.task_kwargs = task_name, dict(task_kwargs)
        self.outbox = Outbox(f"{name}->trainer", resend_after_s=resend_after_s)
        self._trainer: str | None = None  # written by the daemon's thread, read here
        self._in_flight: dict[str, Trajectory] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._poller_for = zmq.Poller()
        self._poller_key: tuple[object, tuple[int, ...]] | None = None
        self.stats = {"received": 0, "duplicates": 0, "scored": 0, "reward_errors": 0,
                      "passed_dropped": 0, "acked": 0, "refused": 0}
        # Every reward error is counted (HANDLED{outcome="reward_error"}); the log shows examples.
        self.error_log = LogThrottle(REWARD_ERROR_LOG_EVERY_S)

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        if outcome in _COUNTED:
            _COUNTED[outcome].inc()

    # -- thread-safe --------------------------------------------------------------------
    def set_trainer(self, address: str | None) -> None:
        self._trainer = address

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # -- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step(0.1)
        finally:
            self.outbox.close()

    def step(self, timeout: float) -> None:
        """Wait up to `timeout` for anything to do, then do all of it."""
        trainer = self._trainer
        self.outbox.set_addresses([trainer] if trainer else [])
        poller = self._poller()
        ready = dict(poller.poll(max(0, int(1000 * min(timeout, self.pool.next_deadline_in())))))
        if self.receiver.sock in ready:
            for tid, msg in self.receiver.drain(0.0, max_n=1000):
                assert isinstance(msg, Trajectory)
                with confined(self.receiver.name, "Trajectory"):
                    self._on_trajectory(tid, msg)
        # The pool also has deadlines (timeouts, respawns) that no fd announces: asked always.
        for outcome in self.pool.poll(0.0):
            self._on_outcome(outcome)
        acks: dict[tuple[bool, str], list[str]] = {}
        for tid, ok, error in self.outbox.poll(0.0):
            acks.setdefault((ok, error), []).append(tid)
            self._on_trainer_ack(tid)
        for (ok, error), tids in acks.items():  # one Ack per sender, not one per id
            self.receiver.ack(tids, ok=ok, error=error)  # refusals travel back to the env-host

    def _poller(self) -> zmq.Poller:
        """The poller over the sockets and the pool's fds, rebuilt only when they change
        (a new trainer address, a respawned worker): building one per step cost more
        than the step's work when trajectories arrive one at a time."""
        key = (self.outbox.sock, tuple(self.pool.fds()))
        if key != self._poller_key:
            poller = zmq.Poller()
            poller.register(self.receiver.sock, zmq.POLLIN)
            if key[0] is not None:
                poller.register(key[0], zmq.POLLIN)
            for fd in key[1]:
                poller.register(fd, zmq.POLLIN)
            self._poller_for, self._poller_key = poller, key
        return self._poller_for

    def _on_trajectory(self, tid: str, traj: Trajectory) -> None:
        self.stats["received"] += 1
        verdict, why = arrival(tid, traj, in_flight=self._in_flight, acked=self._recent,
                               task_name=self.task_name)
        if verdict == "refuse":
            self.receiver.ack([tid], ok=False, error=why)
            self._count("refused")
            return
        if verdict in ("wait", "ack_again"):
            self._count("duplicates")
            if verdict == "ack_again":
                self.receiver.ack([tid])  # our earlier ack was lost; the trainer has it
            return
        self._in_flight[tid] = traj
        if verdict == "pass_dropped":
            self._count("passed_dropped")
            self.outbox.send(tid, ScoredTrajectory(traj, 0.0, ""))
        elif verdict == "score_zero":
            self._on_outcome(RewardOutcome(tid, 0.0, why))
        else:
            assert traj.prompt is not None
            self.pool.submit(RewardJob(tid, self.task_name, self.task_kwargs, traj.prompt,
                                       [t.action for t in traj.turns], self.tenant,
                                       batch_of(traj.prompt_id, self.prompts_per_batch)))

    def _on_outcome(self, outcome: RewardOutcome) -> None:
        traj = self._in_flight.get(outcome.key)
        if traj is None:
            return  # cannot happen: every job has an in-flight trajectory
        if outcome.error:
            self._count("reward_errors")
            self.error_log.warning(log, "reward_error", "reward of %s failed: %s", outcome.key,
                                   outcome.error, extra={"trajectory": outcome.key, "event": "reward_error"})
        else:
            self._count("scored")
        self.outbox.send(outcome.key, ScoredTrajectory(traj, outcome.reward, outcome.error))

    def _on_trainer_ack(self, tid: str) -> None:
        """The trainer has it; the caller acks the env-host (all of a step's acks at once)."""
        self._in_flight.pop(tid, None)
        self.stats["acked"] += 1
        self._recent[tid] = None
        while len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)
