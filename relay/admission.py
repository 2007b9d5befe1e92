"""What a relay accepts from a peer before it spends memory on it: one policy for every transport.

A header states sizes; a relay allocates nothing on a peer's word alone. The
receiving end (`link.serve`, shared by TCP and UCX) asks this module first:

- an `Offer` is held to the configured ceiling (`[relay] max_object_mib`)
  before the store creates its segment (a sparse tmpfs file: it costs memory
  only as chunks are written into it);
- a `Chunk` must belong to an object offered *on this connection*, name an
  index inside it and state exactly that chunk's size, or the connection is
  dropped at once, without reading (let alone buffering) the payload it
  announced. Memory then grows only by the bytes of chunks the manifest
  already accounts for, as they arrive.

Every refusal is a `Refused` (a `ProtocolError`) with a `kind` the relay counts
(`stats()["refused"]`) and a reason it logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfleet.common.weights_size import published_bytes
from rlfleet.relay.manifest import Manifest
from rlfleet.relay.protocol import Chunk, ProtocolError
from rlfleet.relay.shm import StoredObject, WeightStore

# When nothing configures a ceiling (tests, the benchmark): larger than any model the
# fleet runs on one machine's shared memory, small enough that a bogus 1 TiB offer fails.
DEFAULT_MAX_OBJECT_BYTES = 64 << 30
# The derived default (no max_object_mib in the spec): this many times the weights a
# version publishes, so a tensor-parallel layout (replicated tensors counted k times) fits.
CEILING_FACTOR = 2
CEILING_SLACK_BYTES = 64 << 20


class Refused(ProtocolError):
    """A peer's message broke the admission policy; `kind` names the rule for the counters."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Limits:
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES

    def __post_init__(self) -> None:
        if self.max_object_bytes <= 0:
            raise ValueError(f"max_object_bytes must be > 0, got {self.max_object_bytes}")


def ceiling_bytes(spec: Any) -> int:
    """The relay's ceiling for a job: `[relay] max_object_mib`, else derived from the weights' size."""
    if spec.relay.max_object_mib is not None:
        return spec.relay.max_object_mib << 20
    size = published_bytes(spec)
    return DEFAULT_MAX_OBJECT_BYTES if size is None else CEILING_FACTOR * size + CEILING_SLACK_BYTES


def check_offer(manifest: Manifest, limits: Limits) -> None:
    """Refuse an object larger than the ceiling (before the store makes room for it)."""
    if manifest.total_bytes > limits.max_object_bytes:
        raise Refused("oversize", f"version {manifest.version} tp{manifest.layout} declares "
                                  f"{manifest.total_bytes} bytes, more than this relay's ceiling of "
                                  f"{limits.max_object_bytes} ([relay] max_object_mib)")


def check_chunk(msg: Chunk, store: WeightStore, offered: set[tuple[int, int]]) -> tuple[StoredObject, int]:
    """The object a chunk header refers to and its size; raises Refused for anything else.

    `offered`: the objects offered on this connection (a sender always offers before it
    sends chunks, so a chunk for anything else is not a protocol this relay speaks).
    """
    key = (msg.version, msg.layout)
    what = f"chunk {msg.index} of {msg.version}/tp{msg.layout} ({msg.nbytes} bytes)"
    obj = store.get(key) if key in offered else None
    if obj is None:
        raise Refused("unoffered", f"{what}: no such object was offered on this connection")
    if not 0 <= msg.index < obj.manifest.n_chunks:
        raise Refused("bad_chunk", f"{what}: index outside the object's {obj.manifest.n_chunks} chunks")
    start, end = obj.manifest.chunk_range(msg.index)
    if msg.nbytes != end - start:
        raise Refused("bad_chunk", f"{what}: the manifest says this chunk is {end - start} bytes")
    return obj, end - start
