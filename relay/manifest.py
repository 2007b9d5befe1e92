"""What a weight version is on the wire and in shared memory: the manifest.

A version (in one layout) is one flat byte range: every tensor at a 64-byte
aligned offset (so numpy views into shared memory are aligned), zero padding
between them. The range is cut into fixed-size chunks; each chunk has its own
digest, and the whole version's `checksum` is the digest of the concatenated
chunk digests (a one-level Merkle root: verifying every chunk against the
manifest and the manifest against the root verifies the whole byte range
without a second pass over it).

Digest: xxh3-64 (~27 GB/s on one core here) where `xxhash` imports, else
zlib's crc32 (~4 GB/s); the algorithm is recorded in the manifest, so a relay
always verifies with the algorithm the version was published with.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

FORMAT = 1
ALIGN = 64
DEFAULT_ALGO = "xxh3_64" if xxhash is not None else "crc32"
_ZEROS = memoryview(bytes(ALIGN))


class ManifestError(ValueError):
    """A manifest or a tensor set that cannot describe a valid version."""


class ChecksumMismatch(ValueError):
    """Bytes that do not match the digest the manifest records for them."""


# ------------------------------------------------------------------ digests
class _Digest:
    def __init__(self, algo: str) -> None:
        if algo == "xxh3_64":
            if xxhash is None:
                raise ManifestError("version uses xxh3_64 but the xxhash package is not installed here")
            self._h: Any = xxhash.xxh3_64()
            self._crc = None
        elif algo == "crc32":
            self._h, self._crc = None, 0
        else:
            raise ManifestError(f"unknown checksum algorithm {algo!r} (expected 'xxh3_64' or 'crc32')")

    def update(self, data: Any) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


def digest(pieces: Iterable[Any], algo: str = DEFAULT_ALGO) -> str:
    h = _Digest(algo)
    for p in pieces:
        h.update(p)
    return h.hexdigest()


def root_checksum(chunk_digests: Sequence[str], total_bytes: int, algo: str) -> str:
    """The whole version's checksum: digest over the chunk digests and the size."""
    return digest([f"{total_bytes}:".encode(), ",".join(chunk_digests).encode()], algo)


# ----------------------------------------------------------------- manifest
@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str          # numpy dtype.str, e.g. "<f4"
    shape: tuple[int, ...]
    offset: int         # bytes from the start of the version's byte range
    nbytes: int
    rank: int = 0       # shard rank in a sharded layout (0 in the full layout)
    dtype_name: str = ""  # dtype.name, for dtypes whose .str is only "<V2" (e.g. bfloat16)

    def np_dtype(self) -> np.dtype:
        if self.dtype_name and self.dtype.lstrip("<|=").startswith("V"):
            try:
                import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; rlfleet[ml])
            except ImportError:  # a relay without it moves the bytes all the same (void of the same size)
                pass
            try:
                return np.dtype(self.dtype_name)
            except TypeError:
                pass
        return np.dtype(self.dtype)


@dataclass(frozen=True)
class Manifest:
    version: int
    layout: int                 # tensor-parallel degree of this copy; 1 = unsharded
    total_bytes: int
    chunk_bytes: int
    algo: str
    chunks: tuple[str, ...]     # per-chunk digests
    checksum: str               # root over `chunks`
    tensors: tuple[TensorEntry, ...]
    source_checksum: str = ""   # for a sharded layout: checksum of the full version it came from
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return (self.version, self.layout)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """[start, end) bytes of chunk `index`."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": self.version, "layout": self.layout,
            "total_bytes": self.total_bytes, "chunk_bytes": self.chunk_bytes, "algo": self.algo,
            "chunks": list(self.chunks), "checksum": self.checksum,
            "source_checksum": self.source_checksum, "extra": self.extra,
            "tensors": [{"name": t.name, "dtype": t.dtype, "dtype_name": t.dtype_name, "shape": list(t.shape),
                         "offset": t.offset, "nbytes": t.nbytes, "rank": t.rank} for t in self.tensors],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Parse and check a manifest from an untrusted peer: every inconsistency is named."""
        if not isinstance(d, dict):
            raise ManifestError(f"manifest must be an object, got {type(d).__name__}")
        try:
            if d.get("format") != FORMAT:
                raise ManifestError(f"manifest format {d.get('format')!r} not supported (expected {FORMAT})")
            tensors = tuple(TensorEntry(str(t["name"]), str(t["dtype"]), tuple(int(s) for s in t["shape"]),
                                        int(t["offset"]), int(t["nbytes"]), int(t.get("rank", 0)),
                                        str(t.get("dtype_name", ""))) for t in d["tensors"])
            m = cls(int(d["version"]), int(d["layout"]), int(d["total_bytes"]), int(d["chunk_bytes"]),
                    str(d["algo"]), tuple(str(c) for c in d["chunks"]), str(d["checksum"]), tensors,
                    str(d.get("source_checksum", "")), dict(d.get("extra") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"malformed manifest: {exc!r}") from None
        m.validate()
        return m

    @classmethod
    def loads(cls, raw: bytes | str) -> Manifest:
        try:
            return cls.from_json(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None

    def validate(self) -> None:
        if self.version < 0:
            raise ManifestError(f"version must be >= 0, got {self.version}")
        if self.layout < 1:
            raise ManifestError(f"layout (tensor-parallel degree) must be >= 1, got {self.layout}")
        if self.chunk_bytes <= 0:
            raise ManifestError(f"chunk_bytes must be > 0, got {self.chunk_bytes}")
        if self.total_bytes < 0:
            raise ManifestError(f"total_bytes must be >= 0, got {self.total_bytes}")
        want = max(1, math.ceil(self.total_bytes / self.chunk_bytes))
        if len(self.chunks) != want:
            raise ManifestError(f"{len(self.chunks)} chunk digests for {self.total_bytes} bytes "
                                f"in chunks of {self.chunk_bytes} (expected {want})")
        if root_checksum(self.chunks, self.total_bytes, self.algo) != self.checksum:
            raise ManifestError(f"manifest of version {self.version}: checksum {self.checksum} "
                                "does not match its chunk digests")
        for t in self.tensors:
            dt = t.np_dtype()
            if t.nbytes != math.prod(t.shape) * dt.itemsize:
                raise ManifestError(f"tensor {t.name!r}: {t.nbytes} bytes for shape {t.shape} of {t.dtype}")
            if t.offset < 0 or t.offset + t.nbytes > self.total_bytes:
                raise ManifestError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) "
                                    f"outside the version's {self.total_bytes} bytes")
            if not 0 <= t.rank < self.layout:
                raise ManifestError(f"tensor {t.name!r}: rank {t.rank} outside layout {self.layout}")

    def verify_chunk(self, index: int, data: Any) -> None:
        got = digest([data], self.algo)
        if got != self.chunks[index]:
            raise ChecksumMismatch(f"version {self.version} layout {self.layout} chunk {index}: "
                                   f"digest {got} != manifest {self.chunks[index]}")


