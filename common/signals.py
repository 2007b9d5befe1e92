"""Signals handled on a thread, never inside the signal handler.

A Python signal handler runs in the main thread between two bytecodes, possibly
while that thread holds the lock of the very threading.Event the handler wants to
set (inside Event.wait, or inside the handler of a signal that came just before).
Setting the Event then deadlocks the process: a daemon hung on shutdown this way when
two SIGTERMs arrived during a blocking etcd call. So the handlers do nothing; the
C-level handler writes each signal's number to a pipe (signal.set_wakeup_fd), and a
thread reads the pipe and calls the real callback as an ordinary thread would.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("rlfleet.signals")


def route_signals(callbacks: Mapping[int, Callable[[], None]]) -> None:
    """Call callbacks[signum]() on a dispatcher thread for each signal received.

    Call from the main thread, once per process (there is one wakeup fd).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a full pipe drops a byte rather than block the handler
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in callbacks:
        signal.signal(signum, _ignore)  # a Python handler must exist for the fd to be written

    def dispatch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            for signum in data:
                callback = callbacks.get(signum)
                if callback is None:
                    continue
                try:
                    callback()
                except Exception:  # noqa: BLE001 — the dispatcher must outlive a bad callback
                    log.exception("handling signal %d failed", signum)

    threading.Thread(target=dispatch, name="signals", daemon=True).start()


def _ignore(signum: int, frame: object) -> None:
    """The signal's work happens on the dispatcher thread (route_signals)."""
