"""The remote_http backend's decisions, with no I/O (remote.py does the I/O): the
request body and the reading of answers (the protocol of docs/design/reward.md, "Remote
endpoints"), the backoff before a retry, and an endpoint's circuit breaker.

Why our own few lines rather than tenacity/stamina and pybreaker/purgatory (none of
which is installed): a retry here is not "call the same function again" — it goes
back to the queue, waits for a slot, prefers another endpoint and is bounded by the
trajectory's own deadline; and a breaker's half-open state must be part of choosing
an endpoint with a free slot, not a wrapper around one call.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec

from rlfleet.daemons.reward_host.remote.config import RetryConfig
from rlfleet.daemons.reward_host.workers import RewardJob

RETRY_STATUSES = frozenset({408, 429})  # and every 5xx: the endpoint may answer later


def retryable(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


def backoff_s(attempt: int, retry: RetryConfig, rng: random.Random,
              retry_after_s: float = 0.0) -> float:
    """The wait after failed attempt number ``attempt`` (1-based): the cap doubles from
    backoff_base_s up to backoff_max_s; "full" jitter draws uniformly below the cap so
    that clients failing together do not come back together. An endpoint's Retry-After
    is a floor, itself capped at backoff_max_s (a misbehaving header cannot park a job)."""
    cap = min(retry.backoff_max_s, retry.backoff_base_s * 2.0 ** (attempt - 1))
    wait = rng.uniform(0.0, cap) if retry.jitter == "full" else cap
    return min(retry.backoff_max_s, max(wait, retry_after_s))


class Breaker:
    """One endpoint's circuit: ``failures`` consecutive failed attempts open it for
    ``open_s``; then it is half-open, letting ``probes`` requests through; the first
    success closes it, a failure opens it again. Times are the caller's clock."""

    def __init__(self, failures: int, open_s: float, probes: int) -> None:
        self.threshold, self.open_s, self.probes = failures, open_s, probes
        self.state = "closed"
        self.consecutive = 0
        self.open_until = 0.0

    def refresh(self, now: float) -> str:
        if self.state == "open" and now >= self.open_until:
            self.state = "half_open"
        return self.state

    def allows(self, now: float, probes_in_flight: int) -> bool:
        state = self.refresh(now)
        return state == "closed" or (state == "half_open" and probes_in_flight < self.probes)

    def success(self) -> None:
        # Any answer proves the endpoint alive, even one that started before it opened.
        self.state, self.consecutive = "closed", 0

    def failure(self, now: float) -> None:
        if self.state == "open":
            return  # a request sent before it opened: the circuit already knows
        self.consecutive += 1
        if self.state == "half_open" or self.consecutive >= self.threshold:
            self.state, self.open_until, self.consecutive = "open", now + self.open_s, 0


def job_body(job: RewardJob, batch_requests: int = 0) -> bytes:
    """The request body. ``tenant``, ``batch`` and ``batch_requests`` (the job's name, the
    estimated training batch, trajectories per batch) are for a shared reward service
    (shared_service.py), which schedules several jobs' batches; an endpoint that does
    not know them ignores them."""
    return msgspec.json.encode({"trajectory_id": job.key, "task": job.task,
                                "task_kwargs": job.difficulty, "prompt": job.prompt.to_dict(),
                                "completions": list(job.texts), "tenant": job.tenant,
                                "batch": job.batch, "batch_requests": batch_requests})


def read_reward(content: bytes) -> float:
    """The reward of a 200 answer; ValueError if it is not the protocol."""
    try:
        doc = msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        raise ValueError(f"answer is not JSON: {exc}") from None
    reward = doc.get("reward") if isinstance(doc, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"answer has no finite number 'reward': {content[:200]!r}")
    return float(reward)


def error_text(status: int, content: bytes) -> str:
    try:
        doc = msgspec.json.decode(content)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return f"HTTP {status}: {doc['error']}"
    except msgspec.DecodeError:
        pass
    return f"HTTP {status}: {content[:200].decode('utf-8', 'replace')}"


def retry_after(headers: Any) -> float:
    value = headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        return 0.0  # absent, or an HTTP date: our own backoff decides
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0
