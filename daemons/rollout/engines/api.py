"""The rollout-engine interface, torch-free: what every engine implements (``Engine``),
its statistics, its refusals, and the request checks every engine shares.

``engine.py`` (torch) and ``sim_engine.py`` (a timing model) implement it; the rollout's
loop (``core.py``) only sees this module, so a process hosting simulated rollouts never
imports torch.
"""

from __future__ import annotations

import abc
import math
import time
from collections import deque
from collections.abc import Collection, Mapping

import numpy as np

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import EngineStats, GenerateRequest, GenerateResult

MAX_SEED = 2**63 - 1


class TokenRate:
    """Generated tokens per second over the last ``window_s`` wall seconds, or since the
    first of those tokens (but at least 0.1 s, so one early step does not read as a burst)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()

    def add(self, tokens: int, now: float | None = None) -> None:
        self._steps.append((time.monotonic() if now is None else now, tokens))

    def per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()
        if not self._steps:
            return 0.0
        return sum(n for _, n in self._steps) / max(now - self._steps[0][0], 0.1)


class Engine(abc.ABC):
    """What the rollout daemon drives. Not thread-safe: one thread calls all methods."""

    weight_version: int

    @abc.abstractmethod
    def add(self, request: GenerateRequest) -> None:
        """Queue a request; a bad one comes back from the next step() as finish_reason="error"."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> GenerateResult | None:
        """Stop a waiting or running request: its partial result (finish_reason "abort"),
        or None if the id is not in the engine (finished or never added)."""

    @abc.abstractmethod
    def step(self) -> list[GenerateResult]:
        """Admit waiting requests, advance every running one by a token; finished results."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def has_running(self) -> bool:
        """True while some request has tokens in the cache (a weight load would split it)."""

    @abc.abstractmethod
    def running_ids(self) -> list[str]:
        """Ids of the requests that have tokens in the cache."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while step() has something to do (waiting, running or answers to hand out)."""

    @abc.abstractmethod
    def load_weights(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Replace the weights; only between requests (raises if has_running())."""


class BadRequest(ValueError):
    """A request the engine refuses; the message is the precise reason."""


def error_result(request: GenerateRequest | str, reason: str, version: int) -> GenerateResult:
    rid = request if isinstance(request, str) else request.request_id
    return GenerateResult(request_id=rid, token_ids=Int32Array(), logprobs=Float32Array(),
                          weight_version=version, finish_reason="error", error=reason)


def validate_request(r: GenerateRequest, *, known_ids: Collection[str], vocab_size: int,
                     capacity: int, capacity_name: str) -> int:
    """Raise BadRequest with the precise reason, or return the prompt's length.
    ``capacity``: the most prompt + new tokens one request may hold (``capacity_name``
    says what bounds it in the message)."""
    if not r.request_id:
        raise BadRequest("request_id is empty")
    if r.request_id in known_ids:
        raise BadRequest(f"request_id {r.request_id!r} is already waiting or running")
    if len(r.prompt_token_ids.shape) != 1:
        raise BadRequest(f"prompt_token_ids must be 1-D, got shape {r.prompt_token_ids.shape}")
    n = r.prompt_token_ids.size
    if n == 0:
        raise BadRequest("prompt_token_ids is empty")
    ids = r.prompt_token_ids.numpy()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise BadRequest(f"prompt token id out of range [0, {vocab_size}): min {lo}, max {hi}")
    if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
        raise BadRequest(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
    if not isinstance(r.prefix_tokens, int) or not 0 <= r.prefix_tokens < n:
        raise BadRequest(f"prefix_tokens must be in [0, {n}) (the prompt's length), got {r.prefix_tokens}")
    if n + r.max_new_tokens > capacity:
        raise BadRequest(f"prompt of {n} tokens + max_new_tokens {r.max_new_tokens} exceeds "
                         f"{capacity_name} {capacity}")
    if not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise BadRequest(f"temperature must be finite and >= 0 (0 = greedy), got {r.temperature}")
    if not (math.isfinite(r.top_p) and 0 < r.top_p <= 1):
        raise BadRequest(f"top_p must be in (0, 1], got {r.top_p}")
    if r.seed is not None and not 0 <= r.seed <= MAX_SEED:
        raise BadRequest(f"seed must be in [0, 2**63), got {r.seed}")
    return n
