"""Transports for the chunk protocol: one blocking, message-oriented interface.

A `Conn` carries protocol headers (relay.protocol) each optionally followed by
a raw payload whose size the header states; payloads are received straight
into the caller's buffer (a slice of the shared-memory segment), so a chunk is
copied once, by the kernel, on its way in. Implementations: TCP here, UCX in
`relay.ucx_transport` (chosen by config: `[relay] transport = "tcp" | "ucx"`).

A dead peer is a `ConnectionError` on the next call (never a hang: every wait
has a timeout), which is what the chain's repair logic keys on.
"""

from __future__ import annotations

import abc
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from rlfleet.relay.auth import HANDSHAKE_S, TAG_BYTES, AuthError, FrameAuth, client_handshake, server_handshake
from rlfleet.relay.protocol import Message, check_header_size, decode, encode, payload_size

_LEN = struct.Struct("!I")


class Conn(abc.ABC):
    peer: str = ""

    @abc.abstractmethod
    def send(self, msg: Message, payload: Sequence[Any] = ()) -> None:
        """Send a header and its payload pieces (total must equal what the header states)."""

    @abc.abstractmethod
    def recv(self, timeout: float | None = None) -> Message:
        """Next header; raises TimeoutError, ConnectionError or ProtocolError."""

    @abc.abstractmethod
    def recv_payload_into(self, buf: memoryview, timeout: float | None = None) -> None:
        """Fill `buf` exactly with the payload that follows the last header."""

    def discard_payload(self, nbytes: int, timeout: float | None = None) -> None:
        """Read past the payload that follows the last header (`nbytes`, already checked
        against the manifest by the caller: this allocates that much at most)."""
        self.recv_payload_into(memoryview(bytearray(nbytes)), timeout)

    @abc.abstractmethod
    def close(self) -> None: ...


