"""UCX transport for the chunk protocol, through `ucxx` (asyncio API).

ucxx is asyncio-only; the relay's hops are plain threads. One event-loop
thread per process runs every UCX operation and the blocking `Conn` methods
hand coroutines to it. Each connection has one reader coroutine that receives
headers into a thread-safe queue and then waits for the consuming thread to
name the buffer the payload goes into, so a timeout on `recv()` never cancels
a UCX operation half-way (which would leave the endpoint unusable).

On the wire, per message: an 8-byte header length, the header, then the
payload as one UCX message (several payload pieces are gathered into one
staging buffer first: UCX receives a message into exactly one buffer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlfleet.relay.protocol import Message, ProtocolError, check_header_size, decode, encode, payload_size
from rlfleet.relay.transport import Conn, Listener, Transport, _split

log = logging.getLogger("rlfleet.relay")
_LEN = struct.Struct("!Q")


class _Loop:
    _instance: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ucx-loop", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _Loop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Loop()
            return cls._instance

    def run(self, coro: Any, timeout: float | None = None, *, late: Any = None) -> Any:
        """Run ``coro`` on the UCX loop; TimeoutError after ``timeout``. The operation is
        never cancelled: cancelling ucxx mid-operation (an endpoint half created on a starved
        CPU) crashed the process with a segmentation fault. It finishes on the loop instead,
        and ``late`` is called with its result if it succeeds after all (to close it)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if late is not None:
                fut.add_done_callback(lambda f: late(f.result()) if not f.cancelled() and f.exception() is None
                                      else None)
            raise TimeoutError("UCX operation timed out") from None


def _as_array(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


class UcxConn(Conn):
    def __init__(self, ep: Any, peer: str, loop: _Loop) -> None:
        self.ep, self.peer, self._loop = ep, peer, loop
        self._headers: queue.Queue[Any] = queue.Queue()
        self._payload_target: asyncio.Queue[Any] | None = None
        self._send_lock = threading.Lock()
        self.closed = asyncio.Event()
        self._ready = threading.Event()
        loop.loop.call_soon_threadsafe(self._start_reader)
        self._ready.wait(5)

    def _start_reader(self) -> None:
        self._payload_target = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read_loop())
        self._ready.set()

    async def _read_loop(self) -> None:
        assert self._payload_target is not None
        try:
            while True:
                lenbuf = np.empty(8, dtype=np.uint8)
                await self.ep.recv(lenbuf)
                (n,) = _LEN.unpack(lenbuf.tobytes())
                check_header_size(n, self.peer)
                head = np.empty(n, dtype=np.uint8)
                await self.ep.recv(head)
                msg = decode(head.tobytes())
                self._headers.put(msg)
                if payload_size(msg):
                    target, done = await self._payload_target.get()
                    try:
                        await self.ep.recv(target)
                        done.set_result(None)
                    except BaseException as exc:  # noqa: BLE001 - hand it to the waiting thread
                        done.set_exception(ConnectionError(f"recv from {self.peer} failed: {exc!r}"))
                        raise
        except asyncio.CancelledError:
            self._headers.put(ConnectionError(f"connection to {self.peer} closed"))
        except ProtocolError as exc:
            self._headers.put(exc)
        except Exception as exc:  # noqa: BLE001 - UCX errors: the peer is gone
            self._headers.put(ConnectionError(f"recv from {self.peer} failed: {exc!r}"))

    def send(self, msg: Message, payload: Sequence[Any] = ()) -> None:
        head = encode(msg)
        views = [memoryview(p).cast("B") for p in payload]
        if len(views) > 1:
            body = np.empty(sum(len(v) for v in views), dtype=np.uint8)
            pos = 0
            for v in views:
                body[pos:pos + len(v)] = np.frombuffer(v, dtype=np.uint8)
                pos += len(v)
        else:
            body = _as_array(views[0]) if views else None

        async def _send() -> None:
            await self.ep.send(np.frombuffer(_LEN.pack(len(head)), dtype=np.uint8).copy())
            await self.ep.send(np.frombuffer(head, dtype=np.uint8).copy())
            if body is not None and len(body):
                await self.ep.send(body)

        with self._send_lock:
            try:
                self._loop.run(_send(), timeout=120)
            except TimeoutError as exc:
                raise ConnectionError(f"send to {self.peer} timed out") from exc
            except Exception as exc:  # noqa: BLE001
                raise ConnectionError(f"send to {self.peer} failed: {exc!r}") from exc

    def recv(self, timeout: float | None = None) -> Message:
        try:
            item = self._headers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no data from {self.peer} within {timeout}s") from None
        if isinstance(item, BaseException):
            self._headers.put(item)  # every later call sees the same error
            raise item
        return item

    def recv_payload_into(self, buf: memoryview, timeout: float | None = None) -> None:
        target = _as_array(buf)

        async def _hand_over() -> None:
            assert self._payload_target is not None
            done = asyncio.get_running_loop().create_future()
            await self._payload_target.put((target, done))
            await done

        try:
            self._loop.run(_hand_over(), timeout=60.0 if timeout is None else timeout)
        except TimeoutError as exc:
            raise ConnectionError(f"{self.peer} stalled mid-payload") from exc

    def close(self) -> None:
        async def _close() -> None:
            self._reader.cancel()
            try:
                await self.ep.close()
            except Exception:  # noqa: BLE001 - closing a dead endpoint
                pass
            self.closed.set()
        try:
            self._loop.run(_close(), timeout=5)
        except Exception:  # noqa: BLE001
            pass


