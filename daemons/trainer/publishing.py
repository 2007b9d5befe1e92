"""Weight publishing off the training thread, newest version wins.

The training thread snapshots the weights (``learner.state_tensors()`` copies
them) and hands them over; a publisher thread pushes them to the master relay
through ``rlfleet.relay.publisher.WeightPublisher``. Training goes on at once:
it never waits for the relay, and a relay that is slow or absent costs the
trainer nothing but the copy. If a version is still being pushed when the next
one arrives, the waiting slot is overwritten: rollouts skip to the newest
version, and versions reach the relay in increasing order.

Only a confirmed leader publishes (``may_publish``): while an etcd outage leaves
leadership unconfirmed (docs/operations/failsafe.md) the newest version waits in the slot, and
goes out once leadership is confirmed; a superseded leader closes with it unsent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("rlfleet.trainer")

HOLD_POLL_S = 0.1  # how often a held version asks whether it may go out


class AsyncPublisher:
    def __init__(self, publisher: Any, name: str = "trainer-publish", *,
                 may_publish: Callable[[], bool] = lambda: True) -> None:
        self._publisher = publisher
        self._may_publish = may_publish
        self.held = 0  # times a version had to wait for leadership to be confirmed
        self._slot: tuple[int, Mapping[str, Any]] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self.published_version: int | None = None
        self.last_publish_s = 0.0
        self.skipped = 0  # versions replaced in the slot before they were pushed
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, version: int, tensors: Mapping[str, Any]) -> None:
        with self._cond:
            if self._slot is not None:
                self.skipped += 1
            self._slot = (version, tensors)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                holding = False
                while not self._closed and (self._slot is None or not self._may_publish()):
                    if self._slot is not None and not holding:
                        holding = True
                        self.held += 1
                        log.warning("holding version %d: leadership unconfirmed", self._slot[0],
                                    extra={"event": "publish_held"})
                    self._cond.wait(HOLD_POLL_S if self._slot is not None else None)
                if self._closed:
                    return
                assert self._slot is not None
                version, tensors = self._slot
                self._slot = None
            started = time.monotonic()
            try:
                self._publisher.publish(version, tensors)
                self.published_version = version
            except Exception as exc:  # noqa: BLE001 — the next version goes out anyway
                self.failures += 1
                log.error("publishing version %d failed: %s", version, exc,
                          extra={"event": "publish_error"})
            self.last_publish_s = time.monotonic() - started
            del tensors

    def close(self, timeout: float = 1.0) -> None:
        """Stop after the push in progress (waiting up to timeout for it)."""
        with self._cond:
            self._closed = True
            self._slot = None
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            close: Callable[[], None] | None = getattr(self._publisher, "close", None)
            if close is not None:
                close()
