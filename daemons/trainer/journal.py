"""The trainer's experience journal: the durable half of the experience buffer.

An append-only file of records; the in-memory state (which groups are pending,
trained, dropped) is always exactly what replaying the file gives, because the
live path and the replay path go through the same ``_apply``.

File format (little-endian)::

    record  = u32 length | u32 crc32(payload) | payload
    payload = msgpack [kind, ...]
      [1, header, body]                 a ScoredTrajectory, as common.wire.encode frames
                                        (every array inline, so exactly 2 frames)
      [2, version, [group_id, ...]]     these groups were trained by the step that made `version`
      [3, group_id, reason, detail]     this group was dropped (first reason wins)
      [4, [group_id, ...]]              these groups' training was lost (trained after the
                                        checkpoint we resumed from): pending again

Durability (fsync policy): every ``append_*`` / ``record_*`` call writes its
records, flushes and fsyncs the file before it returns. The trainer acks a
trajectory only after ``append_trajectories`` has returned, so an acked
trajectory survives kill -9 and power loss. Several records written by one
call share one fsync (a batch of received messages costs one disk sync).

A crash can tear only the last record: on open it is detected (short header,
short payload, or a CRC mismatch on the final record), logged and truncated.
A bad record followed by more data is not a torn write but corruption:
``JournalCorrupt`` names the offset, and nothing is truncated.

A full disk (docs/operations/disk-full.md): a write that fails (ENOSPC or any OSError) is cut back
out of the file and leaves the state unchanged; ``write_error`` says why until a write
succeeds again (one error line per outage, JOURNAL_BLOCKED 1 meanwhile). The callers
retry with ``until_written`` rather than going on without the record: the intake acks
nothing it could not journal (the senders resend), and the training loop neither
publishes nor checkpoints a step whose TRAINED record is not written.

One process owns a journal at a time (an exclusive ``flock``), so a standby
that becomes leader on the same machine cannot write while the old leader
still has it open.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.common.durable import fsync_path
from rlfleet.common.wire.messages import ScoredTrajectory, WireError, decode, encode

from .metrics_log import JOURNAL_BLOCKED, JOURNAL_WRITE_FAILURES, io_reason, member_id

log = logging.getLogger("rlfleet.trainer")

_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 256 * 1024 * 1024  # a length above this is garbage, not a record

TRAJECTORY, TRAINED, DROPPED, REOPENED = 1, 2, 3, 4
_NO_OOB = 1 << 62  # inline_max for encode(): every array inside the body frame


class JournalCorrupt(Exception):
    """A record in the middle of the journal is unreadable; the file is left as it is."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"{path}: corrupt record at byte {offset}: {reason}")
        self.path, self.offset, self.reason = path, offset, reason


class JournalLocked(Exception):
    """Another process holds this journal open."""


class JournalUnwritable(Exception):
    """Stopped while waiting for the journal to take a record the work depends on."""


RETRY_S = (0.5, 5.0)  # until_written's wait between tries: first, most (doubling)


def until_written(write: Callable[[], object], stop: threading.Event,
                  on_blocked: Callable[[str], None] = lambda why: None) -> bool:
    """Call ``write`` (a journal write) until it does not raise OSError; False when
    ``stop`` is set first. Waiting, not failing: a full disk is fixed by an operator
    freeing space, and a trainer that crashed and restarted instead would re-train
    from its checkpoint only to fail again. ``on_blocked(why)`` runs at each failure."""
    delay = RETRY_S[0]
    while True:
        try:
            write()
            return True
        except OSError as exc:
            on_blocked(f"{io_reason(exc)}: {exc}")
        if stop.wait(delay):
            return False
        delay = min(RETRY_S[1], delay * 2)


@dataclass
class JournalState:
    """What the journal says, rebuilt by replay and kept current by every append."""

    # group_id -> {trajectory_id: trajectory}; dict order = first arrival of the group
    pending: dict[str, dict[str, ScoredTrajectory]] = field(default_factory=dict)
    # group_id -> arrival sequence of its latest trajectory (orders complete groups FIFO;
    # kept for trained groups until compaction, so a reopened group keeps its place)
    last_arrival: dict[str, int] = field(default_factory=dict)
    trained: dict[str, int] = field(default_factory=dict)  # group_id -> version of its step
    # trajectories of trained groups whose version is not yet covered by a compaction:
    # needed to re-train them if we resume from a checkpoint older than their step
    trained_data: dict[str, dict[str, ScoredTrajectory]] = field(default_factory=dict)
    dropped: dict[str, tuple[str, str]] = field(default_factory=dict)  # group -> (reason, detail)
    max_version: int = 0  # highest version any TRAINED record names
    records: int = 0
    seq: int = 0

    def is_duplicate(self, st: ScoredTrajectory) -> bool:
        t = st.trajectory
        return (t.group_id in self.trained or t.group_id in self.dropped
                or t.trajectory_id in self.pending.get(t.group_id, ()))

    def conflict(self, st: ScoredTrajectory) -> str:
        """Why ``st`` cannot be the trajectory the journal holds under its id ("" when it
        is, or when none is held): an id completes its group once, and a resend is the
        same trajectory (its score may differ: a reward-host may score it again)."""
        t = st.trajectory
        held = self.pending.get(t.group_id, {}).get(t.trajectory_id)
        if held is None or (held.trajectory.turns == t.turns and held.trajectory.prompt_id == t.prompt_id):
            return ""
        return f"{t.trajectory_id} is already in group {t.group_id} with other turns"


