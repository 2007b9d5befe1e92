"""The rollout's engine thread: one engine, its ``requests`` socket, weight loads between steps.

One thread, ``rollout-engine``, owns the engine and the socket (ZeroMQ sockets belong
to one thread) and loops::

    drain the socket -> RolloutCore.on_message (core.py)
    -> weights.get(): the reader of the local relay, as the rollout-relay thread left it
    -> RolloutCore.tick: load a newer weight version when the mode allows, admit held
       requests, engine.step(), reply finished results

What each message and each version change means is ``core.RolloutCore``; this module
only waits for messages and owns the thread. Finding the relay (an etcd read, and a new
one when the relay dies or is replaced) is the ``rollout-relay`` thread's
(``relay_source.RelayFollower``): this thread never waits on etcd. A version the relay
no longer (or not yet) holds (LookupError) is simply asked for again at the next check;
one that fails to load is logged once and skipped until a newer one appears.

The rollout daemon's threads: its main loop (``common.daemon``: lease refresh,
``cycle()`` reporting what the other two did), ``rollout-engine`` (this module, serving)
and ``rollout-relay`` (relay_source.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from rlfleet.common.threads import LoopThread
from rlfleet.common.wire.messages import RolloutStats
from rlfleet.common.wire.sockets import RequestServer
from rlfleet.daemons.rollout.engines.api import Engine

from .core import ReaderSource, RolloutCore, limit_vocab

log = logging.getLogger("rlfleet.rollout")


class EngineLoop(LoopThread):
    """Runs in its own thread (``start()``); ``events`` holds one sentence per version change."""

    def __init__(self, engine: Engine, server: RequestServer, member_id: str,
                 weights: ReaderSource | None = None, *,
                 mode: str = "trajectory", hold_max_s: float = 2.0, check_every_s: float = 0.05,
                 idle_wait_s: float = 0.05, drain_timeout_s: float = 2.0) -> None:
        super().__init__("rollout-engine")
        limit_vocab(server, engine)
        self.core = RolloutCore(engine, member_id, where=getattr(server, "name", None), mode=mode, hold_max_s=hold_max_s,
                                check_every_s=check_every_s)
        self.engine, self.server, self.member_id = engine, server, member_id
        self.weights = weights  # None: serve the version on disk (0) for good
        self.idle_wait_s = idle_wait_s
        self.drain_timeout_s = drain_timeout_s
        self.error: BaseException | None = None  # set if the thread died

    @property
    def events(self) -> deque[str]:  # read and cleared by the daemon's cycle()
        return self.core.events

    @property
    def policy(self):  # noqa: ANN201 — the core's WeightUpdatePolicy
        return self.core.policy

    # -- control, from other threads ---------------------------------------------------
    def release(self) -> None:
        """Allow the next weight load even with running requests (they end as "abort").

        Stays in force while requests run, so a release that comes just before the
        new version is seen still applies; it lapses once nothing is running."""
        self.core.release()

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain (finish running requests for up to drain_timeout_s, abort the rest) and stop."""
        super().stop(timeout_s)

    def stats(self) -> RolloutStats:
        return self.core.stats()

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
        busy = self.engine.has_work() or bool(self.core.held)
        self._receive(0.0 if busy else self.idle_wait_s)
        now = time.monotonic()
        self.core.tick(now, self.weights.get(now) if self.weights is not None else None)
        self._send()

    def _send(self) -> None:
        for identity, rid, msg in self.core.take_replies():
            self.server.reply(identity, rid, msg)

    def _receive(self, timeout: float, max_messages: int = 1000) -> None:
        for _ in range(max_messages):  # bounded: a flood must not starve decoding
            got = self.server.recv(timeout)
            if got is None:
                return
            timeout = 0.0
            identity, rid, msg = got
            self.core.on_message(identity, rid, msg, time.monotonic())
            self._send()

    # -- draining ----------------------------------------------------------------------
    def _drain(self) -> None:
        """Finish what runs (bounded), refuse new work, then abort what is left (the
        env-host continues those on a rollout holding the same version)."""
        deadline = time.monotonic() + self.drain_timeout_s
        self.core.refuse_held()
        self._send()
        while self.engine.has_work() and time.monotonic() < deadline:
            self._receive(0.0)
            self.core.tick(time.monotonic(), None)
            self._send()
        self._receive(0.0)  # what arrived meanwhile is refused now, not left to time out
        self.core.cut(list(self.core.clients), "rollout is draining")
        self._send()
