"""Which queued reward job goes to which idle worker next: the decision, with no I/O.

The pool (workers.py) owns processes and pipes; it tells a Dispatch what arrived
(``add``), what could not be handed over (``requeue``), and, whenever workers are
idle, asks ``pick`` for one (worker, job) pair at a time until it says None. A
worker is named by an opaque int the pool chooses; a dispatch may prefer some
workers over others but must only return one of those it was offered.

``FifoDispatch`` (the default): jobs in arrival order, to the first idle worker
offered; a job that could not be handed over goes back to the front.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # workers.py imports this module
    from .workers import RewardJob


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
