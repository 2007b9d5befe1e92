"""The ``sim`` rollout engine: serves GenerateRequests on a timing model (docs/design/sim.md).

No weights: the engine knows how many tokens each request will generate (``sim_lengths``)
and how long each decode step of its batch takes (``sim_timing``). Its clock is the wall
clock (a model second lasts ``time_scale`` wall seconds); ``step()`` returns every result
whose modelled finish time has passed.

Event-driven, not a loop per token. Between two *events* (a request finishes, requests
are admitted, the KV cache overflows and one is preempted, a weight load ends) the batch
is constant: ``n`` requests holding ``K`` KV tokens, each step adds ``n``, and the first
``m`` steps of such a *segment* take, in closed form (``t(0) = 0``)::

    t(m) = extra + m * b + kv * (m * K + n * m * (m - 1) / 2)

(``b`` = the flat/linear batch term, ``kv`` = per KV token, ``extra`` = the prefill of the
requests admitted at the segment's start); the whole steps done by a given time solve a
quadratic. A running request holds ``G - base`` tokens at global step count ``G`` (one
heap of finish step counts) and the batch ``kv_fixed + n * G`` KV tokens: an event costs
O(log n), a finished request one copy of its tokens.

Scheduling (vLLM-like): at each event, finished requests leave; while the next step would
overflow the KV capacity, the latest admitted request is preempted to the head of the
queue (recompute: it keeps its tokens, re-prefills prompt + tokens when readmitted); then
waiting requests are admitted FIFO while fewer than ``max_batch`` run and the cache has
room for their prompt (and tokens) plus one step's growth of the batch. A request added
mid-step joins at the next step boundary; one added while nothing runs starts at once.

Tokens are a function of (seed, trajectory id, base prompt, position in the turn), so a
continuation (``prefix_tokens`` = k) generates exactly positions k.. of the uninterrupted
turn on any engine with the same seed.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import EngineStats, GenerateRequest, GenerateResult
from rlfleet.daemons.rollout.engines.api import BadRequest, Engine, error_result, validate_request
from rlfleet.daemons.rollout.sim.lengths import LENGTH_MODELS, LengthModel, length_keys
from rlfleet.daemons.rollout.sim.timing import SimTiming

RATE_WINDOW_S = 5.0  # tokens_per_s: generated tokens over about this many recent wall seconds


@dataclass(eq=False, slots=True)
class _Req:
    request: GenerateRequest
    added_at: float  # wall time of add()
    prompt_len: int
    prefix: int  # prefix_tokens: positions of the turn generated before this request
    total: int  # tokens this request generates when it runs to its end
    reason: str  # "stop" or "length", when it runs to its end
    token_key: int  # hash of (seed, trajectory, base prompt): its tokens' stream
    gen_before: int = 0  # tokens generated before its current admission (preempted earlier)
    base: int = 0  # while running: it holds G - base tokens at global step count G
    finish: int = 0  # while running: the G at which it has all its tokens
    order: int = -1  # admission sequence number (the latest admitted is preempted first)
    running: bool = False
    # Weight version at its first admission. A preempted request is readmitted at the
    # latest when the running set empties, before a load can come: one version per request.
    version: int = -1
    first_token_at: float = -1.0


TOKEN_TABLE_SIZE = 1 << 20  # per (seed, vocab, eos) and process: 8 MiB of ids and log-probs


@functools.lru_cache(maxsize=4)
def _token_table(seed: int, vocab_size: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids in [0, vocab) without EOS, and log-probs in [-4.05, -0.05).
    PCG64 from the seed: the same table in every process of a fleet."""
    rng = np.random.Generator(np.random.PCG64(seed))
    tokens = rng.integers(0, vocab_size - 1, TOKEN_TABLE_SIZE, dtype=np.int32)
    tokens += tokens >= eos  # skip the EOS id
    logprobs = -0.05 - 4.0 * rng.random(TOKEN_TABLE_SIZE, dtype=np.float32)
    return tokens, logprobs


