"""A hostile (or broken) peer on a relay's chunk port: raw frames over a plain socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from rlfleet.relay.auth import TAG_BYTES, FrameAuth, client_handshake
from rlfleet.relay.manifest import Manifest, root_checksum
from rlfleet.relay.protocol import decode, encode

_LEN = struct.Struct("!I")


def frame(msg: Any) -> bytes:
    """A framed header: a protocol struct, or a dict {"type": name, ...} with values the
    structs would refuse to encode (negative sizes, integers up to 2**64 - 1)."""
    head = encode(msg) if isinstance(msg, msgspec.Struct) else msgspec.msgpack.encode(msg)
    return _LEN.pack(len(head)) + head


def huge_manifest(version: int, total_bytes: int, chunk_bytes: int | None = None) -> Manifest:
    """A self-consistent manifest for `total_bytes` nobody will ever send (no tensors)."""
    chunk_bytes = chunk_bytes or total_bytes
    n = max(1, -(-total_bytes // chunk_bytes))
    chunks = tuple(f"{i:016x}" for i in range(n))
    return Manifest(version, 1, total_bytes, chunk_bytes, "xxh3_64", chunks,
                    root_checksum(chunks, total_bytes, "xxh3_64"), ())


class RawPeer:
    """A plain socket speaking the chunk protocol by hand (optionally after the handshake)."""

    def __init__(self, address: str, secret: bytes | None = None) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.auth: FrameAuth | None = None
        self.sent_raw: list[bytes] = []  # every byte string sent, for replaying
        if secret is not None:
            self.auth = client_handshake(secret, self.send_raw, self.recv_exact)

    def send_raw(self, data: bytes) -> None:
        self.sent_raw.append(bytes(data))
        self.sock.sendall(data)

    def recv_exact(self, n: int, timeout: float = 5.0) -> bytes:
        self.sock.settimeout(timeout)
        buf = b""
        while len(buf) < n:
            piece = self.sock.recv(n - len(buf))
            if not piece:
                raise ConnectionError("relay closed the connection")
            buf += piece
        return buf

    def send(self, msg: Any, payload: bytes = b"", *, tag_payload: bytes | None = None) -> None:
        """One frame; with auth, tagged like TcpConn does (`tag_payload`: bytes the payload tag
        is computed over, to forge a frame whose payload was changed on the way)."""
        framed = frame(msg)
        if self.auth is None:
            self.send_raw(framed + payload)
            return
        seq = self.auth.send_seq
        self.auth.send_seq += 1
        out = framed + self.auth.header_tag(seq, framed, sending=True)
        if payload:
            out += payload + self.auth.payload_tag(seq, [tag_payload if tag_payload is not None else payload])
        self.send_raw(out)

    def recv(self, timeout: float = 5.0) -> Any:
        (n,) = _LEN.unpack(self.recv_exact(4, timeout))
        head = self.recv_exact(n, timeout)
        if self.auth is not None:
            self.recv_exact(TAG_BYTES, timeout)  # the relay's tag (TcpConn checks these; not needed here)
            self.auth.recv_seq += 1
        return decode(head)

    def closed_by_relay(self, timeout: float) -> bool:
        """True once the relay has closed the connection (False if still open after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(0.05)
            try:
                if self.sock.recv(65536) == b"":
                    return True
            except TimeoutError:
                continue
            except OSError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RelayProcess:
    """tests/relay/node_proc.py: a relay data plane in its own process (no etcd)."""

    def __init__(self, tmp: Path, max_object_bytes: int | None = None, **env: str) -> None:
        self.store_dir = f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}"
        self.log_path = tmp / f"relay-{uuid.uuid4().hex[:6]}.log"
        args = [sys.executable, "-m", "tests.relay.node_proc", self.store_dir]
        if max_object_bytes is not None:
            args.append(str(max_object_bytes))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **env}, cwd=Path(__file__).parents[2])
        line = self.proc.stdout.readline()  # blocks until the node listens (or the process died)
        if not line:
            raise AssertionError(f"relay process did not start: {self.log()}")
        info = json.loads(line)
        self.address, self.pid = info["address"], info["pid"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)
