"""Both ends of one hop: pushing an object down a connection, and serving one.

`Link` is the sending end (a relay towards its successor, or the publisher
towards the master): it offers an object, learns which chunks the receiver
lacks, and streams exactly those with at most `window` unacknowledged, so the
chain runs as a pipeline. A chunk is sent as soon as the sender itself has it
(`ChunkSource.wait`), which is what lets chunk i travel down the chain while
chunk i+1 is still arriving.

`serve` is the receiving end: every chunk lands directly in the store's
shared-memory segment, is verified against the manifest's digest, and only
then acknowledged and made visible to this relay's own forwarder. A corrupt
chunk is refused (ChunkNack) and sent again by the sender; it is never served.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfleet.relay.admission import Limits, Refused, check_chunk, check_offer
from rlfleet.relay.manifest import ChecksumMismatch, Manifest, ManifestError
from rlfleet.relay.protocol import (
    Chunk,
    ChunkAck,
    ChunkNack,
    Done,
    Hello,
    Offer,
    ProtocolError,
    Reject,
    State,
    Status,
    StatusQuery,
    Want,
)
from rlfleet.relay.shm import RejectError, WeightStore
from rlfleet.relay.transport import Conn

log = logging.getLogger("rlfleet.relay")

MAX_RESENDS = 3


class Rejected(Exception):
    """The receiver refused the object (conflicting contents, bad manifest)."""


class Aborted(Exception):
    """The push was called off by the caller (topology changed, shutting down)."""


class ChunkSource(Protocol):
    def wait(self, index: int, timeout: float) -> bool:
        """True once chunk `index` is available to send."""

    def pieces(self, index: int) -> Iterable[Any]:
        """The chunk's bytes as buffer pieces."""


@dataclass
class LinkStats:
    chunks_sent: int = 0
    bytes_sent: int = 0
    resends: int = 0
    objects_done: int = 0
    busy_s: float = 0.0   # time spent pushing (for bytes/s)


@dataclass
class PushResult:
    version: int
    layout: int
    chunks_sent: int
    bytes_sent: int
    seconds: float
    first_sent: int | None   # index of the first chunk this push had to send (None: nothing missing)


