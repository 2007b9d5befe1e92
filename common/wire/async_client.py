"""The asyncio request client (split off common/wire/sockets.py when that passed 500 lines):
one DEALER whose file descriptor an event loop watches, for many concurrent requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

import zmq

from rlfleet.common.wire.messages import MAX_FRAME_BYTES, Message, encode
from rlfleet.common.wire.sockets import DEFAULT_HWM, CurveKeys, Expect, PeerTimeout, _Endpoint

log = logging.getLogger("rlfleet.sockets")

_WATCHDOG_S = 1.0  # how often the socket is read without a wake-up


class AsyncRequestClient(_Endpoint):
    """asyncio RequestClient: many concurrent requests from one event loop.

    A plain (not zmq.asyncio) DEALER whose file descriptor the loop watches: every
    wake-up reads all the replies that arrived and resolves the waiting futures by
    request id. zmq.asyncio cost a future, a poller registration and a callback per
    send and per receive; this costs one reader callback per batch of replies.

    ``start(msg, timeout_s)`` sends at once and returns (request id, future): the
    future gets the reply, or PeerTimeout at the deadline; ``discard(rid)`` when done
    with it. ``fail_all(exc)`` fails every request still waiting (the peer is gone).
    """

    def __init__(self, address: str | Sequence[str], *, expect: Expect = None,
                 ctx: zmq.Context | None = None, curve: CurveKeys | None = None,
                 hwm: int = DEFAULT_HWM, max_bytes: int = MAX_FRAME_BYTES,
                 name: str = "async-request-client") -> None:
        opts = dict(expect=expect, ctx=ctx, curve=curve, hwm=hwm, max_bytes=max_bytes, name=name)
        super().__init__(zmq.DEALER, address, False, opts)
        self._prefix = os.urandom(4).hex()
        self._seq = itertools.count()
        # request id (bytes, as on the wire) -> (its future, its deadline's timer)
        self._waiting: dict[bytes, tuple[asyncio.Future[Message], asyncio.TimerHandle]] = {}
        self._unsent: list[tuple[bytes, list[Any]]] = []  # no connected peer (or HWM) yet
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = self.sock.FD
        self._watchdog: asyncio.TimerHandle | None = None
        self.stale = 0
        self.late_reads = 0  # replies only the watchdog found (a lost wake-up; should stay 0)

    def start(self, msg: Message, timeout_s: float) -> tuple[bytes, asyncio.Future[Message]]:
        """Send msg now (or as soon as a server is connected, within timeout_s)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            loop.add_reader(self._fd, self._on_events)
            loop.call_soon(self._on_events)  # an edge that came before the reader existed
        if self._watchdog is None:
            self._watchdog = loop.call_later(_WATCHDOG_S, self._watch)
        rid = f"{self._prefix}-{next(self._seq)}".encode()
        fut: asyncio.Future[Message] = loop.create_future()
        self._waiting[rid] = (fut, loop.call_later(timeout_s, self._expire, rid, timeout_s))
        frames = [rid, *encode(msg)]
        if self._unsent or not self._send(frames):
            self._unsent.append((rid, frames))
            self._retry_later()
        return rid, fut

    def discard(self, rid: bytes) -> None:
        """Stop waiting for this request; a late reply is discarded (counted in stale)."""
        entry = self._waiting.pop(rid, None)
        if entry is not None:
            fut, timer = entry
            timer.cancel()
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: an outcome nobody awaited must not log

    def fail_all(self, exc: BaseException) -> None:
        for fut, _ in list(self._waiting.values()):
            if not fut.done():
                fut.set_exception(exc)

    async def request(self, msg: Message, timeout_s: float) -> Message:
        rid, fut = self.start(msg, timeout_s)
        try:
            return await fut
        finally:
            self.discard(rid)

    def _send(self, frames: list[Any]) -> bool:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            sent = True
        except zmq.Again:  # full, or no connected server (IMMEDIATE, several addresses)
            sent = False
        # A send, even a refused one, may consume the edge of the socket's (edge-
        # triggered) descriptor: replies already queued would then wait for the next
        # edge, which may never come. Read them now.
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._drain()
        return sent

    def _retry_later(self) -> None:
        if self._retry is None and self._loop is not None:
            self._retry = self._loop.call_later(0.005, self._send_unsent)

    def _send_unsent(self) -> None:
        self._retry = None
        while self._unsent:
            rid, frames = self._unsent[0]
            if rid in self._waiting and not self._send(frames):
                self._retry_later()
                return
            self._unsent.pop(0)

    def _watch(self) -> None:
        """Read the socket once a second while requests wait: should a wake-up of the
        edge-triggered descriptor ever be lost, a reply waits a second, not forever."""
        self._watchdog = None
        if self.sock.closed:
            return
        if self._drain():
            self.late_reads += 1
            log.warning("%s: replies found without a wake-up", self.name)
        if self._waiting and self._loop is not None:
            self._watchdog = self._loop.call_later(_WATCHDOG_S, self._watch)

    def _expire(self, rid: bytes, timeout_s: float) -> None:
        entry = self._waiting.get(rid)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(PeerTimeout(self.address, timeout_s))

    def _on_events(self) -> None:
        if self.sock.closed:
            return
        self._drain()
        if self._unsent:
            self._send_unsent()

    def _drain(self) -> int:
        """Read every reply queued; returns how many messages were read."""
        sock, n = self.sock, 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)  # replies are small: bytes beat Frames
            except zmq.Again:
                return n
            n += 1
            got = self._decode(frames)
            if got is None:
                continue
            entry = self._waiting.get(got[0].encode())
            if entry is None or entry[0].done():
                self.stale += 1
            else:
                entry[0].set_result(got[1])

    def close(self) -> None:
        for timer in (self._retry, self._watchdog):
            if timer is not None:
                timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):  # from the loop's own thread only
                self._loop.remove_reader(self._fd)
        for _, timer in self._waiting.values():
            timer.cancel()
        super().close()
