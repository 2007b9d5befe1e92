"""Authentication of the chunk transport: a handshake over the job secret, then a MAC per frame.

With a job secret (common/job_secret.py) every TCP connection of the chain
starts with a mutual challenge-response before any protocol message::

    client -> server   MAGIC | client nonce (32 bytes, fresh)
    server -> client   MAGIC | server nonce (32 bytes, fresh) | HMAC(secret, "server" | cn | sn)
    client -> server   HMAC(secret, "client" | cn | sn)

Each side proves it holds the secret over a nonce the *other* side just drew,
so a recorded handshake replayed later fails (the fresh nonce differs), and the
server's proof differs from the client's, so a reflected proof fails too. Both
sides then derive one key per direction from the secret and both nonces.

Every frame after that carries two HMAC-SHA256 tags under its direction's key:
one over (frame number, length, header), checked before the header is decoded,
and one over (frame number, payload), computed as the payload arrives (the
bytes are hashed while still in cache, straight from the shared-memory segment
they were received into: the zero-copy path stays). The frame number makes a
replayed, dropped or reordered frame fail; a bad tag drops the connection, and
the chunk it carried is missing again (never acknowledged, forwarded or served).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

from rlfleet.relay.admission import Refused
from rlfleet.relay.protocol import Reject, encode

MAGIC = b"RLFAUTH1"
NONCE_BYTES = 32
TAG_BYTES = 32
HANDSHAKE_S = 5.0  # a peer that has not finished the handshake by then is refused
_SEQ = struct.Struct("!Q")
_PLAIN_REFUSAL = (lambda head: struct.pack("!I", len(head)) + head)(
    encode(Reject(-1, -1, "this relay needs the job secret: every connection authenticates first "
                          "(RLFLEET_JOB_SECRET_FILE)")))


class AuthError(Refused):
    """The peer failed authentication (no or another secret, a replay, a forged frame)."""

    def __init__(self, reason: str) -> None:
        super().__init__("auth", reason)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class FrameAuth:
    """Per-connection keys and frame counters, one per direction."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send = hmac.new(send_key, digestmod=hashlib.sha256)
        self._recv = hmac.new(recv_key, digestmod=hashlib.sha256)
        self.send_seq = self.recv_seq = 0

    # A copy of a keyed HMAC skips re-deriving the padded key for every frame.
    def header_tag(self, seq: int, framed_header: bytes, sending: bool) -> bytes:
        h = (self._send if sending else self._recv).copy()
        h.update(b"H" + _SEQ.pack(seq))
        h.update(framed_header)
        return h.digest()

    def payload_hasher(self, seq: int, sending: bool) -> Any:
        h = (self._send if sending else self._recv).copy()
        h.update(b"P" + _SEQ.pack(seq))
        return h

    def payload_tag(self, seq: int, pieces: Iterable[Any]) -> bytes:
        h = self.payload_hasher(seq, sending=True)
        for p in pieces:
            h.update(p)
        return h.digest()

    @staticmethod
    def check(expected: bytes, got: bytes | bytearray, what: str) -> None:
        if not hmac.compare_digest(expected, bytes(got)):
            raise AuthError(f"{what}: authentication tag does not match (tampered, replayed or reordered)")


def _keys(secret: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes]:
    """(client->server key, server->client key)."""
    return _mac(secret, b"key c2s", cn, sn), _mac(secret, b"key s2c", cn, sn)


def client_handshake(secret: bytes, send: Callable[[bytes], None], recv: Callable[[int], bytes]) -> FrameAuth:
    cn = os.urandom(NONCE_BYTES)
    send(MAGIC + cn)
    reply = recv(len(MAGIC) + NONCE_BYTES + TAG_BYTES)
    if reply[:len(MAGIC)] != MAGIC:
        raise AuthError("the relay did not answer the authentication handshake (it runs without a job secret?)")
    sn, proof = reply[len(MAGIC):len(MAGIC) + NONCE_BYTES], reply[len(MAGIC) + NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"server", cn, sn)):
        raise AuthError("the relay's handshake proof is wrong: it holds another job secret")
    send(_mac(secret, b"client", cn, sn))
    c2s, s2c = _keys(secret, cn, sn)
    return FrameAuth(send_key=c2s, recv_key=s2c)


def server_handshake(secret: bytes, send: Callable[[bytes], None], recv: Callable[[int], bytes]) -> FrameAuth:
    magic = recv(len(MAGIC))  # a peer that connects and leaves (a port probe) is no refusal
    if magic != MAGIC:
        try:  # a peer without the secret speaks the plain protocol: tell it why, in its terms
            send(_PLAIN_REFUSAL)
        except (ConnectionError, OSError):
            pass
        raise AuthError("peer sent no authentication handshake (it runs without the job secret?)")
    try:
        cn = recv(NONCE_BYTES)
        sn = os.urandom(NONCE_BYTES)
        send(MAGIC + sn + _mac(secret, b"server", cn, sn))
        proof = recv(TAG_BYTES)
    except ConnectionError as exc:  # a client that found our proof wrong hangs up here
        raise AuthError(f"peer left the handshake half-way (it holds another job secret?): {exc}") from None
    if not hmac.compare_digest(proof, _mac(secret, b"client", cn, sn)):
        raise AuthError("peer's handshake proof is wrong (another job secret, or a replayed handshake)")
    c2s, s2c = _keys(secret, cn, sn)
    return FrameAuth(send_key=s2c, recv_key=c2s)
