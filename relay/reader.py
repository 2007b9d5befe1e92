"""Rollout side of the weight plane: map the local relay's newest version, zero-copy.

The relay writes a version's manifest file only after every chunk was
verified (relay.shm), so whatever `newest()` reports is complete; `open()`
takes a shared flock on the data file (the relay frees only what it can lock
exclusively) and maps it read-only, so tensors are numpy views straight into
shared memory and the version cannot disappear while the view is open.

Which relay: the one named by ``relay_id``, else the relay registered on ``host``,
looked up in etcd (at most once a second, from whichever thread calls ``newest()``);
or, with ``shm_dir``, the store directory a caller already located: such a reader
never reads etcd, so a thread that must not wait on etcd (a rollout's engine thread)
can use it while another thread keeps track of the relay (daemons/rollout/relay_source.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import RelayMember, members_from
from rlfleet.common.control.records import RelayLayoutRequest
from rlfleet.common.control.store import Store
from rlfleet.relay.manifest import Manifest, digest, tensor_views
from rlfleet.relay.shm import object_stem, parse_stem


class WeightsUnavailable(LookupError):
    """No (such) complete version at the local relay."""


@dataclass(frozen=True)
class WeightsView:
    version: int
    tensors: dict[str, np.ndarray]   # read-only views into shared memory
    manifest: Manifest
    layout: int = 1
    rank: int = 0

    def verify(self) -> None:
        """Re-hash this copy against its manifest (the relay already did; this is for the paranoid)."""
        for i in range(self.manifest.n_chunks):
            start, end = self.manifest.chunk_range(i)
            self.manifest.verify_chunk(i, self._buf[start:end])

    _buf: memoryview = memoryview(b"")


class WeightReader:
    def __init__(self, store: Store, job: str, host: str, *, relay_id: str | None = None, layout: int = 1,
                 shm_dir: str | os.PathLike | None = None) -> None:
        if layout < 1:
            raise ValueError(f"layout (tensor-parallel degree) must be >= 1, got {layout}")
        self.store, self.keys, self.host = store, JobKeys(job), host
        self.relay_id, self.layout = relay_id, layout
        self._pinned = Path(shm_dir) if shm_dir is not None else None  # never looked up again
        self._dir: Path | None = None
        self._resolved_at = 0.0
        if layout > 1:
            # Ask the master to compute this layout for every version from now on.
            store.put(self.keys.relay_layout(layout),
                      RelayLayoutRequest(layout, host, round(time.time(), 3)).to_value())

    # ------------------------------------------------------------ locating
    def _relay_dir(self) -> Path | None:
        if self._pinned is not None:
            return self._pinned if self._pinned.is_dir() else None
        if self._dir is not None and self._dir.is_dir():
            return self._dir
        if time.monotonic() - self._resolved_at < 1.0:  # etcd at most once a second
            return None
        self._resolved_at = time.monotonic()
        found = None
        for m in members_from(self.keys, self.store.get_prefix(self.keys.role_members_prefix("relay"))):
            if (self.relay_id is None and m.host == self.host) or m.id == self.relay_id:
                found = RelayMember.of(m).shm_dir
                break
        self._dir = Path(found) if found else None
        return self._dir if self._dir is not None and self._dir.is_dir() else None

    @property
    def relay_dir(self) -> Path | None:
        return self._relay_dir()

    def versions(self) -> list[int]:
        d = self._relay_dir()
        if d is None:
            return []
        out = []
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.name.endswith(".json") and not e.name.startswith("."):
                        key = parse_stem(e.name)
                        if key is not None and key[1] == self.layout:
                            out.append(key[0])
        except FileNotFoundError:
            self._dir = None
        return sorted(out)

    def newest(self) -> int | None:
        """Newest complete, verified version held by the local relay (one directory scan)."""
        vs = self.versions()
        return vs[-1] if vs else None

    # -------------------------------------------------------------- mapping
    @contextlib.contextmanager
    def open(self, version: int | None = None, *, rank: int = 0) -> Iterator[WeightsView]:
        """Map a version read-only (the newest when None); holds it until the block ends."""
        if not 0 <= rank < self.layout:
            raise ValueError(f"rank {rank} outside layout tp{self.layout}")
        for _ in range(5):
            v = self.newest() if version is None else version
            if v is None:
                raise WeightsUnavailable(f"the relay on {self.host} holds no complete version yet")
            opened = self._try_open(v)
            if opened is not None:
                break
            if version is not None:
                raise WeightsUnavailable(f"version {version} tp{self.layout} is not (or no longer) held "
                                         f"by the relay on {self.host}; held: {self.versions()}")
        else:
            raise WeightsUnavailable(f"the relay on {self.host} kept freeing versions while opening")
        fd, mm, manifest = opened
        try:
            tensors = tensor_views(manifest, mm, rank if self.layout > 1 else None)
            view = WeightsView(v, tensors, manifest, self.layout, rank)
            object.__setattr__(view, "_buf", memoryview(mm))
            yield view
        finally:
            tensors = view = None  # type: ignore[assignment]
            # Unlock explicitly: mmap keeps a dup of the fd, so closing ours alone would
            # keep the lock as long as the mapping lives.
            fcntl.flock(fd, fcntl.LOCK_UN)
            try:
                mm.close()
            except BufferError:
                pass  # the caller kept an array; the mapping lives as long as it (bytes are never rewritten)
            os.close(fd)

    def _try_open(self, v: int) -> tuple[int, mmap.mmap, Manifest] | None:
        d = self._relay_dir()
        if d is None:
            return None
        stem = object_stem(v, self.layout)
        data, man = d / f"{stem}.data", d / f"{stem}.json"
        try:
            raw = man.read_bytes()
            fd = os.open(data, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            # Between reading the manifest and locking, the relay may have freed the version.
            if not man.exists() or os.stat(data).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError
            manifest = Manifest.loads(raw)
            size = max(1, manifest.total_bytes)
            if os.fstat(fd).st_size < size:
                raise FileNotFoundError
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            return fd, mm, manifest
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise


def checksum_of(view: WeightsView) -> str:
    """Digest of the whole mapped byte range (tests compare it with the publisher's data)."""
    return digest([view._buf], view.manifest.algo)
