"""A loop in a daemon thread of its own, stopped by an event: the shape shared by the
rollout's engine loop, the simulated host and the relay source."""

from __future__ import annotations

import threading


class LoopThread:
    """Runs ``_run`` (which returns once ``self._stop`` is set) in a daemon thread named
    ``name``; ``start``, ``stop`` and ``alive`` from any other thread."""

    stop_timeout_s = 10.0

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the loop to end and wait for it, at most ``timeout_s`` (``stop_timeout_s``)."""
        self._stop.set()
        self._thread.join(self.stop_timeout_s if timeout_s is None else timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        raise NotImplementedError
