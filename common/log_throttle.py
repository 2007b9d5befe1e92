"""Rate limits for log lines that an input can repeat at its own rate (one per refused
item, one per failed reward): at most one line per key per interval, and the next line
of a key says how many of its lines were held back meanwhile. The exact totals belong
in a Prometheus counter beside the call; the log line is the example and the rate.

    errors = LogThrottle(interval_s=10.0)
    errors.warning(log, "reward_error", "reward of %s failed: %s", key, error,
                   extra={"event": "reward_error"})

A key's held-back count is reported by its next line only: a burst that stops leaves its
last count unreported (the counter has it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


class LogThrottle:
    def __init__(self, interval_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 1024) -> None:
        if interval_s <= 0:
            raise ValueError(f"LogThrottle interval_s must be > 0, got {interval_s}")
        self.interval_s, self.clock, self.max_keys = interval_s, clock, max_keys
        self._lock = threading.Lock()
        self._keys: dict[Hashable, list[float | int]] = {}  # key -> [last line's time, held back since]

    def admit(self, key: Hashable) -> int | None:
        """None: hold this line back; else it may be logged, and the number is how many
        lines of ``key`` were held back since its last one."""
        now = self.clock()
        with self._lock:
            state = self._keys.get(key)
            if state is not None and now - state[0] < self.interval_s:
                state[1] += 1
                return None
            held = int(state[1]) if state is not None else 0
            self._keys[key] = [now, 0]
            if len(self._keys) > self.max_keys:
                self._forget(now)
            return held

    def _forget(self, now: float) -> None:
        """Bound the memory when keys are many: drop keys quiet for an interval (their
        next line would be admitted anyway), else the oldest half."""
        quiet = [k for k, (t, _) in self._keys.items() if now - t >= self.interval_s]
        if len(quiet) < len(self._keys) // 2:
            quiet = sorted(self._keys, key=lambda k: self._keys[k][0])[:len(self._keys) // 2]
        for k in quiet:
            del self._keys[k]

    def log(self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args: Any,
            extra: dict[str, Any] | None = None) -> bool:
        """``logger.log(level, msg, *args)`` unless held back (False); an admitted line
        says how many were held back before it, in its text and as ``suppressed``."""
        held = self.admit(key)
        if held is None:
            return False
        if held:
            msg += " (%d more like this since the last such line, not logged)"
            args += (held,)
        logger.log(level, msg, *args, extra={**(extra or {}), "suppressed": held})
        return True

    def warning(self, logger: logging.Logger, key: Hashable, msg: str, *args: Any,
                extra: dict[str, Any] | None = None) -> bool:
        return self.log(logger, logging.WARNING, key, msg, *args, extra=extra)