class SimEngine(Engine):
    """An Engine whose generation is a timing model; see the module docstring."""

    def __init__(self, timing: SimTiming, lengths: LengthModel, *, vocab_size: int,
                 eos_token_id: int, seed: int = 0, time_scale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, weight_version: int = 0) -> None:
        if not (vocab_size >= 2 and 0 <= eos_token_id < vocab_size and time_scale > 0):
            raise ValueError(f"need vocab_size >= 2, eos_token_id in [0, vocab_size), time_scale "
                             f"> 0; got {vocab_size}, {eos_token_id}, {time_scale}")
        self.timing, self.lengths, self.clock = timing, lengths, clock
        self.vocab_size, self.eos, self.seed = vocab_size, eos_token_id, seed
        self.time_scale = time_scale
        self.weight_version = weight_version
        self.max_batch = timing.max_batch
        self.kv_capacity = timing.kv_capacity_tokens
        # The timing constants in wall seconds.
        self._base = timing.base_s * time_scale
        self._kv = timing.kv_s_per_token * time_scale
        self._prefill = timing.prefill_s_per_token * time_scale
        self._load = timing.load_s * time_scale
        now = clock()
        self._G = 0  # decode steps done up to the last event
        self._Tb = now  # wall time of the last event (the current segment's start)
        # The current segment (n = 0: none, the engine is idle or loading).
        self._n_seg = self._K_seg = self._m_end = 0
        self._b_seg = self._extra = 0.0
        self._running: dict[str, _Req] = {}
        self._kv_fixed = 0  # sum over running of prompt_len - base: KV held = kv_fixed + n * G
        self._heap: list[tuple[int, int, _Req]] = []  # (finish, order, request), lazily pruned
        self._stack: list[tuple[int, _Req]] = []  # (order, request) in admission order, lazy
        self._orders = 0
        self._admitted_now: list[_Req] = []  # admitted at the current segment's start
        self._waiting: deque[_Req] = deque()
        self._ids: set[str] = set()
        self._load_until: float | None = None
        self._due: list[tuple[float, GenerateResult, float]] = []  # (due, result, latency)
        self._answers: list[tuple[float, GenerateResult]] = []  # refusals, due at add()
        # Accounting (wall seconds; tokens).
        self._t0 = now
        self._gen = 0  # tokens generated in committed steps
        self._kv_area = 0.0  # integral of KV tokens held over wall time, committed steps
        self._idle_s, self._idle_since = 0.0, now
        # Lag: over delivered results, (step() time - due time) and (due time - add time).
        self.late_s = self.latency_s = self.max_late_s = 0.0
        self.results_delivered = 0
        self._rate = deque([(now, 0)])

    @classmethod
    def from_config(cls, config: Any, *, vocab_size: int, eos_token_id: int,
                    clock: Callable[[], float] = time.monotonic) -> SimEngine:
        """From a ``SimEngineConfig`` (engines.py)."""
        return cls(config.timing(), LENGTH_MODELS.build(config.lengths), vocab_size=vocab_size,
                   eos_token_id=eos_token_id, seed=config.seed, time_scale=config.time_scale,
                   clock=clock)

    # -- the segment's closed form ------------------------------------------------------
    def _t(self, m: int) -> float:
        """Wall seconds from the segment's start to the end of its m-th step."""
        if m <= 0:
            return 0.0
        return self._extra + m * self._b_seg + self._kv * (m * self._K_seg
                                                           + self._n_seg * m * (m - 1) / 2)

    def _steps_by(self, t: float) -> int:
        """Whole steps of the current segment done by wall time t (at most its event's)."""
        if self._n_seg == 0:
            return 0
        e = t - self._Tb
        if e < self._t(1):
            return 0
        if e >= self._t(self._m_end):
            return self._m_end
        # a m^2 + b m + (extra - e) = 0, the root in its cancellation-free form.
        a = self._kv * self._n_seg / 2
        b = self._b_seg + self._kv * self._K_seg - a
        c = e - self._extra
        m = int(2 * c / (b + math.sqrt(b * b + 4 * a * c)))
        m = min(max(m, 1), self._m_end - 1)
        while m > 1 and self._t(m) > e:  # float rounding: at most a step either way
            m -= 1
        while m + 1 < self._m_end and self._t(m + 1) <= e:
            m += 1
        return m

    def _area(self, m: int) -> float:
        """KV tokens held x wall seconds over the first m steps of the current segment."""
        if m <= 0:
            return 0.0
        n, k = self._n_seg, self._K_seg
        s1 = m * k + n * m * (m - 1) / 2  # sum of the KV held during each step
        s2 = m * k * k + k * n * m * (m - 1) + n * n * (m - 1) * m * (2 * m - 1) / 6
        return self._b_seg * s1 + self._kv * s2 + k * self._extra

    def _commit(self, m: int) -> None:
        """Account m whole steps of the current segment and move G and the event time."""
        self._kv_area += self._area(m)
        self._gen += self._n_seg * m
        self._Tb += self._t(m)
        self._G += m

    # -- events -------------------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Process every event up to wall time t."""
        while True:
            if self._load_until is not None:
                if t < self._load_until:
                    return
                self._Tb, self._load_until = self._load_until, None
                self._event()
            elif self._n_seg == 0 or self._Tb + self._t(self._m_end) > t:
                return
            else:
                self._commit(self._m_end)
                self._event()

    def _event(self) -> None:
        """At the step boundary (G, Tb): finishes, preemptions, admissions, next segment."""
        G, T, heap = self._G, self._Tb, self._heap
        while heap and heap[0][0] <= G:
            finish, _, r = heapq.heappop(heap)
            if r.running and r.finish == finish:
                self._remove(r)
                self._deliver(r, r.total, r.reason, T)
        n = len(self._running)
        while n and self._kv_fixed + n * G + n > self.kv_capacity:
            r = self._latest()
            r.gen_before = G - r.base
            self._remove(r)
            self._waiting.appendleft(r)
            n -= 1
        self._admitted_now = []
        self._extra = 0.0
        self._admit()

    def _admit(self) -> None:
        """Admit waiting requests at the current event and start the next segment there."""
        G, n = self._G, len(self._running)
        kv = self._kv_fixed + n * G
        while self._waiting and n < self.max_batch and self._load_until is None:
            r = self._waiting[0]
            need = r.prompt_len + r.gen_before  # recompute: its tokens are prefilled again
            if kv + need + n + 1 > self.kv_capacity:
                break  # FIFO: nobody overtakes the head
            self._waiting.popleft()
            if r.version < 0:
                r.version = self.weight_version
            r.base, r.finish, r.order, r.running = G - r.gen_before, G - r.gen_before + r.total, self._orders, True
            self._orders += 1
            self._running[r.request.request_id] = r
            self._kv_fixed += r.prompt_len - r.base
            heapq.heappush(self._heap, (r.finish, r.order, r))
            self._stack.append((r.order, r))
            self._extra += need * self._prefill
            self._admitted_now.append(r)
            kv += need
            n += 1
        self._start_segment()
        for r in self._admitted_now:
            if r.gen_before == 0:
                r.first_token_at = self._Tb + self._t(1)

    def _start_segment(self) -> None:
        n = self._n_seg = len(self._running)
        self._busy(n > 0, self._Tb)
        if n == 0:
            self._m_end = 0
            return
        heap = self._heap
        while not (heap[0][2].running and heap[0][2].finish == heap[0][0]):
            heapq.heappop(heap)  # stale: aborted, preempted or finished earlier
        self._K_seg = self._kv_fixed + n * self._G
        self._b_seg = self._base * max(1.0, n / self.timing.roofline_batch)
        # The next event: the first finish, or the step whose growth would overflow the cache.
        self._m_end = min(heap[0][0] - self._G, (self.kv_capacity - self._K_seg) // n)

    def _remove(self, r: _Req) -> None:
        del self._running[r.request.request_id]
        r.running = False
        self._kv_fixed -= r.prompt_len - r.base
        if len(self._stack) > 2 * len(self._running) + 64:
            self._stack = [(o, q) for o, q in self._stack if q.running and q.order == o]

    def _latest(self) -> _Req:
        while True:
            order, r = self._stack.pop()
            if r.running and r.order == order:
                return r

    def _busy(self, busy: bool, t: float) -> None:
        if busy and self._idle_since >= 0:
            self._idle_s += t - self._idle_since
            self._idle_since = -1.0
        elif not busy and self._idle_since < 0:
            self._idle_since = t

    def _change_at_next_boundary(self, t: float) -> None:
        """The batch changes (an add, an abort) at the first step boundary after t."""
        self._m_end = min(self._m_end, self._steps_by(t) + 1)

    # -- results ------------------------------------------------------------------------
    def _result(self, r: _Req, n: int, reason: str) -> GenerateResult:
        """The first n of r's tokens (positions prefix.. of its turn); EOS last on "stop"."""
        tokens, logprobs = self._tokens(r.token_key, r.prefix, r.prefix + n)
        if reason == "stop":
            tokens[-1] = self.eos
        first = r.first_token_at - r.added_at if r.first_token_at >= 0 else 0.0
        return GenerateResult(request_id=r.request.request_id,
                              token_ids=Int32Array.frombuffer(tokens),
                              logprobs=Float32Array.frombuffer(logprobs),
                              weight_version=r.version if r.version >= 0 else self.weight_version,
                              finish_reason=reason,  # type: ignore[arg-type]
                              first_token_s=first)

    def _tokens(self, key: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (never EOS) and log-probs of positions start..stop-1 of the turn with
        this key: a window of the seed's token table at an offset given by the key, so any
        slice of a turn is the same wherever it is made (a copy: ~1 us, not a hash a token)."""
        tokens, logprobs = _token_table(self.seed, self.vocab_size, self.eos)
        size = len(tokens)
        lo = (key + start) % size
        if lo + (stop - start) <= size:
            return tokens[lo:lo + stop - start].copy(), logprobs[lo:lo + stop - start].copy()
        idx = np.arange(lo, lo + stop - start) % size  # wraps around the table's end
        return tokens[idx], logprobs[idx]

    def _deliver(self, r: _Req, n: int, reason: str, due: float) -> None:
        self._ids.discard(r.request.request_id)
        self._due.append((due, self._result(r, n, reason), due - r.added_at))

    # -- the Engine interface -----------------------------------------------------------
    def add(self, request: GenerateRequest) -> None:
        t = self.clock()
        self._advance(t)
        try:
            r = self._make(request, t)
        except BadRequest as exc:
            self._answers.append((t, error_result(request, str(exc), self.weight_version)))
            return
        self._ids.add(request.request_id)
        self._waiting.append(r)
        if self._load_until is not None:
            return  # admitted when the load ends
        if self._n_seg == 0:  # idle: it starts now
            self._Tb = t
            self._event()
        elif t <= self._Tb:  # the same instant as the last event: its batch is still open
            self._admit()
        elif len(self._waiting) == 1:  # (behind a waiting head it would not be admitted)
            self._change_at_next_boundary(t)

    def _make(self, r: GenerateRequest, t: float) -> _Req:
        n = validate_request(r, known_ids=self._ids, vocab_size=self.vocab_size,
                             capacity=self.kv_capacity, capacity_name="the KV capacity in tokens,")
        k = r.prefix_tokens
        group_key, member_key = length_keys(self.seed, r.prompt_token_ids.data[:(n - k) * 4],
                                            r.trajectory_id)
        cap = r.max_new_tokens + k  # the whole turn's budget
        full = min(self.lengths.length(group_key, member_key), cap)
        reason = "length" if full == cap else "stop"
        # A prefix past the turn's length (only from a caller that changed the budget): stop now.
        total, reason = (full - k, reason) if full > k else (1, "stop")
        return _Req(r, t, n, k, total, reason, (group_key ^ member_key) & 0xFFFFFFFFFFFFFFFF)

    def abort(self, request_id: str) -> GenerateResult | None:
        if request_id not in self._ids:
            return None
        t = self.clock()
        self._advance(t)
        r = self._running.get(request_id)
        if r is None:
            r = next((q for q in self._waiting if q.request.request_id == request_id), None)
            if r is None:  # it finished by now: its result comes from the next step()
                return None
            self._ids.discard(request_id)
            self._waiting.remove(r)
            return self._result(r, r.gen_before, "abort")
        self._ids.discard(request_id)
        m = self._steps_by(t)
        self._remove(r)
        result = self._result(r, self._G + m - r.base, "abort")
        if t <= self._Tb:  # the same instant as the last event: its batch is still open
            self._admit()
        elif self._running:
            self._change_at_next_boundary(t)
        else:  # nothing left: the step in flight is dropped, the engine idles from now
            k = self._K_seg + self._n_seg * m
            self._commit(m)
            self._kv_area += k * (t - self._Tb)
            self._Tb = t
            self._n_seg = self._m_end = 0
            self._busy(False, t)
            if self._waiting:
                self._event()
        return result

    def step(self) -> list[GenerateResult]:
        t = self.clock()
        self._advance(t)
        out = [res for _, res in self._answers]
        self._answers = []
        for due, res, latency in self._due:
            late = t - due
            self.late_s += late
            self.latency_s += latency
            self.max_late_s = max(self.max_late_s, late)
            out.append(res)
        self.results_delivered += len(self._due)
        self._due = []
        return out

    def next_event_at(self) -> float | None:
        """Wall time of the next event (a result due, a load's end, a change of the batch):
        no result is due before it. None: nothing running, waiting, loading or to hand
        out. add(), abort() and load_weights() change it: ask again after them."""
        if self._answers or self._due:
            return min([t for t, _ in self._answers] + [t for t, _, _ in self._due])
        if self._load_until is not None:
            return self._load_until
        if self._n_seg == 0:
            return None
        return self._Tb + self._t(self._m_end)

    def stats(self) -> EngineStats:
        t = self.clock()
        self._advance(t)
        n = len(self._running)
        generated = self._gen + self._n_seg * self._steps_by(t)
        rate = self._rate
        if t - rate[-1][0] >= 0.1:
            rate.append((t, generated))
        while len(rate) > 2 and rate[1][0] <= t - RATE_WINDOW_S:
            rate.popleft()
        t_old, gen_old = rate[0]
        return EngineStats(weight_version=self.weight_version, running=n,
                           waiting=len(self._waiting),
                           kv_used=self._kv_fixed + n * (self._G + self._steps_by(t)),
                           kv_total=self.kv_capacity,
                           tokens_per_s=(generated - gen_old) / max(t - t_old, 0.1))

    def has_running(self) -> bool:
        return bool(self._running)

    def running_ids(self) -> list[str]:
        return list(self._running)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._answers or self._due)

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        """Take the version (the tensors are not looked at); nothing runs for load_s."""
        if self._running:
            raise RuntimeError(f"load_weights with {len(self._running)} running request(s): "
                               "a version may change only between requests")
        t = self.clock()
        self._advance(t)
        self.weight_version = version
        self._load_until = t + self._load

    # -- accounting for benchmarks -------------------------------------------------------
    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far: finished, aborted and held by running requests."""
        t = self.clock()
        self._advance(t)
        return self._gen + self._n_seg * self._steps_by(t)

    @property
    def idle_s(self) -> float:
        """Wall seconds since construction with no running request (loads included)."""
        t = self.clock()
        self._advance(t)
        return self._idle_s + (t - self._idle_since if self._idle_since >= 0 else 0.0)

    def kv_utilization_mean(self) -> float:
        """Time-weighted mean of kv_used / kv_total since construction."""
        t = self.clock()
        self._advance(t)
        m = self._steps_by(t)
        area = self._kv_area + self._area(m)
        if self._n_seg:  # the step in flight
            area += (self._K_seg + self._n_seg * m) * (t - self._Tb - self._t(m))
        elapsed = t - self._t0
        return area / (self.kv_capacity * elapsed) if elapsed > 0 else 0.0

    def lag_fraction(self) -> float:
        """Sum over delivered results of (step() time - due time) / sum of their modelled
        latencies (add to due). A run above 0.05 ran behind its timing model: invalid."""
        return self.late_s / self.latency_s if self.latency_s > 0 else 0.0
