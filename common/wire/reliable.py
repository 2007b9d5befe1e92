"""At-least-once delivery keyed by an id (e.g. a trajectory id), for data that must not
be lost: ReliableSender / ReliableReceiver over DEALER / ROUTER (not PUSH / PULL, which
cannot carry the Ack back). Framing and rejection rules as in sockets.py.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from rlfleet.common.log_throttle import LogThrottle
from rlfleet.common.wire.messages import MAX_FRAME_BYTES, Ack, Message, encode
from rlfleet.common.wire.sockets import DEFAULT_HWM, CurveKeys, Expect, PeerTimeout, _deadline, _Endpoint, log

__all__ = ["ReliableReceiver", "ReliableSender"]


@dataclass
class _Pending:
    frames: list[Any]
    attempts: int = 0
    due: float = 0.0


FAILED_KEPT = 1000  # refused ids a ReliableSender remembers in ``failed``
REFUSED_LOG_EVERY_S = 10.0  # one "refused by receiver" line per sender and reason kind this often


class ReliableSender(_Endpoint):
    """At-least-once sender: every message stays in an in-memory outbox until acked.

    Call ``poll()`` regularly (it reads acks and resends what is due); resends back
    off from resend_after_s doubling up to max_backoff_s. The outbox dies with the
    process: the caller's own journal covers sender restarts.
    """

    def __init__(self, address: str | Sequence[str], *, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None, resend_after_s: float = 2.0,
                 max_backoff_s: float = 30.0, max_pending: int = 10_000, hwm: int = DEFAULT_HWM,
                 max_bytes: int = MAX_FRAME_BYTES, name: str = "reliable-sender") -> None:
        opts = dict(expect=Ack, ctx=ctx, curve=curve, hwm=hwm, max_bytes=max_bytes, name=name)
        super().__init__(zmq.DEALER, address, False, opts)
        self.resend_after_s = resend_after_s
        self.max_backoff_s = max_backoff_s
        self.max_pending = max_pending
        self._outbox: dict[str, _Pending] = {}
        self._due: list[tuple[float, int, str]] = []  # heap; stale entries skipped lazily
        self._tiebreak = itertools.count()
        self._blocked_until = 0.0  # socket not writable: don't spin retrying until then
        # (id, error) the receiver refused for good: the newest FAILED_KEPT (a long run's
        # refusals must not grow a daemon's memory; each is logged and counted as it comes)
        self.failed: list[tuple[str, str]] = []
        self._refused_log = LogThrottle(REFUSED_LOG_EVERY_S)
        self._acked: list[tuple[str, bool, str]] = []  # drained by take_acked()
        self.resends = 0

    def send(self, key: str, msg: Message, timeout_s: float = 10.0) -> None:
        """Queue msg under key and try to send it now. Re-sending a pending key replaces it.

        Blocks (processing acks) while the outbox is full; PeerTimeout after timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while key not in self._outbox and len(self._outbox) >= self.max_pending:
            if time.monotonic() >= deadline:
                raise PeerTimeout(self.address, timeout_s, "acknowledgements")
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        self._outbox[key] = _Pending([key.encode(), *encode(msg)])
        self._schedule(key, time.monotonic())
        self._send_due()

    def pending(self) -> int:
        return len(self._outbox)

    def take_acked(self) -> list[tuple[str, bool, str]]:
        """(key, ok, error) of every message acknowledged since the last call.

        Callers that journal delivery (the env-host) need to know *which* keys
        are done, not only how many."""
        acked, self._acked = self._acked, []
        return acked

    def poll(self, timeout: float = 0.0) -> int:
        """Read acks (waiting up to timeout for the first), resend what is due.

        Returns how many ids were acknowledged.
        """
        self._send_due()
        acked = 0
        deadline = _deadline(min(timeout, self._next_due_in()))
        while (frames := self._recv_frames(deadline)) is not None:
            got = self._decode(frames, with_id=False)
            if got is not None:
                acked += self._on_ack(got[1])  # type: ignore[arg-type]
            deadline = _deadline(0.0)
        self._send_due()
        return acked

    def flush(self, timeout_s: float) -> bool:
        """Poll until every pending message is acked; False if some remain at timeout."""
        deadline = time.monotonic() + timeout_s
        while self._outbox and (left := deadline - time.monotonic()) > 0:
            self.poll(min(left, 0.1))
        return not self._outbox

    def _on_ack(self, ack: Ack) -> int:
        n = 0
        for key in ack.ids:
            if self._outbox.pop(key, None) is None:
                continue  # duplicate ack, or for a message we already gave up on
            n += 1
            self._acked.append((key, ack.ok, ack.error))
            if not ack.ok:
                self.failed.append((key, ack.error))
                if len(self.failed) > FAILED_KEPT:
                    del self.failed[:len(self.failed) - FAILED_KEPT]
                # one line per kind of refusal ("invalid", "identity", ...) and interval: a
                # peer refusing a flood must not flood this log
                self._refused_log.warning(log, ack.error.split(":", 1)[0], "%s: %s refused by receiver: %s",
                                          self.name, key, ack.error, extra={"event": "refused"})
        return n

    def _schedule(self, key: str, due: float) -> None:
        self._outbox[key].due = due
        heapq.heappush(self._due, (due, next(self._tiebreak), key))

    def _next_due_in(self) -> float:
        while self._due and self._is_stale(self._due[0]):
            heapq.heappop(self._due)
        if not self._due:
            return math.inf
        return max(0.0, self._due[0][0] - time.monotonic(), self._blocked_until - time.monotonic())

    def _is_stale(self, item: tuple[float, int, str]) -> bool:
        p = self._outbox.get(item[2])
        return p is None or p.due != item[0]

    def _send_due(self) -> None:
        now = time.monotonic()
        if now < self._blocked_until:
            return
        while self._due and self._due[0][0] <= now:
            item = self._due[0]
            if self._is_stale(item):
                heapq.heappop(self._due)
                continue
            p = self._outbox[item[2]]
            try:
                self.sock.send_multipart(p.frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no receiver connected, or it is full: retry a bit later
                self._blocked_until = now + min(0.05, self.resend_after_s)
                return
            heapq.heappop(self._due)
            if p.attempts:
                self.resends += 1
            p.attempts += 1
            backoff = min(self.max_backoff_s, self.resend_after_s * 2 ** (p.attempts - 1))
            self._schedule(item[2], now + backoff * random.uniform(0.9, 1.1))


class ReliableReceiver(_Endpoint):
    """Receiving side of ReliableSender. Duplicates happen: handle messages
    idempotently by id, and ``ack`` only once the message is safe (e.g. journaled).
    An id that is never acked is resent forever: refuse bad ones with ok=False.
    """

    def __init__(self, address: str, *, expect: Expect = None, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None, hwm: int = DEFAULT_HWM,
                 max_bytes: int = MAX_FRAME_BYTES, name: str = "reliable-receiver", edge: str = "") -> None:
        opts = dict(expect=expect, ctx=ctx, curve=curve, hwm=hwm, max_bytes=max_bytes, name=name, edge=edge)
        super().__init__(zmq.ROUTER, address, True, opts)
        self._senders: dict[str, bytes] = {}  # id -> identity of the sender to ack

    def recv(self, timeout: float | None = None) -> tuple[str, Message] | None:
        """Next valid (id, msg); None on timeout."""
        deadline = _deadline(timeout)
        while (frames := self._recv_frames(deadline)) is not None:
            got = self._decode(frames[1:], peer=frames[0].bytes)
            if got is not None:
                self._senders[got[0]] = frames[0].bytes
                return got
        return None

    def _refuse(self, peer: bytes, rid: str, msg: Message, why: str) -> None:
        # Refused for good: a message that is never data would otherwise be resent forever.
        if not self._send_routed([peer, *encode(Ack(ids=[rid], ok=False, error=f"rejected: {why}"))]):
            log.info("%s: refusal of %s dropped: sender gone", self.name, rid)

    def drain(self, timeout: float = 0.0,
              max_n: int | None = None) -> Iterator[tuple[str, Message]]:
        """Yield messages: waits up to timeout for the first, then takes what is queued."""
        n = 0
        while max_n is None or n < max_n:
            got = self.recv(timeout if n == 0 else 0.0)
            if got is None:
                return
            n += 1
            yield got

    def ack(self, ids: Iterable[str], ok: bool = True, error: str = "") -> None:
        """Acknowledge ids to whichever sender delivered them. A lost ack is harmless:
        the sender resends, and the id is acked again."""
        by_sender: dict[bytes, list[str]] = {}
        for key in ids:
            identity = self._senders.pop(key, None)
            if identity is not None:
                by_sender.setdefault(identity, []).append(key)
        for identity, keys in by_sender.items():
            if not self._send_routed([identity, *encode(Ack(ids=keys, ok=ok, error=error))]):
                log.info("%s: ack of %d id(s) dropped: sender gone", self.name, len(keys))
