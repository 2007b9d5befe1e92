"""systemd's service notification protocol (sd_notify(3)) without libsystemd.

Under a `Type=notify` unit systemd sets $NOTIFY_SOCKET to a unix datagram socket
(a path, or an abstract name written with a leading '@'); a notification is one
datagram of newline-separated KEY=VALUE lines ("READY=1\\nSTATUS=..."). With
`WatchdogSec=` it also sets $WATCHDOG_USEC (and $WATCHDOG_PID, the pid the
watchdog is meant for): the service must send WATCHDOG=1 more often than that or
be killed with SIGABRT and, with `Restart=on-failure`, started again.

Outside systemd the variable is unset and every call is a no-op, so a daemon
notifies unconditionally. Sending never blocks: the loop that pings the watchdog
must not hang on a busy systemd (its socket queues only net.unix.max_dgram_qlen
datagrams, 10 by default, from every service of the host). A notification that
cannot go out is dropped and logged when sending starts failing; the caller sees
False (the daemon resends READY=1 until it goes out, WATCHDOG=1 goes every cycle).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import MutableMapping

log = logging.getLogger("rlfleet.sd_notify")

ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# systemd reads one datagram into a PIPE_BUF-sized buffer (4096 bytes) and drops
# longer ones: a status line is cut to 900 characters (at most 3,600 bytes of UTF-8).
MAX_STATUS_CHARS = 900


class Notifier:
    """Sends notifications to `address` (None: does nothing)."""

    def __init__(self, address: str | None = None, watchdog_s: float | None = None) -> None:
        self.address = address
        # The watchdog timeout this process must beat; None when there is none for us.
        self.watchdog_s = watchdog_s
        self._sock: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> Notifier:
        """The notifier systemd set up for this process, taking the variables out of
        the environment (sd_notify's unset_environment): the subprocesses a daemon
        starts must not notify on its behalf (with NotifyAccess=main systemd would
        refuse them and say so in the journal every time)."""
        env = os.environ if environ is None else environ
        address, usec, owner = (env.pop(name, None) for name in ENV_VARS)
        watchdog_s = None
        if usec and (not owner or owner == str(os.getpid() if pid is None else pid)):
            try:
                watchdog_s = int(usec) / 1e6 if int(usec) > 0 else None
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not a number of microseconds", usec)
        return cls(address or None, watchdog_s)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send KEY=VALUE lines as one datagram; True if it went out."""
        if self.address is None or not lines:
            return False
        # '@name' is an abstract socket: a leading NUL byte on the wire.
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, target)
            self._failed = False
            return True
        except OSError as exc:  # BlockingIOError: systemd's queue is full
            if not self._failed:
                log.warning("cannot notify systemd at %s (%s): dropping %s", self.address, exc, lines[0],
                            extra={"event": "sd_notify"})
                self._failed = True
            return False

    # -- the messages rlfleet sends --------------------------------------------
    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *status_field(status))

    def status(self, text: str) -> bool:
        return self.notify(*status_field(text))

    def watchdog(self, status: str = "") -> bool:
        return self.notify("WATCHDOG=1", *status_field(status))

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets systemd >= 253 (Type=notify-reload) match the reload to
        # its request; older versions ignore it.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *status_field(status))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def status_field(text: str) -> tuple[str, ...]:
    """A STATUS= line: one line (a newline would start another field), cut to size."""
    if not text:
        return ()
    line = " ".join(text.split())
    if len(line) > MAX_STATUS_CHARS:
        line = line[:MAX_STATUS_CHARS - 1] + "…"
    return (f"STATUS={line}",)