class ExperienceJournal:
    """Open (replaying) or create the journal at ``path``.

    Thread-safe: the trainer's intake thread appends while its training thread
    records trained and dropped groups.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.state = JournalState()
        self.truncated_bytes = 0  # torn tail removed on open
        self.write_error = ""  # why the last write failed; "" once one succeeds again
        self._failing_since = 0.0
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._file = open(self.path, "a+b", buffering=0)  # unbuffered: _commit controls writes
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise JournalLocked(f"{self.path} is held by another process") from None
        if created:
            fsync_path(self.path.parent)
        try:
            self._replay()
        except BaseException:
            self.close()
            raise

    # -- reading --------------------------------------------------------------------
    def _replay(self) -> None:
        self._file.seek(0)
        data = self._file.read()
        offset = 0
        while offset < len(data):
            rest = len(data) - offset
            if rest < _HEADER.size:
                self._truncate(offset, f"{rest}-byte partial header")
                break
            length, crc = _HEADER.unpack_from(data, offset)
            end = offset + _HEADER.size + length
            if length > MAX_RECORD_BYTES or end > len(data):
                if length > MAX_RECORD_BYTES and end <= len(data):
                    raise JournalCorrupt(self.path, offset, f"length {length} > {MAX_RECORD_BYTES}")
                self._truncate(offset, f"record of {length} bytes, only {rest - _HEADER.size} present")
                break
            payload = data[offset + _HEADER.size:end]
            if zlib.crc32(payload) != crc:
                if end == len(data):
                    self._truncate(offset, "crc mismatch on the last record")
                    break
                raise JournalCorrupt(self.path, offset, "crc mismatch")
            try:
                self._apply(_parse(payload))
            except (ValueError, WireError, msgspec.DecodeError) as exc:
                raise JournalCorrupt(self.path, offset, f"undecodable record: {exc}") from None
            offset = end
        self._file.seek(0, os.SEEK_END)
        s = self.state
        if s.records:
            log.info("journal %s replayed: %d records, %d pending groups, %d trained, %d dropped, "
                     "max version %d", self.path, s.records, len(s.pending), len(s.trained),
                     len(s.dropped), s.max_version, extra={"event": "journal_replay"})

    def _truncate(self, offset: int, why: str) -> None:
        size = self._file.seek(0, os.SEEK_END)
        log.warning("journal %s: torn last record at byte %d (%s): truncated %d bytes",
                    self.path, offset, why, size - offset, extra={"event": "journal_torn"})
        self._file.truncate(offset)
        self._sync()
        self.truncated_bytes = size - offset

    # -- state transitions (shared by replay and the live path) ----------------------
    def _apply(self, rec: list[Any]) -> bool:
        """Apply one parsed record; False if it changes nothing (a duplicate)."""
        s = self.state
        kind = rec[0]
        if kind == TRAJECTORY:
            st: ScoredTrajectory = rec[1]
            if s.is_duplicate(st):
                return False
            t = st.trajectory
            s.pending.setdefault(t.group_id, {})[t.trajectory_id] = st
            s.seq += 1
            s.last_arrival[t.group_id] = s.seq
        elif kind == TRAINED:
            version, groups = rec[1], rec[2]
            for g in groups:
                if g in s.dropped:  # accounted already; the trainer never selects these
                    continue
                data = s.pending.pop(g, None)  # last_arrival kept: a reopened group keeps its place
                s.trained[g] = version
                if data is not None:
                    s.trained_data[g] = data
            s.max_version = max(s.max_version, version)
        elif kind == DROPPED:
            g, reason, detail = rec[1], rec[2], rec[3]
            if g in s.dropped or g in s.trained:
                return False
            s.pending.pop(g, None)
            s.last_arrival.pop(g, None)
            s.dropped[g] = (reason, detail)
        elif kind == REOPENED:
            for g in rec[1]:
                if g not in s.trained or g not in s.trained_data:
                    continue  # compacted: covered by a checkpoint, nothing to re-train
                del s.trained[g]
                s.pending[g] = s.trained_data.pop(g)
        else:
            raise ValueError(f"unknown record kind {kind!r}")
        s.records += 1
        return True

    # -- writing --------------------------------------------------------------------
    def append_trajectories(self, items: Iterable[ScoredTrajectory]) -> list[bool]:
        """Journal new trajectories (one fsync for all); True per item that was new.

        Duplicates (same trajectory_id, or a group already trained or dropped) are
        not written. When this returns, the new ones are on disk: ack them now.
        """
        with self._lock:
            out, recs, seen = [], [], set()
            for st in items:
                t = st.trajectory
                dup = self.state.is_duplicate(st) or (t.group_id, t.trajectory_id) in seen
                seen.add((t.group_id, t.trajectory_id))
                out.append(not dup)
                if not dup:
                    recs.append(([TRAJECTORY, st], _trajectory_payload(st)))
            self._commit(recs)
            return out

    def record_trained(self, version: int, group_ids: Sequence[str]) -> None:
        with self._lock:
            rec = [TRAINED, int(version), list(group_ids)]
            self._commit([(rec, msgspec.msgpack.encode(rec))])

    def record_dropped(self, drops: Iterable[tuple[str, str, str]]) -> int:
        """Drop groups, each (group_id, reason, detail); returns how many were new drops."""
        with self._lock:
            recs, seen = [], set()
            for g, reason, detail in drops:
                if g in self.state.dropped or g in self.state.trained or g in seen:
                    continue
                seen.add(g)
                rec = [DROPPED, g, reason, detail]
                recs.append((rec, msgspec.msgpack.encode(rec)))
            self._commit(recs)
            return len(recs)

    def reopen_trained_after(self, version: int) -> dict[int, list[str]]:
        """Groups trained after ``version`` (a restored checkpoint): pending again, durably.
        Returns them by the version whose step trained them, each batch in its order, so
        they can be trained again in their original batches (resume.py)."""
        with self._lock:
            batches: dict[int, list[str]] = {}
            for g, v in self.state.trained.items():
                if v > version and g in self.state.trained_data:
                    batches.setdefault(v, []).append(g)
            groups = [g for v in sorted(batches) for g in batches[v]]
            if groups:
                rec = [REOPENED, groups]
                self._commit([(rec, msgspec.msgpack.encode(rec))])
            return dict(sorted(batches.items()))

    def _commit(self, recs: list[tuple[list[Any], bytes]]) -> None:
        """Write records, fsync, then apply them to the state. If the write fails
        (disk full), the file is cut back to where it was and the state is unchanged,
        so a half-written record never sits in front of later ones."""
        if not recs:
            return
        blob = b"".join(_frame(payload) for _, payload in recs)
        start = self._file.seek(0, os.SEEK_END)
        try:
            view = memoryview(blob)
            while view:
                view = view[self._file.write(view):]
            self._sync()
        except OSError as exc:
            self._file.truncate(start)
            self._write_failed(exc, len(blob))
            raise
        for rec, _ in recs:
            self._apply(rec)
        if self.write_error:
            log.info("journal %s written again after %.1f s", self.path,
                     time.monotonic() - self._failing_since, extra={"event": "journal_ok"})
            self.write_error = ""
            JOURNAL_BLOCKED.labels(id=member_id()).set(0)

    def _write_failed(self, exc: OSError, size: int) -> None:
        reason = io_reason(exc)
        JOURNAL_WRITE_FAILURES.labels(id=member_id(), reason=reason).inc()
        if not self.write_error:  # one line per outage; the callers retry every few seconds
            self._failing_since = time.monotonic()
            JOURNAL_BLOCKED.labels(id=member_id()).set(1)
            log.error("journal %s: a %d-byte write failed (%s: %s), %d bytes free: nothing is "
                      "acked or trained until it can be written (docs/operations/disk-full.md)", self.path,
                      size, reason, exc, _free_bytes(self.path.parent),
                      extra={"event": "journal_error", "reason": reason})
        self.write_error = f"journal: {reason}: {exc}"[:300]

    def compact(self, version: int) -> int:
        """Rewrite the file without the trajectories of groups trained at or before
        ``version`` (their weights are in a checkpoint) or dropped; their ids stay, as
        small TRAINED / DROPPED records, so late duplicates are still recognised.
        Returns the bytes saved. Atomic: a new file is written, fsynced, renamed.
        """
        with self._lock:
            s = self.state
            before = self._file.seek(0, os.SEEK_END)
            tmp = self.path.with_name(self.path.name + ".compact")
            by_version: dict[int, list[str]] = {}
            for g, v in s.trained.items():
                by_version.setdefault(v, []).append(g)
            try:
                self._write_compacted(tmp, version, by_version)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk: the space it took is needed
                raise
            os.replace(tmp, self.path)
            fsync_path(self.path.parent)
            # The lock was on the old inode: take it on the new file before letting go.
            new = open(self.path, "a+b", buffering=0)
            fcntl.flock(new.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._file.close()
            self._file = new
            for g, v in list(s.trained.items()):
                if v <= version:
                    s.trained_data.pop(g, None)
                    s.last_arrival.pop(g, None)
            after = self._file.seek(0, os.SEEK_END)
            return before - after

    def _write_compacted(self, tmp: Path, version: int, by_version: dict[int, list[str]]) -> None:
        s = self.state
        with open(tmp, "wb") as out:
            for g, (reason, detail) in s.dropped.items():
                out.write(_frame(msgspec.msgpack.encode([DROPPED, g, reason, detail])))
            for v in sorted(by_version):
                keep = [g for g in by_version[v] if v > version and g in s.trained_data]
                for g in keep:  # still needed if we resume from an older checkpoint
                    for st in s.trained_data[g].values():
                        out.write(_frame(_trajectory_payload(st)))
                out.write(_frame(msgspec.msgpack.encode([TRAINED, v, by_version[v]])))
            for g in sorted(s.pending, key=lambda g: s.last_arrival[g]):
                for st in s.pending[g].values():
                    out.write(_frame(_trajectory_payload(st)))
            out.flush()
            os.fsync(out.fileno())

    def _sync(self) -> None:
        if self.fsync:
            os.fsync(self._file.fileno())

    # -- queries --------------------------------------------------------------------
    def complete_groups(self, group_size: int) -> list[str]:
        """Pending groups holding group_size trajectories, oldest completion first."""
        with self._lock:
            s = self.state
            full = [g for g, ts in s.pending.items() if len(ts) >= group_size]
            return sorted(full, key=lambda g: s.last_arrival[g])

    def group_sizes(self, groups: Iterable[str] | None = None) -> dict[str, int]:
        """Pending group -> how many trajectories it holds (only ``groups`` when given:
        the intake asks about the groups arriving, not about every pending one)."""
        with self._lock:
            pending = self.state.pending
            if groups is None:
                return {g: len(ts) for g, ts in pending.items()}
            return {g: len(pending[g]) for g in groups if g in pending}

    def duplicates(self, items: Sequence[ScoredTrajectory]) -> list[bool | str]:
        """Per item: False (new), True (held already: a resend), or why it conflicts
        with the trajectory held under its id (JournalState.conflict)."""
        with self._lock:
            return [self.state.conflict(st) or self.state.is_duplicate(st) for st in items]

    def summary(self) -> dict[str, Any]:
        """Accounting totals: groups dropped by reason, trained, pending."""
        with self._lock:
            s = self.state
            dropped: dict[str, int] = {}
            for reason, _ in s.dropped.values():
                dropped[reason] = dropped.get(reason, 0) + 1
            return {"dropped": dict(sorted(dropped.items())), "trained_groups": len(s.trained),
                    "pending_groups": len(s.pending)}

    def group(self, group_id: str) -> list[ScoredTrajectory]:
        with self._lock:
            return list(self.state.pending.get(group_id, {}).values())

    def size_bytes(self) -> int:
        with self._lock:
            return self._file.seek(0, os.SEEK_END)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()  # closing releases the flock

    def __enter__(self) -> ExperienceJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return -1


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _trajectory_payload(st: ScoredTrajectory) -> bytes:
    header, body, *_ = encode(st, inline_max=_NO_OOB)
    return msgspec.msgpack.encode([TRAJECTORY, bytes(header), bytes(body)])


def _parse(payload: bytes) -> list[Any]:
    rec = msgspec.msgpack.decode(payload)
    if not isinstance(rec, list) or not rec:
        raise ValueError("record is not a non-empty list")
    kind = rec[0]
    if kind == TRAJECTORY and len(rec) == 3:
        return [TRAJECTORY, decode([rec[1], rec[2]], ScoredTrajectory)]
    if kind == TRAINED and len(rec) == 3 and type(rec[1]) is int and isinstance(rec[2], list):
        return rec
    if kind == DROPPED and len(rec) == 4 and all(isinstance(x, str) for x in rec[1:]):
        return rec
    if kind == REOPENED and len(rec) == 2 and isinstance(rec[1], list):
        return rec
    raise ValueError(f"bad record of kind {kind!r} with {len(rec)} fields")

