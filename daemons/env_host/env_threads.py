"""Threads for blocking environment calls (see EnvThreads)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class EnvThreads:
    """Daemon threads for environment calls, reused, and grown so that every call has a
    thread of its own: a hung env holds its thread forever (counted in `hung`) but never
    delays another call. Reuse matters: starting a thread per call cost ~0.5 ms of the
    event loop's time under load, more than the env step itself."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.threads = 0
        self.hung = 0  # calls abandoned after the turn timeout (their threads are lost)

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self.threads += 1
            else:
                self._idle -= 1  # reserved for this call
        self._queue.put(call)
        if spawn:
            threading.Thread(target=self._work, name="env-call", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            call()  # never raises: _env_call's target catches everything
            with self._lock:
                self._idle += 1