class UcxListener(Listener):
    def __init__(self, host: str, port: int, loop: _Loop) -> None:
        import ucxx

        self._loop = loop
        self._accepted: queue.Queue[UcxConn] = queue.Queue()

        async def handler(ep: Any) -> None:
            conn = _new_conn_in_loop(ep, self._loop)
            self._accepted.put(conn)
            await conn.closed.wait()

        async def _create() -> Any:
            return ucxx.create_listener(handler, port)

        self._listener = loop.run(_create(), timeout=10)
        self.address = f"ucx://{host}:{self._listener.port}"

    def accept(self, timeout: float | None = None) -> Conn | None:
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        async def _close() -> None:
            self._listener.close()
        try:
            self._loop.run(_close(), timeout=5)
        except Exception:  # noqa: BLE001
            pass


def _new_conn_in_loop(ep: Any, loop: _Loop) -> UcxConn:
    # Called on the loop thread: start the reader directly rather than via call_soon.
    conn = UcxConn.__new__(UcxConn)
    conn.ep, conn.peer, conn._loop = ep, "ucx://peer", loop
    conn._headers = queue.Queue()
    conn._send_lock = threading.Lock()
    conn.closed = asyncio.Event()
    conn._ready = threading.Event()
    conn._start_reader()
    return conn


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self) -> None:
        self._loop = _Loop.get()

    def listen(self, host: str, port: int = 0) -> Listener:
        return UcxListener(host, port, self._loop)

    def _close_late(self, ep: Any) -> None:
        """An endpoint whose creation finished after connect() gave up: nobody uses it."""
        async def _close() -> None:
            try:
                await ep.close()
            except Exception:  # noqa: BLE001 - closing a dead endpoint
                pass
        # From the loop's thread, or the caller's when it finished just as connect() gave up.
        self._loop.loop.call_soon_threadsafe(lambda: self._loop.loop.create_task(_close()))

    def connect(self, address: str, timeout: float = 5.0) -> Conn:
        import ucxx

        host, port = _split(address, "ucx")
        try:
            ep = self._loop.run(ucxx.create_endpoint(host, port), timeout=timeout, late=self._close_late)
        except Exception as exc:  # noqa: BLE001
            raise ConnectionError(f"cannot connect to {address}: {exc!r}") from exc
        return UcxConn(ep, address, self._loop)
