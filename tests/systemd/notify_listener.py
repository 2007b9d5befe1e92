"""The systemd side of sd_notify for tests: a unix datagram socket bound by the test
(a path, or an abstract name when `address` starts with '@'), read by the test itself
so that "every notification sent so far" is exactly what is queued in the socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity: two notifications may carry the same fields
class Notification:
    at: float  # monotonic time the test read it
    fields: dict[str, str]

    def __getitem__(self, key: str) -> str:
        return self.fields[key]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.fields.get(key, default)


@dataclass
class NotifyListener:
    address: str  # as $NOTIFY_SOCKET spells it
    received: list[Notification] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:] if self.address.startswith("@") else self.address)

    def close(self) -> None:
        self.sock.close()

    def read(self, timeout_s: float) -> list[Notification]:
        """What arrives within timeout_s (everything already queued, at least)."""
        new: list[Notification] = []
        deadline = time.monotonic() + timeout_s
        while True:
            self.sock.settimeout(max(0.0, deadline - time.monotonic()))  # 0: only what is queued
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, TimeoutError):
                break
            lines = data.decode().split("\n")
            new.append(Notification(time.monotonic(), dict(line.split("=", 1) for line in lines if line)))
        self.received += new
        return new

    def wait_for(self, what: str, pred: Callable[[Notification], bool], timeout_s: float = 30.0) -> Notification:
        """The first notification (old or new) that satisfies pred."""
        def first() -> Notification | None:
            return next((n for n in self.received if pred(n)), None)
        self.read_until(what, lambda: first() is not None, timeout_s)
        return first()

    def read_until(self, what: str, cond: Callable[[], object], timeout_s: float = 30.0) -> None:
        """Keep reading (the socket queues only a few datagrams) until cond() is true."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last notifications: "
                                     f"{[n.fields for n in self.received[-10:]]}")
            self.read(min(left, 0.1))

    def since(self, n: Notification) -> list[Notification]:
        return self.received[self.received.index(n) + 1:]
