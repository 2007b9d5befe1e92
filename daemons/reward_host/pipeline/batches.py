"""Where every request of every open batch is, for the scaling planner: no I/O, the
clock passed in (the pipeline backend's monotonic seconds).

A batch (tenant, batch id; stages.BatchKey) opens with its first request and is done
when ``expected`` of its requests have finished, or, since some never come (dropped
upstream, scored 0 by the service, or landing in a later batch than estimated), once
nothing of it has been in the pipeline for ``idle_s``. Its requests' arrival offsets and
observed stage times become a ``BatchRecord`` (the planner's history), and its extra
delay is measured as DistRS defines it: actual completion − T (Eq. 1-2 on the record).

A request that arrives for a batch already done opens it again (a late straggler): the
planner then sees it as a new batch of that key, which costs a plan, never a request.
"""

from __future__ import annotations

import dataclasses

from rlfleet.daemons.reward_host.pipeline.stages import ActiveBatch, BatchKey, BatchRecord, Pipeline, RequestKey


@dataclasses.dataclass
class _Request:
    arrival_s: float
    stage: int = 0
    running_since: float | None = None  # None: queued at `stage`
    service_s: list[float] = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass
class _Batch:
    arrived_at_s: float
    requests: dict[str, _Request] = dataclasses.field(default_factory=dict)
    finished: int = 0
    last_change_s: float = 0.0
    last_done_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ClosedBatch:
    record: BatchRecord
    extra_delay_s: float  # actual completion − earliest completion T (≥ 0 up to clock noise)
    completion_s: float  # first arrival to last finish


class BatchTracker:
    def __init__(self, pipeline: Pipeline, *, expected: int, idle_s: float) -> None:
        self.pipeline, self.expected, self.idle_s = pipeline, expected, idle_s
        # A shared service's tenants have batches of their own sizes (each caller says
        # its own); a tenant not in here has ``expected``.
        self.expected_by_tenant: dict[str, int] = {}
        self._batches: dict[BatchKey, _Batch] = {}
        self._where: dict[str, tuple[BatchKey, _Request]] = {}

    def __len__(self) -> int:
        return len(self._batches)

    def arrive(self, key: RequestKey, now: float) -> bool:
        """A request queued at the first stage; True when it opened its batch."""
        batch = self._batches.get(key.batch_key)
        opened = batch is None
        if batch is None:
            batch = self._batches[key.batch_key] = _Batch(now, last_change_s=now)
        request = _Request(now)
        batch.requests[key.trajectory] = request
        batch.last_change_s = now
        self._where[key.trajectory] = (key.batch_key, request)
        return opened

    def arrived_at(self, batch: BatchKey) -> float:
        return self._batches[batch].arrived_at_s

    def batch_of(self, trajectory: str) -> BatchKey:
        return self._where[trajectory][0]

    def start(self, trajectory: str, stage: int, now: float) -> None:
        request = self._where[trajectory][1]
        request.stage, request.running_since = stage, now

    def stage_done(self, trajectory: str, seconds: float, *, queued_next: bool) -> None:
        """The request left its stage after ``seconds`` (capped at the timeout by the
        caller); ``queued_next``: it waits at the next stage now."""
        request = self._where[trajectory][1]
        request.service_s.append(seconds)
        request.running_since = None
        if queued_next:
            request.stage += 1

    def finish(self, trajectory: str, now: float) -> ClosedBatch | None:
        """The request is done; its batch's record when that was the batch's last."""
        key, request = self._where.pop(trajectory)
        request.done = True
        batch = self._batches[key]
        batch.finished += 1
        batch.last_change_s = batch.last_done_s = now
        # all done, not only `expected` of them: more than estimated may be in the pipeline
        expected = self.expected_by_tenant.get(key.tenant, self.expected)
        if expected and batch.finished >= expected and batch.finished == len(batch.requests):
            return self._close(key)
        return None

    def close_idle(self, now: float) -> list[ClosedBatch]:
        """Batches with nothing in the pipeline and no change for ``idle_s``."""
        idle = [k for k, b in self._batches.items()
                if b.finished == len(b.requests) and now - b.last_change_s >= self.idle_s]
        return [self._close(k) for k in idle]

    def next_idle_in(self, now: float) -> float:
        """Seconds until close_idle has a batch to close (inf: none can be)."""
        due = [b.last_change_s + self.idle_s - now for b in self._batches.values()
               if b.finished == len(b.requests)]
        return max(0.0, min(due, default=float("inf")))

    def active(self, now: float) -> list[ActiveBatch]:
        out = []
        for key, b in self._batches.items():
            queued, running = [], []
            for r in b.requests.values():
                if r.done:
                    continue
                if r.running_since is None:
                    queued.append(r.stage)
                else:
                    running.append((r.stage, now - r.running_since))
            out.append(ActiveBatch(key, b.arrived_at_s, tuple(queued), tuple(running), b.finished))
        return out

    def _close(self, key: BatchKey) -> ClosedBatch:
        batch = self._batches.pop(key)  # every request of it is done (finish, close_idle)
        requests = list(batch.requests.values())
        record = BatchRecord(key, tuple(r.arrival_s - batch.arrived_at_s for r in requests),
                             tuple(tuple(r.service_s) for r in requests))
        completion = batch.last_done_s - batch.arrived_at_s
        return ClosedBatch(record, max(0.0, completion - record.earliest_done_s(self.pipeline)),
                           completion)
