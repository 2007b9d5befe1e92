"""At-least-once delivery to a peer role whose address can change (reward-host, trainer).

`Outbox` wraps a ReliableSender for one thread: it keeps every unacked message, and
when the peer set changes (a reward-host restarted on a new port, a new trainer
leader) it builds a sender for the new addresses and re-sends them all. Receivers
dedup by key, so re-sending is always safe. `OutboxThread` runs one in its own thread
for callers on other threads (the env-host's event loop).

Used by the env-host (Trajectory -> reward-host) and the reward-host (ScoredTrajectory
-> trainer).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from rlfleet.common.wire.messages import Message
from rlfleet.common.wire.reliable import ReliableSender

log = logging.getLogger("rlfleet.outbox")

Acked = tuple[str, bool, str]  # (key, ok, error)


class Outbox:
    """Unacked messages by key, sent to the current addresses. One thread only."""

    def __init__(self, name: str, *, resend_after_s: float = 2.0, max_backoff_s: float = 10.0) -> None:
        self.name = name
        self.resend_after_s, self.max_backoff_s = resend_after_s, max_backoff_s
        self.addresses: tuple[str, ...] = ()
        self._sender: ReliableSender | None = None
        self._unacked: dict[str, Message] = {}
        self.sent = 0
        self.acked_total = 0

    def set_addresses(self, addresses: Sequence[str]) -> bool:
        """Point at these peer addresses; True if that changed anything."""
        new = tuple(sorted(addresses))
        if new == self.addresses:
            return False
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self.addresses = new
        if new:
            self._sender = ReliableSender(list(new), resend_after_s=self.resend_after_s,
                                           max_backoff_s=self.max_backoff_s,
                                           max_pending=1 << 30, name=self.name)
            for key, msg in self._unacked.items():
                self._sender.send(key, msg)
        log.info("%s: peers now %s, %d message(s) re-sent", self.name, list(new) or "none",
                 len(self._unacked) if new else 0, extra={"event": "outbox_peers"})
        return True

    def send(self, key: str, msg: Message) -> None:
        self._unacked[key] = msg
        self.sent += 1
        if self._sender is not None:
            self._sender.send(key, msg)

    def poll(self, timeout: float = 0.0) -> list[Acked]:
        """Read acks (waiting up to timeout for the first) and resend what is due."""
        if self._sender is None:
            return []
        self._sender.poll(timeout)
        acked = self._sender.take_acked()
        for key, _, _ in acked:
            self._unacked.pop(key, None)
        self.acked_total += len(acked)
        return acked

    @property
    def sock(self) -> object | None:
        """The current socket (for a zmq.Poller), None without peers."""
        return None if self._sender is None else self._sender.sock

    def pending(self) -> int:
        return len(self._unacked)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


class OutboxThread(threading.Thread):
    """An Outbox on its own thread; `on_acked` is called (on this thread) with acked keys."""

    def __init__(self, name: str, on_acked: Callable[[list[Acked]], None], **outbox_kwargs: float) -> None:
        super().__init__(name=name, daemon=True)
        self.outbox = Outbox(name, **outbox_kwargs)
        self.on_acked = on_acked
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._halt = threading.Event()
        self.pending = 0  # approximate, for member_info

    def submit(self, key: str, msg: Message) -> None:
        self._inbox.put(("send", (key, msg)))

    def set_addresses(self, addresses: Sequence[str]) -> None:
        self._inbox.put(("peers", tuple(addresses)))

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._take_commands()
                acked = self.outbox.poll(0.02 if self.outbox.sock is not None else 0.0)
                if self.outbox.sock is None:
                    self._halt.wait(0.02)
                if acked:
                    try:
                        self.on_acked(acked)
                    except Exception:  # noqa: BLE001 — keep delivering; a restart re-sends, receivers dedup
                        log.exception("%s: ack handler failed", self.name)
                self.pending = self.outbox.pending()
        finally:
            self.outbox.close()

    def _take_commands(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "send":
                key, msg = arg  # type: ignore[misc]
                self.outbox.send(key, msg)
            else:
                self.outbox.set_addresses(arg)  # type: ignore[arg-type]
