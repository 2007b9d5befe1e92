"""Structured logs: one JSON object per line on stderr, so journald, `jq` and
the embedded supervisor can all read a daemon's log without a parser of ours.

A record reaches the stream as one os.write of its whole line, newline included
(``LineWriter``), never through Python's buffered text stream: a buffered stream that
hits a full disk keeps the unwritten tail and writes it later, after other lines,
which left torn lines in the logs. The guarantee: every line in the stream is whole;
a record the stream cannot take whole is dropped and counted
(``rlfleet_log_records_dropped_total{reason}``), and the next record that is written
is preceded by one line saying how many were dropped (``event: log_records_dropped``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import sys
import time

from prometheus_client import Counter

# Attributes every LogRecord has; anything else was passed via `extra=` and is kept.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

LOG_RECORDS_DROPPED = Counter("rlfleet_log_records_dropped_total",
                              "Log records not written because the stream could not take the "
                              "whole line, by reason (no_space, io_error)", ["reason"])


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, object] | None = None) -> None:
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def io_reason(exc: OSError) -> str:
    """no_space when the filesystem (or the quota) is full, io_error for any other error."""
    return "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io_error"


class LineWriter:
    """Writes whole lines to one file descriptor: each is in the stream whole or not at all.

    - A regular file (a run's ``logs/<id>.log``, which the supervisor opens O_APPEND and
      shares with the daemon's stdout and its children): Linux writes a regular file's
      bytes under the inode lock, so one write() is never interleaved with another
      appender's. A write to it is short only when the filesystem, the quota or
      RLIMIT_FSIZE had room for part of the line. Retrying the rest would fail the same
      way, or, if room came back meanwhile, append it after another writer's line; so
      the part written is cut back off (ftruncate to where the line began) and the line
      is dropped. The cut is made only while that part is still the file's tail; if
      another writer appended after it (it could not while the disk was full, so only if
      room came back in between) the fragment stays, ended by that writer's bytes.
    - A pipe, socket or terminal (journald's stream): a short write means the reader was
      slow or a signal came, and the rest is written in more writes, in order. Bytes
      given to a stream cannot be taken back: a line cut by an error there is ended
      with a newline when the stream still takes one, so the next line starts whole.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.append = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)

    def write(self, data: bytes) -> str | None:
        """Write ``data`` (whole lines); None when it was written, else why it was not
        (no_space, io_error) and nothing of it is left in a regular file."""
        try:
            n = os.write(self.fd, data)
        except OSError as exc:
            return io_reason(exc)
        if n == len(data):
            return None
        if self.regular:
            self._cut(n)
            return "no_space"
        return self._write_rest(memoryview(data)[n:])

    def _cut(self, n: int) -> None:
        try:
            # Just past our n bytes, O_APPEND or not: the offset moves only on a write
            # that wrote something, and none can succeed on the full disk after ours.
            end = os.lseek(self.fd, 0, os.SEEK_CUR)
            if os.fstat(self.fd).st_size == end:
                os.ftruncate(self.fd, end - n)
                if not self.append:
                    # The next write would land at `end`, past the new end of file,
                    # leaving a hole of NUL bytes. With O_APPEND the offset is left
                    # alone: processes sharing the open file share it, and moving it
                    # back could make another one's cut miss its own fragment.
                    os.lseek(self.fd, end - n, os.SEEK_SET)
        except OSError:
            pass  # the fragment stays: nothing else can be done about it here

    def _write_rest(self, rest: memoryview) -> str | None:
        while rest:
            try:
                rest = rest[os.write(self.fd, rest):]
            except OSError as exc:
                try:
                    os.write(self.fd, b"\n")
                except OSError:
                    pass
                return io_reason(exc)
        return None


class JsonLineHandler(logging.Handler):
    """A logging handler that formats each record as one JSON line and writes it with
    a ``LineWriter``; records the stream could not take are counted in ``dropped``."""

    def __init__(self, fd: int, static: dict[str, object] | None = None) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter(static))
        self.writer = LineWriter(fd)
        self.dropped: dict[str, int] = {}  # reason -> records dropped, since the start
        self._unreported = 0  # dropped since the last line written

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:  # a bad format string is a bug at the call site, reported as logging does
            self.handleError(record)
            return
        if self._unreported:
            line = self._dropped_line(record) + line  # one write: both lines or neither
        reason = self.writer.write(line)  # under the handler's lock (Handler.handle)
        if reason is None:
            self._unreported = 0
            return
        self._unreported += 1
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        LOG_RECORDS_DROPPED.labels(reason=reason).inc()

    def _dropped_line(self, record: logging.LogRecord) -> bytes:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.dropped.items()))
        notice = logging.makeLogRecord({
            "name": "rlfleet.logs", "levelno": logging.WARNING, "levelname": "WARNING",
            "created": record.created, "event": "log_records_dropped", "dropped": self._unreported,
            "msg": f"{self._unreported} log records dropped: the stream could not take them "
                   f"whole (since the start, by reason: {reasons})"})
        return (self.format(notice) + "\n").encode()


def setup_json_logging(level: str = "info", **static: object) -> None:
    """Route the root logger to stderr as JSON lines, tagged with `static` fields (role, id, job)."""
    sys.stderr.flush()  # anything printed before goes first, not after our lines
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stand-in stream (a test's capture): fd 2 is still stderr
        fd = 2
    handler = JsonLineHandler(fd, static)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc and urllib3 chatter is not ours to report at info level.
    for noisy in ("grpc", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