class Listener(abc.ABC):
    address: str = ""

    @abc.abstractmethod
    def accept(self, timeout: float | None = None) -> Conn | None:
        """A new incoming connection, or None after `timeout`."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def listen(self, host: str, port: int = 0) -> Listener: ...

    @abc.abstractmethod
    def connect(self, address: str, timeout: float = 5.0) -> Conn: ...


# ----------------------------------------------------------------------- TCP
def _split(address: str, scheme: str) -> tuple[str, int]:
    if not address.startswith(scheme + "://"):
        raise ValueError(f"expected a {scheme}://host:port address, got {address!r}")
    host, _, port = address[len(scheme) + 3:].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected a {scheme}://host:port address, got {address!r}")
    return host.strip("[]"), int(port)


class TcpConn(Conn):
    """One TCP connection; with a job secret, authenticated (relay.auth) before its first frame.

    Frame: 4-byte length, header, [header tag], payload, [payload tag] (tags only with a secret).
    """

    def __init__(self, sock: socket.socket, peer: str, secret: bytes | None = None, *,
                 server: bool = False) -> None:
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking for good, and never changed again: one thread sends while another
        # reads acks, and Python's per-socket timeout is one shared mode (settimeout on
        # one thread made the other's blocking send fail with EAGAIN). Receive timeouts
        # come from poll() instead (_wait_readable).
        sock.settimeout(None)
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._send_lock = threading.Lock()
        self._closed = False
        self._auth: FrameAuth | None = None
        self._secret = secret
        self._payload_seq = -1  # frame number of the header whose payload is next (authenticated)
        if secret is not None and not server:
            self._handshake(client_handshake)
        # A server authenticates on its first recv(), in the thread serving the connection:
        # a peer that connects and says nothing must not hold up the accept loop.

    def _handshake(self, run: Any) -> None:
        secret, self._secret = self._secret, None
        assert secret is not None
        deadline = time.monotonic() + HANDSHAKE_S

        def send(data: bytes) -> None:
            try:  # a few dozen bytes on a fresh connection: the socket buffer takes them at once
                self.sock.sendall(data)
            except OSError as exc:
                raise ConnectionError(f"handshake with {self.peer}: {exc}") from exc

        def recv(n: int) -> bytes:
            buf = bytearray(n)
            try:
                self._recv_exact(memoryview(buf), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                raise AuthError(f"{self.peer} did not complete the handshake within {HANDSHAKE_S:g}s") from None
            except ConnectionError as exc:
                if "stalled" in str(exc):
                    raise AuthError(f"{self.peer} did not complete the handshake within {HANDSHAKE_S:g}s") from None
                raise ConnectionError(f"{exc} during the authentication handshake (one side has no job "
                                      "secret, or another one?)") from None
            return bytes(buf)

        try:
            self._auth = run(secret, send, recv)
        except AuthError:
            self._linger()
            raise

    def _linger(self) -> None:
        # Closing with the peer's bytes unread sends a reset, which can destroy the refusal
        # we just sent before the peer reads it: end our side, read past what it sent.
        try:
            self.sock.shutdown(socket.SHUT_WR)
            for _ in range(16):
                if not self._readable.poll(200) or not self.sock.recv(65536, socket.MSG_DONTWAIT):
                    break
        except OSError:
            pass

    def send(self, msg: Message, payload: Sequence[Any] = ()) -> None:
        head = encode(msg)
        framed = _LEN.pack(len(head)) + head
        pieces = [memoryview(p).cast("B") for p in payload]
        with self._send_lock:
            bufs = [memoryview(framed)]
            if self._auth is not None:
                seq = self._auth.send_seq
                self._auth.send_seq += 1
                bufs.append(memoryview(self._auth.header_tag(seq, framed, sending=True)))
                bufs += pieces
                if pieces:
                    bufs.append(memoryview(self._auth.payload_tag(seq, pieces)))
            else:
                bufs += pieces
            try:
                _sendmsg_all(self.sock, bufs)
            except OSError as exc:
                raise ConnectionError(f"send to {self.peer} failed: {exc}") from exc

    def _recv_exact(self, buf: memoryview, timeout: float | None, hasher: Any = None) -> None:
        """Fill ``buf``; ``timeout`` bounds each wait for more bytes (not the whole read)."""
        got = 0
        wait_ms = None if timeout is None else max(0, int(timeout * 1000))
        try:
            while got < len(buf):
                if not self._readable.poll(wait_ms):
                    raise TimeoutError
                try:
                    n = self.sock.recv_into(buf[got:], 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue  # readable was stale: wait again
                if n == 0:
                    raise ConnectionError(f"{self.peer} closed the connection")
                if hasher is not None:
                    hasher.update(buf[got:got + n])  # while the bytes are still in cache
                got += n
        except TimeoutError:
            if got:  # a half-read frame cannot be resumed: the stream is unusable
                raise ConnectionError(f"{self.peer} stalled mid-frame ({got}/{len(buf)} bytes)") from None
            raise TimeoutError(f"no data from {self.peer} within {timeout}s") from None
        except OSError as exc:
            if isinstance(exc, ConnectionError):
                raise
            raise ConnectionError(f"recv from {self.peer} failed: {exc}") from exc

    def recv(self, timeout: float | None = None) -> Message:
        if self._secret is not None:
            self._handshake(server_handshake)
        lenbuf = bytearray(4)
        self._recv_exact(memoryview(lenbuf), timeout)
        (n,) = _LEN.unpack(lenbuf)
        check_header_size(n, self.peer)
        rest = 30.0 if timeout is None else max(timeout, 30.0)
        head = self._recv_growing(n, rest)
        if self._auth is not None:
            tag = bytearray(TAG_BYTES)
            self._recv_exact(memoryview(tag), rest)
            seq = self._auth.recv_seq
            self._auth.recv_seq += 1
            self._auth.check(self._auth.header_tag(seq, bytes(lenbuf) + head, sending=False), tag,
                             f"frame {seq} from {self.peer}")
        msg = decode(head)
        if self._auth is not None and payload_size(msg):
            self._payload_seq = seq
        return msg

    def _recv_growing(self, n: int, timeout: float) -> bytes:
        # The buffer grows with the bytes that actually arrived, not with the length a
        # peer announced: a 16 MiB length followed by silence costs 64 KiB, not 16 MiB.
        parts, got, step = [], 0, 64 << 10
        while got < n:
            piece = bytearray(min(step, n - got))
            self._recv_exact(memoryview(piece), timeout)
            parts.append(piece)
            got += len(piece)
            step *= 2
        return b"".join(parts)

    def recv_payload_into(self, buf: memoryview, timeout: float | None = None) -> None:
        self._recv_payload(buf, 60.0 if timeout is None else timeout, discard=False)

    def discard_payload(self, nbytes: int, timeout: float | None = None) -> None:
        self._recv_payload(memoryview(bytearray(min(nbytes, 1 << 20))), 60.0 if timeout is None else timeout,
                           discard=True, nbytes=nbytes)

    def _recv_payload(self, buf: memoryview, timeout: float, *, discard: bool, nbytes: int = 0) -> None:
        hasher = None
        if self._auth is not None:
            hasher = self._auth.payload_hasher(self._payload_seq, sending=False)
        if discard:  # through a small scratch buffer, a piece at a time
            left = nbytes
            while left:
                k = min(left, len(buf))
                self._recv_exact(buf[:k], timeout, hasher)
                left -= k
        else:
            self._recv_exact(buf, timeout, hasher)
        if hasher is not None:
            tag = bytearray(TAG_BYTES)
            self._recv_exact(memoryview(tag), timeout)
            FrameAuth.check(hasher.digest(), tag, f"payload of frame {self._payload_seq} from {self.peer}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    # sendmsg may write part of the vector; advance through it without copying.
    # At most ~1000 iovecs per call (IOV_MAX is 1024 on Linux).
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + 512])
        while sent and i < len(bufs):
            if sent >= len(bufs[i]):
                sent -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0
        while i < len(bufs) and len(bufs[i]) == 0:
            i += 1


class TcpListener(Listener):
    def __init__(self, host: str, port: int = 0, secret: bytes | None = None) -> None:
        self._secret = secret
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        bound = self.sock.getsockname()[1]
        self.address = f"tcp://{f'[{host}]' if ':' in host else host}:{bound}"

    def accept(self, timeout: float | None = None) -> Conn | None:
        self.sock.settimeout(timeout)
        try:
            s, addr = self.sock.accept()
        except TimeoutError:
            return None
        except OSError as exc:
            raise ConnectionError(f"listener {self.address} closed: {exc}") from exc
        return TcpConn(s, f"tcp://{addr[0]}:{addr[1]}", self._secret, server=True)

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret  # the job secret: every connection authenticated (relay.auth)

    def listen(self, host: str, port: int = 0) -> Listener:
        return TcpListener(host, port, self._secret)

    def connect(self, address: str, timeout: float = 5.0) -> Conn:
        host, port = _split(address, "tcp")
        try:
            s = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to {address}: {exc}") from exc
        try:
            return TcpConn(s, address, self._secret)
        except BaseException:
            s.close()
            raise


# ------------------------------------------------------------------ factory
def ucx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def get_transport(name: str, secret: bytes | None = None) -> Transport:
    """'tcp' or 'ucx' ('ucx' needs the ucxx package; the error says how to get it).

    `secret`: the job secret (common.job_secret); None: connections are not authenticated.
    """
    if name == "tcp":
        return TcpTransport(secret)
    if name == "ucx":
        if secret is not None:
            # UCX has no authentication or encryption of its own (docs/design/relay.md, "Trust"):
            # running it unauthenticated while the job asked for a secret would be a silent downgrade.
            raise RuntimeError("relay transport 'ucx' cannot authenticate peers and this job has a job secret "
                               "(RLFLEET_JOB_SECRET_FILE); use transport = \"tcp\", or run UCX only on a "
                               "fabric you trust and without a job secret")
        if not ucx_available():
            raise RuntimeError("relay transport 'ucx' needs the ucxx package "
                               "(pip install ucxx-cu12==0.52.0); use transport = \"tcp\" otherwise")
        from rlfleet.relay.ucx_transport import UcxTransport
        return UcxTransport()
    raise ValueError(f"unknown relay transport {name!r} (expected 'tcp' or 'ucx')")


def transport_for(address: str, secret: bytes | None = None) -> Transport:
    return get_transport(address.split("://", 1)[0], secret)
