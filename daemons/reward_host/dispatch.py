"""The reward-host's decisions, with no I/O: what becomes of an arriving trajectory
(``arrival``), and which queued reward job goes to which idle worker next (``Dispatch``).

``arrival`` is asked by the service (service.py) for every trajectory it receives:

    refuse        the key is not the trajectory's id: a negative ack, for good
    wait          a copy of an id being scored or waiting for the trainer: the
                  sender is acked when the trainer acks the first copy
    ack_again     a copy of an id the trainer already acked (our ack was lost)
    pass_dropped  dropped upstream: forwarded unscored, reward 0
    score_zero    cannot be scored (another task, no prompt): reward 0 and a
                  reward_error saying why; never refused, so nothing is lost
    score         a RewardJob for the pool

The pool (workers.py) owns processes and pipes; it tells a Dispatch what arrived
(``add``), what could not be handed over (``requeue``), and, whenever workers are
idle, asks ``pick`` for one (worker, job) pair at a time until it says None. A
worker is named by an opaque int the pool chooses; a dispatch may prefer some
workers over others but must only return one of those it was offered.

``FifoDispatch`` (the default): jobs in arrival order, to the first idle worker
offered; a job that could not be handed over goes back to the front.

``EbfDispatch`` (``kind = "ebf"``): Earliest-Batch-First (DistRS §5.2, queues.EbfQueue):
the job whose batch is expected to finish first goes first, jobs of one batch in arrival
order. A job's priority is ``priority_of(job)``, which the service supplies (its
ScalingPlanner's ``expected_done_s`` of the job's batch, docs/design/reward.md); without one,
every job has the same priority and the order is FIFO.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.common.spec.registry import Kind, KindConfig
from rlfleet.common.wire.messages import Trajectory
from rlfleet.daemons.reward_host.pipeline.queues import EbfQueue

if TYPE_CHECKING:  # workers.py imports this module
    from .workers import RewardJob


Verdict = Literal["refuse", "wait", "ack_again", "pass_dropped", "score_zero", "score"]


def arrival(key: str, traj: Trajectory, *, in_flight: Container[str], acked: Container[str],
            task_name: str) -> tuple[Verdict, str]:
    """(verdict, why) for a trajectory received under ``key``; ``in_flight``: ids being
    scored or waiting for the trainer; ``acked``: ids the trainer acked recently."""
    if key != traj.trajectory_id:
        return "refuse", f"key {key!r} is not the trajectory's id {traj.trajectory_id!r}"
    if key in in_flight:
        return "wait", ""
    if key in acked:
        return "ack_again", ""
    if traj.dropped_reason:
        return "pass_dropped", ""
    if traj.task != task_name:
        return "score_zero", f"trajectory of task {traj.task!r}, this job scores {task_name!r}"
    if traj.prompt is None:
        return "score_zero", "no prompt in the trajectory (a sender older than Trajectory.prompt)"
    return "score", ""


class Dispatch(abc.ABC):
    @abc.abstractmethod
    def add(self, job: RewardJob) -> None:
        """A new job to score."""

    @abc.abstractmethod
    def requeue(self, job: RewardJob) -> None:
        """A picked job that could not be handed to its worker; it is queued again."""

    @abc.abstractmethod
    def pick(self, idle: Sequence[int]) -> tuple[int, RewardJob] | None:
        """The next (worker, job) among the idle workers, removed from the queue; None
        when no job should start now."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Jobs queued."""


class FifoDispatch(Dispatch):
    def __init__(self) -> None:
        self._queue: collections.deque[RewardJob] = collections.deque()

    def add(self, job: RewardJob) -> None:
        self._queue.append(job)

    def requeue(self, job: RewardJob) -> None:
        self._queue.appendleft(job)

    def pick(self, idle: Sequence[int]) -> tuple[int, RewardJob] | None:
        if not idle or not self._queue:
            return None
        return idle[0], self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)


class EbfDispatch(Dispatch):
    def __init__(self, priority_of: Callable[[RewardJob], float] | None = None) -> None:
        self._priority_of = priority_of or (lambda job: 0.0)
        self._queue: EbfQueue[tuple[float, RewardJob]] = EbfQueue()

    def add(self, job: RewardJob) -> None:
        # the priority is fixed when the job is queued: a heap cannot reorder itself
        priority = self._priority_of(job)
        self._queue.push((priority, job), priority)

    def requeue(self, job: RewardJob) -> None:
        priority = self._priority_of(job)
        self._queue.requeue((priority, job), priority)

    def pick(self, idle: Sequence[int]) -> tuple[int, RewardJob] | None:
        if not idle or not len(self._queue):
            return None
        return idle[0], self._queue.pop()[1]

    def __len__(self) -> int:
        return len(self._queue)


# -- the seam: [reward_host.dispatch] (registered in pyproject.toml, rlfleet.reward_dispatch)
class FifoConfig(KindConfig):
    kind: Literal["fifo"] = "fifo"


class Fifo(Kind):
    Config = FifoConfig

    @classmethod
    def build(cls, config: FifoConfig, /, **_: Any) -> FifoDispatch:
        return FifoDispatch()


class EbfConfig(KindConfig):
    kind: Literal["ebf"] = "ebf"


class Ebf(Kind):
    Config = EbfConfig

    @classmethod
    def build(cls, config: EbfConfig, /, *, priority_of: Callable[[Any], float] | None = None,
              **_: Any) -> EbfDispatch:
        return EbfDispatch(priority_of)
