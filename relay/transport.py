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
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from rlfleet.relay.protocol import MAX_HEADER_BYTES, Message, ProtocolError, decode, encode

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
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, msg: Message, payload: Sequence[Any] = ()) -> None:
        head = encode(msg)
        bufs = [memoryview(_LEN.pack(len(head))), memoryview(head), *(memoryview(p).cast("B") for p in payload)]
        with self._send_lock:
            self.sock.settimeout(None)
            try:
                _sendmsg_all(self.sock, bufs)
            except OSError as exc:
                raise ConnectionError(f"send to {self.peer} failed: {exc}") from exc

    def _recv_exact(self, buf: memoryview, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        got = 0
        try:
            while got < len(buf):
                n = self.sock.recv_into(buf[got:])
                if n == 0:
                    raise ConnectionError(f"{self.peer} closed the connection")
                got += n
        except socket.timeout:
            if got:  # a half-read frame cannot be resumed: the stream is unusable
                raise ConnectionError(f"{self.peer} stalled mid-frame ({got}/{len(buf)} bytes)") from None
            raise TimeoutError(f"no data from {self.peer} within {timeout}s") from None
        except OSError as exc:
            if isinstance(exc, ConnectionError):
                raise
            raise ConnectionError(f"recv from {self.peer} failed: {exc}") from exc

    def recv(self, timeout: float | None = None) -> Message:
        lenbuf = bytearray(4)
        self._recv_exact(memoryview(lenbuf), timeout)
        (n,) = _LEN.unpack(lenbuf)
        if n > MAX_HEADER_BYTES:
            raise ProtocolError(f"{self.peer}: header of {n} bytes exceeds {MAX_HEADER_BYTES}")
        head = bytearray(n)
        self._recv_exact(memoryview(head), 30.0 if timeout is None else max(timeout, 30.0))
        return decode(head)

    def recv_payload_into(self, buf: memoryview, timeout: float | None = None) -> None:
        self._recv_exact(buf, 60.0 if timeout is None else timeout)

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
    def __init__(self, host: str, port: int = 0) -> None:
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
        except socket.timeout:
            return None
        except OSError as exc:
            raise ConnectionError(f"listener {self.address} closed: {exc}") from exc
        return TcpConn(s, f"tcp://{addr[0]}:{addr[1]}")

    def close(self) -> None:
        self.sock.close()


class TcpTransport(Transport):
    name = "tcp"

    def listen(self, host: str, port: int = 0) -> Listener:
        return TcpListener(host, port)

    def connect(self, address: str, timeout: float = 5.0) -> Conn:
        host, port = _split(address, "tcp")
        try:
            s = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to {address}: {exc}") from exc
        return TcpConn(s, address)


# ------------------------------------------------------------------ factory
def ucx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def get_transport(name: str) -> Transport:
    """'tcp' or 'ucx' ('ucx' needs the ucxx package; the error says how to get it)."""
    if name == "tcp":
        return TcpTransport()
    if name == "ucx":
        if not ucx_available():
            raise RuntimeError("relay transport 'ucx' needs the ucxx package "
                               "(pip install ucxx-cu12==0.52.0); use transport = \"tcp\" otherwise")
        from rlfleet.relay.ucx_transport import UcxTransport
        return UcxTransport()
    raise ValueError(f"unknown relay transport {name!r} (expected 'tcp' or 'ucx')")


def transport_for(address: str) -> Transport:
    return get_transport(address.split("://", 1)[0])
