"""The rollout's engine thread: socket I/O and weight loads between engine steps.

One thread owns the engine and the ``requests`` socket (ZeroMQ sockets belong to one
thread), and loops::

    drain the socket (GenerateRequest -> add, Abort -> abort, RolloutStats -> reply)
    -> load a newer weight version if the engine has no running request
    -> engine.step() -> reply finished results

Weight-version policy (every generated segment has exactly one version): when to
ask the reader, when to load, when to hold a new request back, is decided by
``WeightUpdatePolicy`` (weight_policy.py, no I/O); this loop asks it and does the
I/O. Cut-short requests end with finish_reason "abort" and their partial tokens,
tagged with the old version. A version that fails to load (wrong names or shapes)
is logged once and skipped until a newer one appears; the engine keeps serving the
version it has. A version the relay no longer (or not yet) holds (LookupError) is
simply asked for again at the next check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rlfleet.common.sockets import RequestServer
from rlfleet.common.wire import (Abort, Float32Array, GenerateRequest, GenerateResult, Int32Array,
                                 RolloutStats)

from .engine import Engine, error_result
from .weight_policy import WeightUpdatePolicy

log = logging.getLogger("rlfleet.rollout")


class WeightView(Protocol):
    version: int
    tensors: dict[str, Any]


class WeightReader(Protocol):
    """What the local relay offers (rlfleet.relay.reader.WeightReader)."""

    def newest(self) -> int | None: ...

    def open(self, version: int | None = None) -> AbstractContextManager[WeightView]: ...


@dataclass
class _Client:
    identity: bytes
    rid: str  # the socket-level request id the reply must carry


class EngineLoop:
    """Runs in its own thread (``start()``); ``events`` holds one sentence per version change."""

    def __init__(self, engine: Engine, server: RequestServer, member_id: str,
                 reader_factory: Callable[[], WeightReader | None] | None = None, *,
                 hold_max_s: float = 2.0, check_every_s: float = 0.05,
                 idle_wait_s: float = 0.05, drain_timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.server = server
        self.member_id = member_id
        self.reader_factory = reader_factory
        self.reader: WeightReader | None = None
        self.policy = WeightUpdatePolicy(check_every_s=check_every_s, hold_max_s=hold_max_s)
        self.idle_wait_s = idle_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.events: deque[str] = deque()  # read and cleared by the daemon's cycle()
        self.error: BaseException | None = None  # set if the thread died
        self._clients: dict[str, _Client] = {}  # engine request_id -> who to answer
        self._held: deque[tuple[float, _Client, GenerateRequest]] = deque()
        self._next_reader_try = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)

    # -- control, from other threads ---------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def release(self) -> None:
        """Allow the next weight load even with running requests (they end as "abort").

        Stays in force while requests run, so a release that comes just before the
        new version is seen still applies; it lapses once nothing is running."""
        self.policy.release()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Drain (finish running requests for up to drain_timeout_s, abort the rest) and stop."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._one_pass()
            self._drain()
        except BaseException as exc:  # a bug: the daemon's cycle() sees it and exits
            log.exception("engine thread died")
            self.error = exc

    def _one_pass(self) -> None:
        busy = self.engine.has_work() or bool(self._held)
        self._receive(0.0 if busy else self.idle_wait_s)
        self._update_weights(time.monotonic())
        self._admit_held(time.monotonic())
        if self.engine.has_work():
            self._step()

    def _receive(self, timeout: float, max_messages: int = 1000) -> None:
        for _ in range(max_messages):  # bounded: a flood must not starve decoding
            got = self.server.recv(timeout)
            if got is None:
                return
            timeout = 0.0
            identity, rid, msg = got
            if isinstance(msg, GenerateRequest):
                self._on_generate(_Client(identity, rid), msg, time.monotonic())
            elif isinstance(msg, Abort):
                self._on_abort(_Client(identity, rid), msg.request_id)
            elif isinstance(msg, RolloutStats):
                self.server.reply(identity, rid, self.stats())

    def _on_generate(self, client: _Client, req: GenerateRequest, now: float) -> None:
        if self._stop.is_set():
            self._reply(client, error_result(req, "rollout is draining", self.engine.weight_version))
            return
        if req.request_id in self._clients or any(h[2].request_id == req.request_id for h in self._held):
            self._reply(client, error_result(
                req, f"request_id {req.request_id!r} is already waiting or running",
                self.engine.weight_version))
            return
        if self.policy.hold(self.engine.weight_version):
            self._held.append((now, client, req))
            return
        self._add(client, req)

    def _add(self, client: _Client, req: GenerateRequest) -> None:
        self._clients[req.request_id] = client
        try:
            self.engine.add(req)
        except Exception as exc:  # noqa: BLE001 — a request must never take the engine down
            self._clients.pop(req.request_id, None)
            self._reply(client, error_result(req, f"engine refused the request: {exc}",
                                             self.engine.weight_version))

    def _on_abort(self, client: _Client, request_id: str) -> None:
        result = self.engine.abort(request_id)
        if result is None:
            for i, (_, held_client, req) in enumerate(self._held):
                if req.request_id == request_id:
                    del self._held[i]
                    self._clients[request_id] = held_client
                    result = _empty(request_id, self.engine.weight_version, "abort")
                    break
        if result is None:
            self._reply(client, _empty(request_id, self.engine.weight_version, "abort",
                                       "not waiting or running (finished, or never received)"))
            return
        self._answer(result)  # the generate request's own caller
        self._reply(client, result)

    def stats(self) -> RolloutStats:
        s = self.engine.stats()
        return RolloutStats(rollout_id=self.member_id, weight_version=s.weight_version,
                            running=s.running, waiting=s.waiting + len(self._held),
                            kv_used=s.kv_used, kv_total=s.kv_total,
                            tokens_per_s=s.tokens_per_s, time=time.time())

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as exc:  # noqa: BLE001 — answer everyone, keep serving
            log.exception("engine step failed; answering %d request(s) with errors", len(self._clients))
            for request_id in list(self._clients):
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 — the engine may be inconsistent; answer anyway
                    pass
                self._answer(error_result(request_id, f"engine step failed: {exc}",
                                          self.engine.weight_version))
            return
        for result in results:
            self._answer(result)

    def _answer(self, result: GenerateResult) -> None:
        client = self._clients.pop(result.request_id, None)
        if client is not None:
            self._reply(client, result)

    def _reply(self, client: _Client, result: GenerateResult) -> None:
        self.server.reply(client.identity, client.rid, result)

    # -- weights -------------------------------------------------------------------
    def _get_reader(self, now: float) -> WeightReader | None:
        if self.reader is None and self.reader_factory is not None and now >= self._next_reader_try:
            try:
                self.reader = self.reader_factory()
                if self.reader is None:
                    self.reader_factory = None  # no relay module in this installation
            except Exception as exc:  # noqa: BLE001 — the relay may come up later
                log.warning("weight reader unavailable, retrying in 5 s: %s", exc)
                self._next_reader_try = now + 5.0
        return self.reader

    def _update_weights(self, now: float) -> None:
        reader = self._get_reader(now)
        if reader is None:
            return
        if self.policy.check_due(now):
            try:
                self.policy.saw(reader.newest())
            except Exception as exc:  # noqa: BLE001 — keep serving the version we have
                log.warning("weight reader newest() failed: %s", exc)
        action = self.policy.decide(self.engine.weight_version, self.engine.has_running())
        if action.version is None:
            return
        if action.cut_running:
            self._abort(self.engine.running_ids(), "released for a weight update")
        self._load(reader, action.version)

    def _abort(self, request_ids: list[str], why: str) -> None:
        for request_id in request_ids:
            result = self.engine.abort(request_id)
            if result is not None:
                log.info("request %s ended early: %s", request_id, why)
                self._answer(result)

    def _load(self, reader: WeightReader, version: int) -> None:
        old = self.engine.weight_version
        started = time.monotonic()
        try:
            with reader.open(version) as view:
                if view.version <= old:
                    return
                self.engine.load_weights(view.version, view.tensors)
        except LookupError as exc:  # the relay freed it or does not hold it yet: ask again later
            log.info("weight version %s not available yet: %s", version, exc)
            return
        except Exception as exc:  # noqa: BLE001 — a bad version must not stop serving
            self.policy.refused(version)
            log.error("loading weight version %s failed, keeping version %s: %s", version, old, exc)
            self.events.append(f"weight version {version} refused ({exc}); serving version {old}")
            return
        self.events.append(f"loaded weight version {self.engine.weight_version} (was {old}) "
                           f"in {time.monotonic() - started:.2f} s")

    def _admit_held(self, now: float) -> None:
        serving = self.engine.weight_version
        while self._held and self.policy.admit(serving, self._held[0][0], now):
            _, client, req = self._held.popleft()
            self._add(client, req)

    # -- draining ----------------------------------------------------------------------
    def _drain(self) -> None:
        """Finish what runs (bounded), refuse new work, then abort what is left."""
        deadline = time.monotonic() + self.drain_timeout_s
        for _, client, req in self._held:
            self._reply(client, error_result(req, "rollout is draining", self.engine.weight_version))
        self._held.clear()
        while self.engine.has_work() and time.monotonic() < deadline:
            self._receive(0.0)
            self._step()
        self._receive(0.0)  # what arrived meanwhile is refused now, not left to time out
        self._abort(list(self._clients), "rollout is draining")


def _empty(request_id: str, version: int, reason: str, error: str = "") -> GenerateResult:
    return GenerateResult(request_id=request_id, token_ids=Int32Array(), logprobs=Float32Array(),
                          weight_version=version, finish_reason=reason, error=error)  # type: ignore[arg-type]
