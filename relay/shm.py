"""The relay's weight store: one shared-memory segment per version and layout.

Files in one directory under /dev/shm (tmpfs), per object (version, layout)::

    v0000000012.tp1.data    the byte range, mmapped read-write by the relay
    v0000000012.tp1.json    the manifest: written (tmp + rename) only after every chunk
                            was verified, so its existence is what "complete" means

A rollout (relay.reader) maps the data file read-only after taking a shared
`flock` on it; the relay frees a version only after taking the exclusive lock
without blocking, so a version a reader holds is never freed under it, and a
reader that dies releases its lock with its process. Freed files are unlinked,
never rewritten, so even a reader that misuses a view after closing it sees
the old bytes, not a mix.

Keeps the newest `keep_versions` complete versions (all layouts of a version
together); older ones, and partial ones a newer complete version made
pointless, go when nobody holds them.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.relay.manifest import ChecksumMismatch, Manifest

log = logging.getLogger("rlfleet.relay")

MISSING, WRITING, PRESENT = 0, 1, 2


class RejectError(ValueError):
    """An offered version conflicts with what the store already holds."""


def object_stem(version: int, layout: int) -> str:
    return f"v{version:010d}.tp{layout}"


def parse_stem(name: str) -> tuple[int, int] | None:
    """'v0000000012.tp2.json' -> (12, 2)."""
    parts = name.split(".")
    if len(parts) < 3 or not parts[0].startswith("v") or not parts[1].startswith("tp"):
        return None
    try:
        return int(parts[0][1:]), int(parts[1][2:])
    except ValueError:
        return None


@dataclass(eq=False)
class StoredObject:
    manifest: Manifest
    data_path: Path
    fd: int
    mm: mmap.mmap | None
    state: bytearray
    n_present: int = 0
    complete: bool = False
    refs: int = 0               # in-process users (forwarders) that need the bytes to stay
    started: float = field(default_factory=time.monotonic)
    completed_at: float = 0.0
    completed_wall: float = 0.0  # time.time() at completion, comparable across processes (benchmark)

    @property
    def key(self) -> tuple[int, int]:
        return self.manifest.key

    def view(self, index: int) -> memoryview:
        start, end = self.manifest.chunk_range(index)
        assert self.mm is not None
        return memoryview(self.mm)[start:end]

    def first_missing(self) -> int:
        for i, s in enumerate(self.state):
            if s != PRESENT:
                return i
        return len(self.state)


def _claim_dir(wanted: Path) -> Path:
    """Lock `wanted` for this process (flock on `<dir>.lock`, released when it dies).

    A live relay with the same job and id on this machine (e.g. two test runs
    against different etcds) keeps its directory: this one gets `<dir>.<pid>`.
    Directories of dead relays (lock free) are wiped, so kill -9 leaks nothing.
    """
    wanted.parent.mkdir(parents=True, exist_ok=True)
    for stale in wanted.parent.glob(f"{wanted.name}.*.lock"):
        fd = os.open(stale, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(stale.with_suffix(""), ignore_errors=True)
            stale.unlink(missing_ok=True)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    for candidate in (wanted, wanted.with_name(f"{wanted.name}.{os.getpid()}")):
        fd = os.open(candidate.with_name(candidate.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            log.warning("store %s is in use by another live relay; using %s.%d", wanted, wanted, os.getpid())
            continue
        _DIR_LOCKS[str(candidate)] = fd  # held for the life of the process (or until close())
        return candidate
    raise RuntimeError(f"cannot lock a store directory for {wanted}")


_DIR_LOCKS: dict[str, int] = {}


class WeightStore:
    def __init__(self, directory: str | os.PathLike, keep_versions: int = 2) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.dir = _claim_dir(Path(directory))
        self.keep = keep_versions
        self.cond = threading.Condition(threading.RLock())
        self.objects: dict[tuple[int, int], StoredObject] = {}
        self.closed = False
        # Counters for status and metrics.
        self.chunks_received = 0
        self.bytes_received = 0
        self.corrupt_chunks = 0
        self.freed = 0
        # A relay (re)starts with an empty store: whatever a previous incarnation
        # left is unlinked (readers that still map it keep their copy).
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, mode=0o755)

    # ------------------------------------------------------------ receiving
    def begin(self, manifest: Manifest) -> tuple[StoredObject, list[int]]:
        """Start (or resume) receiving an object; returns it and the chunks still missing."""
        with self.cond:
            if self.closed:
                raise RejectError("store is closed")
            obj = self.objects.get(manifest.key)
            if obj is not None:
                if obj.manifest.checksum != manifest.checksum:
                    raise RejectError(
                        f"version {manifest.version} layout tp{manifest.layout} is already held with checksum "
                        f"{obj.manifest.checksum}; refusing different contents ({manifest.checksum}) "
                        "under the same version number")
                return obj, [i for i, s in enumerate(obj.state) if s == MISSING]
            stem = object_stem(*manifest.key)
            path = self.dir / f"{stem}.data"
            size = max(1, manifest.total_bytes)  # mmap refuses length 0
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            obj = StoredObject(manifest, path, fd, mm, bytearray(manifest.n_chunks))
            self.objects[manifest.key] = obj
            self.cond.notify_all()
            return obj, list(range(manifest.n_chunks))

    def claim(self, obj: StoredObject, index: int) -> bool:
        """True if the caller should write chunk `index` (nobody has it or is writing it)."""
        with self.cond:
            if obj.mm is None or obj.state[index] != MISSING:
                return False
            obj.state[index] = WRITING
            return True

    def commit(self, obj: StoredObject, index: int) -> None:
        """Verify a written chunk; on success it becomes visible to forwarders."""
        try:
            obj.manifest.verify_chunk(index, obj.view(index))
        except ChecksumMismatch:
            with self.cond:
                obj.state[index] = MISSING
                self.corrupt_chunks += 1
            raise
        with self.cond:
            obj.state[index] = PRESENT
            obj.n_present += 1
            self.chunks_received += 1
            start, end = obj.manifest.chunk_range(index)
            self.bytes_received += end - start
            if obj.n_present == obj.manifest.n_chunks:
                self._finalize(obj)
            self.cond.notify_all()

    def abandon(self, obj: StoredObject, index: int) -> None:
        """A writer failed mid-chunk (connection lost): the chunk is missing again."""
        with self.cond:
            if obj.state[index] == WRITING:
                obj.state[index] = MISSING
            self.cond.notify_all()

    def put_local(self, manifest: Manifest, fill: Any) -> StoredObject:
        """Create a complete object from local bytes (the master's resharded layouts)."""
        obj, missing = self.begin(manifest)
        for i in missing:
            if self.claim(obj, i):
                start, end = manifest.chunk_range(i)
                fill(obj.view(i), start, end)
                self.commit(obj, i)
        return obj

    def _finalize(self, obj: StoredObject) -> None:
        # Chunk digests were verified one by one and the manifest's root was
        # checked against them when it was parsed: the whole range is verified.
        stem = object_stem(*obj.key)
        tmp = self.dir / f".{stem}.json.tmp"
        tmp.write_bytes(obj.manifest.dumps())
        os.rename(tmp, self.dir / f"{stem}.json")
        obj.complete, obj.completed_at, obj.completed_wall = True, time.monotonic(), time.time()
        log.info("version %d tp%d complete (%d bytes, %d chunks, %.3fs)", obj.manifest.version,
                 obj.manifest.layout, obj.manifest.total_bytes, obj.manifest.n_chunks,
                 obj.completed_at - obj.started)

    # --------------------------------------------------------------- reading
    def wait_present(self, obj: StoredObject, index: int, timeout: float) -> bool:
        with self.cond:
            end = time.monotonic() + timeout
            while obj.state[index] != PRESENT and obj.mm is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return obj.state[index] == PRESENT

    def acquire(self, key: tuple[int, int]) -> StoredObject | None:
        with self.cond:
            obj = self.objects.get(key)
            if obj is None or obj.mm is None:
                return None
            obj.refs += 1
            return obj

    def release(self, obj: StoredObject) -> None:
        with self.cond:
            obj.refs -= 1
            self.cond.notify_all()

    def have(self) -> list[tuple[int, int, bool]]:
        with self.cond:
            return sorted((v, lay, o.complete) for (v, lay), o in self.objects.items() if o.mm is not None)

    def newest_complete(self, layout: int = 1) -> int | None:
        with self.cond:
            done = [v for (v, lay), o in self.objects.items() if lay == layout and o.complete and o.mm is not None]
            return max(done) if done else None

    def get(self, key: tuple[int, int]) -> StoredObject | None:
        with self.cond:
            return self.objects.get(key)

    # ------------------------------------------------------------- freeing
    def collect(self) -> list[tuple[int, int]]:
        """Free what is no longer kept; returns the keys freed."""
        with self.cond:
            complete_versions = sorted({v for (v, lay), o in self.objects.items() if o.complete and lay == 1})
            kept = set(complete_versions[-self.keep:])
            newest = complete_versions[-1] if complete_versions else -1
            freed = []
            for key, obj in list(self.objects.items()):
                version = key[0]
                if version in kept or obj.refs > 0 or WRITING in obj.state:
                    continue
                if not obj.complete and version > newest:
                    continue  # still arriving
                if obj.complete and version > newest:
                    continue  # a layout of a version whose full copy is not complete yet
                if self._try_free(obj):
                    del self.objects[key]
                    freed.append(key)
            if freed:
                self.freed += len(freed)
                self.cond.notify_all()
            return freed

    def _try_free(self, obj: StoredObject) -> bool:
        try:
            fcntl.flock(obj.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a local reader holds it
        stem = object_stem(*obj.key)
        # Manifest first: from here on no reader can start on this version.
        for p in (self.dir / f"{stem}.json", obj.data_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        try:
            if obj.mm is not None:
                obj.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere in-process; the mapping goes with it
        obj.mm = None
        os.close(obj.fd)  # also drops our exclusive lock
        log.info("freed version %d tp%d", *obj.key)
        return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for obj in self.objects.values():
                try:
                    if obj.mm is not None:
                        obj.mm.close()
                except BufferError:
                    pass
                obj.mm = None
                os.close(obj.fd)
            self.objects.clear()
            self.cond.notify_all()
        shutil.rmtree(self.dir, ignore_errors=True)
        fd = _DIR_LOCKS.pop(str(self.dir), None)
        if fd is not None:
            self.dir.with_name(self.dir.name + ".lock").unlink(missing_ok=True)
            os.close(fd)