class Link:
    """The sending end of one hop; owns the connection and the thread reading its replies."""

    def __init__(self, conn: Conn, sender: str, role: str = "relay", *, window: int = 4,
                 reply_timeout_s: float = 10.0, corrupt_once: set[tuple[int, int, int]] | None = None,
                 pace_s: float = 0.0) -> None:
        self.conn, self.window, self.reply_timeout_s = conn, max(1, window), reply_timeout_s
        self.pace_s = pace_s  # test hook: sleep after each chunk, so faults can land mid-broadcast
        self.stats = LinkStats()
        self._replies: queue.Queue[Any] = queue.Queue()
        self._corrupt_once = corrupt_once if corrupt_once is not None else set()
        self._reader = threading.Thread(target=self._read, name=f"link-acks:{conn.peer}", daemon=True)
        self._reader.start()
        conn.send(Hello(sender, role))
        state = self._next_reply(self.reply_timeout_s)
        if isinstance(state, Reject):
            raise ProtocolError(f"{conn.peer} refused the connection: {state.reason}")
        if not isinstance(state, State):
            raise ProtocolError(f"{conn.peer}: expected State after Hello, got {type(state).__name__}")
        self.peer_state = state

    def _read(self) -> None:
        try:
            while True:
                self._replies.put(self.conn.recv(None))
        except Exception as exc:  # noqa: BLE001 - handed to the pushing thread
            self._replies.put(exc if isinstance(exc, (ConnectionError, ProtocolError))
                              else ConnectionError(f"{self.conn.peer}: {exc!r}"))

    def _next_reply(self, timeout: float) -> Any:
        try:
            item = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise ConnectionError(f"{self.conn.peer}: no reply within {timeout:.1f}s") from None
        if isinstance(item, BaseException):
            self._replies.put(item)
            raise item
        return item

    def close(self) -> None:
        self.conn.close()

    def push(self, manifest: Manifest, source: ChunkSource,
             abort: Callable[[], bool] = lambda: False) -> PushResult:
        """Deliver one object; returns once the receiver holds it complete and verified."""
        started = time.monotonic()
        v, lay = manifest.key
        sent_chunks = sent_bytes = 0
        first_sent: int | None = None
        for _attempt in range(5):
            self.conn.send(Offer(manifest.to_json()))
            reply = self._next_reply(self.reply_timeout_s)
            if isinstance(reply, Reject):
                raise Rejected(f"{self.conn.peer} refused version {v} tp{lay}: {reply.reason}")
            if not isinstance(reply, Want) or (reply.version, reply.layout) != (v, lay):
                raise ProtocolError(f"{self.conn.peer}: expected Want for {v}/tp{lay}, got {reply!r}")
            pending = list(reply.missing)
            if pending and first_sent is None:
                first_sent = pending[0]
            inflight: set[int] = set()
            resends: dict[int, int] = {}
            done = False
            while pending or inflight:
                # Send what is available while the window allows.
                while pending and len(inflight) < self.window:
                    i = pending[0]
                    if not source.wait(i, 0.05):
                        break
                    pending.pop(0)
                    n = self._send_chunk(manifest, i, source)
                    inflight.add(i)
                    sent_chunks, sent_bytes = sent_chunks + 1, sent_bytes + n
                if abort():
                    raise Aborted(f"push of {v}/tp{lay} to {self.conn.peer} called off")
                # Then take replies: block only when the window is full or nothing is sendable.
                wait = self.reply_timeout_s if len(inflight) >= self.window or (inflight and not pending) else 0.0
                if not inflight:
                    continue
                try:
                    reply = self._replies.get(timeout=wait) if wait else self._replies.get_nowait()
                except queue.Empty:
                    if wait:
                        raise ConnectionError(f"{self.conn.peer}: no ack within {wait:.1f}s") from None
                    continue
                if isinstance(reply, BaseException):
                    self._replies.put(reply)
                    raise reply
                if isinstance(reply, ChunkAck) and (reply.version, reply.layout) == (v, lay):
                    inflight.discard(reply.index)
                elif isinstance(reply, ChunkNack) and (reply.version, reply.layout) == (v, lay):
                    inflight.discard(reply.index)
                    resends[reply.index] = resends.get(reply.index, 0) + 1
                    self.stats.resends += 1
                    log.warning("%s refused chunk %d of %d/tp%d (%s); sending it again",
                                self.conn.peer, reply.index, v, lay, reply.reason)
                    if resends[reply.index] > MAX_RESENDS:
                        raise ConnectionError(f"{self.conn.peer}: chunk {reply.index} of {v}/tp{lay} "
                                              f"refused {resends[reply.index]} times")
                    pending.insert(0, reply.index)
                elif isinstance(reply, Done) and (reply.version, reply.layout) == (v, lay):
                    done = True
            # Everything acked: the receiver's Done follows (or already came).
            deadline = time.monotonic() + self.reply_timeout_s
            while not done and time.monotonic() < deadline:
                try:
                    reply = self._next_reply(max(0.01, deadline - time.monotonic()))
                except ConnectionError:
                    if not self._replies.empty():
                        raise
                    break  # no Done in time: offer again and send what is still missing
                done = isinstance(reply, Done) and (reply.version, reply.layout) == (v, lay)
            if done:
                dt = time.monotonic() - started
                self.stats.chunks_sent += sent_chunks
                self.stats.bytes_sent += sent_bytes
                self.stats.objects_done += 1
                self.stats.busy_s += dt
                return PushResult(v, lay, sent_chunks, sent_bytes, dt, first_sent)
        raise ConnectionError(f"{self.conn.peer}: version {v}/tp{lay} not complete after 5 offers")

    def _send_chunk(self, manifest: Manifest, index: int, source: ChunkSource) -> int:
        pieces = list(source.pieces(index))
        n = sum(memoryview(p).nbytes for p in pieces)
        key = (manifest.version, manifest.layout, index)
        if key in self._corrupt_once:  # fault injection for tests: one flipped byte on the wire
            self._corrupt_once.discard(key)
            bad = bytearray(b"".join(bytes(p) for p in pieces))
            bad[len(bad) // 2] ^= 0xFF
            pieces = [bad]
        self.conn.send(Chunk(manifest.version, manifest.layout, index, n), pieces)
        if self.pace_s:
            time.sleep(self.pace_s)
        return n


# --------------------------------------------------------------- receiving
@dataclass
class ServeContext:
    store: WeightStore
    name: str
    status: Callable[[], dict[str, Any]] = dict
    on_complete: Callable[[tuple[int, int]], None] = lambda key: None
    limits: Limits = field(default_factory=Limits)
    refused: dict[str, int] = field(default_factory=dict)  # connections and offers refused, by rule

    def count_refusal(self, kind: str) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1


def serve(conn: Conn, ctx: ServeContext, stop: threading.Event) -> None:
    """Answer one incoming connection until it closes (runs in its own thread)."""
    store = ctx.store
    offered: set[tuple[int, int]] = set()  # objects offered on this connection: the only ones it may send
    try:
        while not stop.is_set():
            try:
                msg = conn.recv(1.0)
            except TimeoutError:
                continue
            if isinstance(msg, Hello):
                newest = store.newest_complete()
                conn.send(State(have=store.have(), newest=-1 if newest is None else newest))
            elif isinstance(msg, StatusQuery):
                conn.send(Status(stats=ctx.status()))
            elif isinstance(msg, Offer):
                try:
                    manifest = Manifest.from_json(msg.manifest)
                    check_offer(manifest, ctx.limits)
                    obj, missing = store.begin(manifest)
                except (ManifestError, RejectError, Refused) as exc:
                    if isinstance(exc, Refused):
                        ctx.count_refusal(exc.kind)
                        log.warning("%s: refusing an offer from %s: %s", ctx.name, conn.peer, exc)
                    v, lay = msg.manifest.get("version", -1), msg.manifest.get("layout", -1)
                    conn.send(Reject(int(v) if isinstance(v, int) else -1,
                                     int(lay) if isinstance(lay, int) else -1, str(exc)))
                    continue
                offered.add(manifest.key)
                conn.send(Want(manifest.version, manifest.layout, missing))
                if obj.complete:
                    conn.send(Done(manifest.version, manifest.layout, manifest.checksum))
            elif isinstance(msg, Chunk):
                _receive_chunk(conn, ctx, msg, offered)
            else:
                raise Refused("protocol", f"unexpected {type(msg).__name__} from a sender")
    except ProtocolError as exc:
        # Refused by the admission policy, a failed authentication, a malformed frame:
        # the announced payload is never read, the connection goes.
        ctx.count_refusal(getattr(exc, "kind", "protocol"))
        log.warning("%s: dropping connection from %s: %s", ctx.name, conn.peer, exc)
    except ConnectionError:
        pass  # the sender went away; its successor-side logic reconnects
    finally:
        conn.close()


def _receive_chunk(conn: Conn, ctx: ServeContext, msg: Chunk, offered: set[tuple[int, int]]) -> None:
    store = ctx.store
    obj, nbytes = check_chunk(msg, store, offered)  # raises Refused before any byte of payload is read
    if not store.claim(obj, msg.index):
        # Already here (or arriving from another sender during a repair): read past it.
        conn.discard_payload(nbytes)
        conn.send(ChunkAck(msg.version, msg.layout, msg.index))
        return
    try:
        conn.recv_payload_into(obj.view(msg.index))
    except BaseException:
        store.abandon(obj, msg.index)  # a torn or forged chunk is missing again, never served
        raise
    try:
        store.commit(obj, msg.index)
    except ChecksumMismatch as exc:
        log.warning("%s: %s; asking %s to send it again", ctx.name, exc, conn.peer)
        conn.send(ChunkNack(msg.version, msg.layout, msg.index, str(exc)))
        return
    conn.send(ChunkAck(msg.version, msg.layout, msg.index))
    if obj.complete:
        conn.send(Done(msg.version, msg.layout, obj.manifest.checksum))
        ctx.on_complete(obj.key)
