"""The chunk protocol between two hops of the chain (and trainer -> master).

The sending side (predecessor or publisher) drives; the receiving side answers::

    P -> S  Hello(sender)                      S -> P  State(have=[[version, layout, complete], ...])
    P -> S  Offer(manifest)                    S -> P  Want(version, layout, missing=[i, ...]) | Reject(reason)
    P -> S  Chunk(version, layout, index) + payload   (up to `window` unacked)
                                               S -> P  ChunkAck(index) | ChunkNack(index, reason)   per chunk
                                               S -> P  Done(version, layout, checksum)    after the last chunk
    any  -> S  StatusQuery                     S -> any Status(stats)

A `Want` lists exactly the chunks the receiver lacks, which is what makes a
repaired hop resume where the dead relay left off instead of at chunk 0.
Headers are msgpack (msgspec structs, tagged); payloads follow as raw bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_HEADER_BYTES = 16 << 20  # a manifest for ~100k tensors; anything larger is a bad peer


class ProtocolError(ValueError):
    """A peer sent something the protocol does not allow (named, counted, connection dropped)."""


class _M(msgspec.Struct, tag=True, frozen=True):
    pass


class Hello(_M):
    sender: str
    role: str = "relay"  # "relay" | "publisher"


class State(_M):
    have: list[tuple[int, int, bool]]  # (version, layout, complete)
    newest: int = -1


class Offer(_M):
    manifest: dict[str, Any]


class Want(_M):
    version: int
    layout: int
    missing: list[int]


class Reject(_M):
    version: int
    layout: int
    reason: str


class Chunk(_M):
    version: int
    layout: int
    index: int
    nbytes: int


class ChunkAck(_M, tag="Ack"):  # the tag on the wire stays "Ack": relays of both names interoperate
    version: int
    layout: int
    index: int


class ChunkNack(_M, tag="Nack"):
    version: int
    layout: int
    index: int
    reason: str


class Done(_M):
    version: int
    layout: int
    checksum: str


class StatusQuery(_M):
    pass


class Status(_M):
    stats: dict[str, Any]


Message = Hello | State | Offer | Want | Reject | Chunk | ChunkAck | ChunkNack | Done | StatusQuery | Status
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes | memoryview) -> Message:
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad chunk-protocol header: {exc}") from None


def check_header_size(n: int, peer: str) -> None:
    """The one limit on a header's announced length, for every transport."""
    if n > MAX_HEADER_BYTES:
        raise ProtocolError(f"{peer}: header of {n} bytes exceeds {MAX_HEADER_BYTES}")


def payload_size(msg: Message) -> int:
    """Raw bytes that follow this header on the connection."""
    if isinstance(msg, Chunk):
        if msg.nbytes < 0:
            raise ProtocolError(f"chunk {msg.index}: negative payload size {msg.nbytes}")
        return msg.nbytes
    return 0
