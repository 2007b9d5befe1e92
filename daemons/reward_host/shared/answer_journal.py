"""The shared reward service's answers on disk, so a kill -9 does not score again what it
had answered (shared_service.py; ``[service] answers_journal``).

One JSON line per answer: ``{"tenant": ..., "id": ..., "status": 200|422, "body": "..."}``,
appended and fsynced before the answer is handed to its caller, so any answer a caller
saw is found after a restart. The service reads it back at start, keeps the newest
``keep`` answers (as its memory record does) and rewrites the file with only those; while
running it rewrites again whenever the file holds ``keep`` lines more than it keeps, so
the file stays under about 2 x ``keep`` lines.

A torn last line (the kill came mid-write) or any line that does not read is skipped with
a warning: the record is a cache of answers, and a trajectory whose answer is lost is
scored again, as without a journal. An exclusive lock keeps a second service off the
same file (two writers would interleave lines and each forget the other's answers).
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from rlfleet.common.durable import fsync_path

log = logging.getLogger("rlfleet.reward_service")

Ident = tuple[str, str]  # (tenant, trajectory id)
Entry = tuple[int, bytes]  # (HTTP status, body)


class JournalUnusable(Exception):
    """The journal cannot be opened: another service holds it, or the OS refused."""


class AnswerJournal:
    def __init__(self, path: str | os.PathLike[str], keep: int) -> None:
        self.path = Path(path)
        self.keep = keep
        self.skipped = 0
        self._file: BinaryIO | None = None
        self._lines = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115 — held for life
        except OSError as exc:
            raise JournalUnusable(f"answers_journal {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise JournalUnusable(f"answers_journal {self.path}: in use by another reward service") from None
        try:
            self.loaded = self._read()  # the newest ``keep`` answers, oldest first
            self.rewrite(self.loaded.items())  # opens the file for appending
        except OSError as exc:
            self._lock.close()
            raise JournalUnusable(f"answers_journal {self.path}: {exc.strerror or exc}") from None

    def append(self, entries: list[tuple[Ident, Entry]]) -> None:
        """Write and fsync ``entries`` (one write); the caller answers only after this."""
        if entries:
            assert self._file is not None
            self._file.write(b"".join(_line(ident, entry) for ident, entry in entries))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._lines += len(entries)

    @property
    def needs_rewrite(self) -> bool:
        """True once the file holds ``keep`` lines more than the record keeps."""
        return self._lines >= 2 * self.keep

    def rewrite(self, entries: Iterable[tuple[Ident, Entry]]) -> None:
        """Replace the file by ``entries`` (the record as kept now), atomically."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        lines = [_line(ident, entry) for ident, entry in entries]
        with open(tmp, "wb") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
        if self._file is not None:
            self._file.close()
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._lines = len(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._lock.close()

    def _read(self) -> collections.OrderedDict[Ident, Entry]:
        answers: collections.OrderedDict[Ident, Entry] = collections.OrderedDict()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return answers
        for number, raw in enumerate(data.splitlines(), 1):
            try:
                doc = json.loads(raw)
                ident = (doc["tenant"], doc["id"])
                entry = (doc["status"], doc["body"].encode())
                if not (all(isinstance(x, str) for x in ident) and doc["status"] in (200, 422)):
                    raise ValueError("wrong types")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.skipped += 1
                if self.skipped <= 5:
                    log.warning("answers_journal %s: line %d skipped (%s: %s); its trajectory is "
                                "scored again if asked", self.path, number, type(exc).__name__, exc)
                continue
            answers[ident] = entry
            answers.move_to_end(ident)
        if self.skipped > 5:
            log.warning("answers_journal %s: %d lines skipped in all", self.path, self.skipped)
        while len(answers) > self.keep:
            answers.popitem(last=False)
        return answers


def _line(ident: Ident, entry: Entry) -> bytes:
    return json.dumps({"tenant": ident[0], "id": ident[1], "status": entry[0],
                       "body": entry[1].decode()}, separators=(",", ":")).encode() + b"\n"
