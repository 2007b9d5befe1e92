"""Per-stage request queues (DistRS §4 "Proxy", §5.2 "Scheduling policy"): no I/O.

Each stage of a reward pipeline has one queue; a worker of that stage that becomes
free takes the head. Two orders, switchable:

``EbfQueue`` — Earliest-Batch-First: a priority queue ordered by the expected completion
time of the request's batch (DistRS Eq. 1-2 on the batch's history), the same order
across batches and tenants; requests of one batch (equal priority) leave in the order
they were pushed (FCFS). Why: a batch is done only when its last request is, so a
request of a batch due soon is worth more now than one of a batch due later (§3.2).

``FcfsQueue`` — first come, first served across everything: the baseline.

Both take ``push(item, priority)`` so the caller never branches on the policy; FCFS
ignores the priority. Items are opaque. ``requeue`` puts an item back at the head of
its order (a hand-over that failed), as ``dispatch.Dispatch.requeue`` does.
"""

from __future__ import annotations

import abc
import collections
import heapq
import itertools
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
QueuePolicy = Literal["ebf", "fcfs"]


class StageQueue(abc.ABC, Generic[T]):
    @abc.abstractmethod
    def push(self, item: T, priority: float) -> None:
        """Queue ``item``; ``priority``: its batch's expected completion (smaller first)."""

    @abc.abstractmethod
    def requeue(self, item: T, priority: float) -> None:
        """Put a popped item back ahead of everything of its priority."""

    @abc.abstractmethod
    def pop(self) -> T:
        """The head, removed; IndexError when empty."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class FcfsQueue(StageQueue[T]):
    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()

    def push(self, item: T, priority: float = 0.0) -> None:
        self._items.append(item)

    def requeue(self, item: T, priority: float = 0.0) -> None:
        self._items.appendleft(item)

    def pop(self) -> T:
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class EbfQueue(StageQueue[T]):
    """A heap of (priority, sequence, item): the sequence number makes equal priorities
    FCFS and never lets the heap compare two items."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)  # requeued items go before any pushed one

    def push(self, item: T, priority: float) -> None:
        heapq.heappush(self._heap, (priority, next(self._seq), item))

    def requeue(self, item: T, priority: float) -> None:
        heapq.heappush(self._heap, (priority, next(self._front), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def peek_priority(self) -> float:
        return self._heap[0][0]

    def __len__(self) -> int:
        return len(self._heap)


def make_queue(policy: QueuePolicy) -> StageQueue:
    if policy == "ebf":
        return EbfQueue()
    if policy == "fcfs":
        return FcfsQueue()
    raise ValueError(f"queue policy must be 'ebf' or 'fcfs', got {policy!r}")
