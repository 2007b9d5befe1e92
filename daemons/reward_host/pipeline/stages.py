"""A multi-stage reward as data (DistRS §4, Table 1): no I/O, no clocks.

A reward is a ``Pipeline`` of ``Stage``s (compile on CPU workers, then run on an
accelerator, say); each stage has its worker kind, a cost per worker-second (C_j) and a
timeout (T_j). A request is one trajectory's reward: it carries its ``RequestKey``
(tenant, batch id, trajectory id), its arrival time and, once known, its running time at
each stage it reached (s_ij). A request visits a prefix of the stages: a compile that
fails ends the request there (DistRS §3.1, Fig. 6b), so ``service_s`` may be shorter than
the pipeline, and empty for a request that had nothing to score.

A stage that runs longer than its timeout is stopped at the timeout and the request ends
there as a recorded failure (``timed_out``); a batch never waits on it longer than that.

The batch-level quantities (DistRS Eq. 1-2): a request's earliest completion
t_i = r_i + Σ_j min(s_ij, T_j) (no queueing), the batch's T = max_i t_i, and its extra
delay d = (actual completion) − T.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

WorkerKind = Literal["cpu", "accelerator", "remote"]


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    worker_kind: WorkerKind
    cost: float  # per worker-second (C_j), in any unit shared by the stages
    timeout_s: float  # T_j: a request running longer here is stopped and fails

    def __post_init__(self) -> None:
        if not self.cost > 0:
            raise ValueError(f"stage {self.name}: cost must be > 0, got {self.cost}")
        if not self.timeout_s > 0:
            raise ValueError(f"stage {self.name}: timeout_s must be > 0, got {self.timeout_s}")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    @property
    def timeouts(self) -> tuple[float, ...]:
        return tuple(s.timeout_s for s in self.stages)

    def costliest_first(self) -> list[int]:
        """Stage indices by cost, highest first (Algorithm 1, line 7); ties keep order."""
        return sorted(range(len(self.stages)), key=lambda j: -self.stages[j].cost)

    def run_s(self, service_s: Sequence[float]) -> float:
        """Σ_j min(s_j, T_j), stopping after the first timeout: a request's time in
        service when it never queues."""
        total = 0.0
        for s, stage in zip(service_s, self.stages):
            total += min(s, stage.timeout_s)
            if s > stage.timeout_s:
                break
        return total

    def visits(self, service_s: Sequence[float]) -> int:
        """How many stages a request with these running times enters."""
        for j, (s, stage) in enumerate(zip(service_s, self.stages)):
            if s > stage.timeout_s:
                return j + 1
        return min(len(service_s), len(self.stages))


@dataclasses.dataclass(frozen=True, order=True)
class BatchKey:
    tenant: str
    batch: int


@dataclasses.dataclass(frozen=True)
class RequestKey:
    tenant: str
    batch: int
    trajectory: str

    @property
    def batch_key(self) -> BatchKey:
        return BatchKey(self.tenant, self.batch)


@dataclasses.dataclass(frozen=True)
class Request:
    key: RequestKey
    arrival_s: float  # when it reached the service (absolute, the simulation's clock)
    service_s: tuple[float, ...]  # running time at each stage it reaches, uncapped


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """One finished batch as history (DistRS Algorithm 1's input): each request's
    arrival offset r_i from the batch's first arrival, and its observed running times
    s_ij (a timed-out stage shows as its timeout, the request having stopped there)."""

    key: BatchKey
    offsets_s: tuple[float, ...]
    service_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.offsets_s) != len(self.service_s):
            raise ValueError(f"batch {self.key}: {len(self.offsets_s)} offsets for "
                             f"{len(self.service_s)} requests")

    def __len__(self) -> int:
        return len(self.offsets_s)

    def earliest_done_s(self, pipeline: Pipeline) -> float:
        """T relative to the batch's first arrival (Eq. 1-2)."""
        return max((r + pipeline.run_s(s) for r, s in zip(self.offsets_s, self.service_s)),
                   default=0.0)

    @classmethod
    def of(cls, key: BatchKey, requests: Sequence[Request], pipeline: Pipeline) -> BatchRecord:
        """The record of a batch from its requests, running times capped at the
        timeouts and cut after the stage that timed out (what a service observes)."""
        start = min((q.arrival_s for q in requests), default=0.0)
        observed = []
        for q in requests:
            n = pipeline.visits(q.service_s)
            observed.append(tuple(min(s, st.timeout_s)
                                  for s, st in zip(q.service_s[:n], pipeline.stages)))
        return cls(key, tuple(q.arrival_s - start for q in requests), tuple(observed))


def earliest_done_s(pipeline: Pipeline, requests: Sequence[Request]) -> float:
    """T of a batch on the absolute clock (Eq. 1-2)."""
    return max((q.arrival_s + pipeline.run_s(q.service_s) for q in requests), default=0.0)


@dataclasses.dataclass(frozen=True)
class ActiveBatch:
    """What the service knows of a batch in progress when it asks for a plan (the
    input of DistRS Algorithm 2): when its first request arrived (AT), where each
    request it has received is (queued at stage k, or running at stage k for
    ``elapsed`` seconds), and how many are finished. Requests not received yet are
    not listed: the planner takes them from the tenant's history."""

    key: BatchKey
    arrived_at_s: float
    queued: tuple[int, ...] = ()  # stage index of each queued request
    running: tuple[tuple[int, float], ...] = ()  # (stage index, elapsed s) of each running one
    done: int = 0
