"""The reward-dispatch seam: ``[reward_host.dispatch]``, in which order waiting
trajectories go to free reward workers (ARCHITECTURE §5: FCFS now; earliest-batch-
first and the like later). Plain code, no processes or sockets: the backend owns
the workers and asks its queue for the next job whenever one is free.

Registered in pyproject.toml (``rlfleet.reward_dispatch``).
"""

from __future__ import annotations

import abc
import collections
from typing import Any, Literal

from rlfleet.common.registry import Kind, KindConfig


class DispatchQueue(abc.ABC):
    """Jobs waiting for a worker. One owner thread."""

    @abc.abstractmethod
    def push(self, job: Any) -> None:
        """A new job."""

    @abc.abstractmethod
    def pop(self) -> Any:
        """The job a free worker takes next (only when len() > 0)."""

    @abc.abstractmethod
    def put_back(self, job: Any) -> None:
        """A popped job no worker could take (the worker died): it goes next again."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class FifoQueue(DispatchQueue):
    """First come, first served."""

    def __init__(self) -> None:
        self._jobs: collections.deque[Any] = collections.deque()

    def push(self, job: Any) -> None:
        self._jobs.append(job)

    def pop(self) -> Any:
        return self._jobs.popleft()

    def put_back(self, job: Any) -> None:
        self._jobs.appendleft(job)

    def __len__(self) -> int:
        return len(self._jobs)


class FifoConfig(KindConfig):
    kind: Literal["fifo"] = "fifo"


class Fifo(Kind):
    Config = FifoConfig

    @classmethod
    def build(cls, config: FifoConfig, /, **_: Any) -> FifoQueue:
        return FifoQueue()