# -------------------------------------------------------- building a version
def _as_contiguous(name: str, value: Any) -> np.ndarray:
    if not isinstance(name, str) or not name:
        raise ManifestError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(value, np.ndarray):
        raise ManifestError(f"tensor {name!r}: expected a numpy.ndarray, got {type(value).__name__}")
    if value.dtype.hasobject:
        raise ManifestError(f"tensor {name!r}: dtype {value.dtype} holds Python objects, not raw numbers")
    if value.dtype.byteorder == ">":
        raise ManifestError(f"tensor {name!r}: dtype {value.dtype.str} is big-endian; "
                            "convert with .astype(dtype.newbyteorder('<'))")
    # Non-contiguous inputs are copied once: the wire format is one flat range.
    return np.ascontiguousarray(value)


def plan_layout(tensors: Mapping[str, np.ndarray] | Sequence[tuple[str, np.ndarray, int]],
                ) -> tuple[list[TensorEntry], list[np.ndarray], int]:
    """Offsets for a tensor set (dict order kept). Sequence form: (name, array, rank)."""
    items = [(n, a, 0) for n, a in tensors.items()] if isinstance(tensors, Mapping) else list(tensors)
    entries, arrays, offset = [], [], 0
    for name, value, rank in items:
        arr = _as_contiguous(name, value)
        offset = -(-offset // ALIGN) * ALIGN
        entries.append(TensorEntry(name, arr.dtype.str, tuple(arr.shape), offset, arr.nbytes, rank, arr.dtype.name))
        arrays.append(arr)
        offset += arr.nbytes
    return entries, arrays, offset


class FlatSource:
    """A version's byte range as chunks of scatter-gather pieces, without copying the tensors."""

    def __init__(self, entries: Sequence[TensorEntry], arrays: Sequence[np.ndarray], total: int) -> None:
        self.entries, self.total = list(entries), total
        self.views = [memoryview(a.reshape(-1).view(np.uint8)) if a.nbytes else memoryview(b"") for a in arrays]

    def pieces(self, start: int, end: int) -> Iterator[memoryview]:
        pos = start
        for e, v in zip(self.entries, self.views):
            if e.offset + e.nbytes <= pos or not e.nbytes:
                continue
            if e.offset >= end:
                break
            if e.offset > pos:  # alignment padding: zeros
                yield from _zeros(e.offset - pos)
                pos = e.offset
            take_end = min(end, e.offset + e.nbytes)
            yield v[pos - e.offset: take_end - e.offset]
            pos = take_end
        if pos < end:
            yield from _zeros(end - pos)

    def to_bytearray(self) -> bytearray:
        """The whole byte range in one buffer, as a relay stores a version (benchmarks, tests)."""
        buf = bytearray(self.total)
        at = 0
        for piece in self.pieces(0, self.total):
            buf[at:at + len(piece)] = piece
            at += len(piece)
        return buf


def _zeros(n: int) -> Iterator[memoryview]:
    while n > 0:
        k = min(n, len(_ZEROS))
        yield _ZEROS[:k]
        n -= k


def build_manifest(version: int, tensors: Any, *, chunk_bytes: int, layout: int = 1,
                   algo: str = DEFAULT_ALGO, source_checksum: str = "") -> tuple[Manifest, FlatSource]:
    """Manifest plus the zero-copy source the sender streams chunks from."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"version must be an int >= 0, got {version!r}")
    if chunk_bytes <= 0:
        raise ManifestError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    entries, arrays, total = plan_layout(tensors)
    src = FlatSource(entries, arrays, total)
    n = max(1, math.ceil(total / chunk_bytes))
    digests = tuple(digest(src.pieces(i * chunk_bytes, min((i + 1) * chunk_bytes, total)), algo) for i in range(n))
    m = Manifest(version, layout, total, chunk_bytes, algo, digests, root_checksum(digests, total, algo),
                 tuple(entries), source_checksum)
    return m, src


def tensor_views(manifest: Manifest, buf: Any, rank: int | None = None) -> dict[str, np.ndarray]:
    """name -> numpy view into `buf` (no copy); only `rank`'s tensors when given."""
    out: dict[str, np.ndarray] = {}
    for t in manifest.tensors:
        if rank is not None and t.rank != rank:
            continue
        dt = t.np_dtype()
        out[t.name] = np.frombuffer(buf, dtype=dt, count=t.nbytes // dt.itemsize if dt.itemsize else 0,
                                    offset=t.offset).reshape(t.shape)
    return out
