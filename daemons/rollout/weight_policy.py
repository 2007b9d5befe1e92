"""When a rollout loads a newer weight version: the decision, with no sockets or engine.

Every generated segment must have exactly one version, so:

- The newest version is asked of the reader at most every ``check_every_s``
  (``check_due``): one directory scan of the relay's shared memory; at 0.25 s a
  fast trainer was two versions ahead before a rollout even noticed.
- A newer version is loaded only when no request is running, or when ``release()``
  was called: then the running requests are cut short first (answered with their
  partial tokens, tagged with the old version) and the load follows at once. A
  release stays in force while requests run, so one that comes just before the new
  version is seen still applies; it lapses once nothing is running.
- While a newer version is pending, new requests are held back so the batch can
  drain and the load can happen (``hold``); a held request is admitted under the
  current version after ``hold_max_s`` anyway (``admit``), so a steady stream of
  long requests delays an update but never stalls a request for long.
- A version that failed to load (``refused``) is skipped until a newer one appears.

The engine loop (loop.py) asks this object and does what it says; it is driven by
one thread, except ``release()``, which any thread may call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightAction:
    """What to do now: nothing (version None), or load ``version``, cutting the
    running requests short first when ``cut_running``."""

    version: int | None = None
    cut_running: bool = False


KEEP = WeightAction()


class WeightUpdatePolicy:
    def __init__(self, *, check_every_s: float = 0.05, hold_max_s: float = 2.0) -> None:
        self.check_every_s, self.hold_max_s = check_every_s, hold_max_s
        self.newest: int | None = None  # the newest version the reader reported
        self.failed_version: int | None = None
        self._next_check = 0.0
        self._release = threading.Event()

    # -- inputs ---------------------------------------------------------------------------
    def check_due(self, now: float) -> bool:
        """Whether to ask the reader for its newest version now (then it is not due
        again for check_every_s)."""
        if now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        return True

    def saw(self, newest: int | None) -> None:
        self.newest = newest

    def release(self) -> None:
        """Allow the next load even with running requests (thread-safe)."""
        self._release.set()

    @property
    def released(self) -> bool:
        return self._release.is_set()

    def refused(self, version: int) -> None:
        """The version could not be loaded: serve on, and skip it."""
        self.failed_version = version

    # -- decisions ------------------------------------------------------------------------
    def pending(self, serving: int) -> int | None:
        """The newer version waiting to be loaded, if any."""
        v = self.newest
        if v is None or v <= serving or v == self.failed_version:
            return None
        return v

    def decide(self, serving: int, running: bool) -> WeightAction:
        """Whether to load now, given the version served and whether requests run."""
        version = self.pending(serving)
        if version is None:
            if not running:
                self._release.clear()  # moot: nothing would be cut short
            return KEEP
        if running and not self._release.is_set():
            return KEEP  # let the batch drain; new requests are held meanwhile
        self._release.clear()
        return WeightAction(version, cut_running=running)

    def hold(self, serving: int) -> bool:
        """Whether a new request waits (a newer version is pending) instead of starting."""
        return self.pending(serving) is not None

    def admit(self, serving: int, held_since: float, now: float) -> bool:
        """Whether the oldest held request starts now under the version being served."""
        return self.pending(serving) is None or now - held_since >= self.hold_max_s
