"""The ZeroMQ socket patterns of the data plane, with the wire codec built in.

- RequestServer / RequestClient (ROUTER / DEALER): request-reply matched by a
  per-request id, so one client can pipeline many requests; a silent peer becomes a
  PeerTimeout, never a hang. AsyncRequestClient (async_client.py) is the asyncio twin (env-host tasks).
- ReliableSender / ReliableReceiver (reliable.py, importable from here): at-least-once delivery keyed by an id (e.g. a
  trajectory id) for data that must not be lost. Built on DEALER / ROUTER, not
  PUSH / PULL, because PUSH / PULL cannot carry the Ack back to the sender.

Framing on the socket (ROUTER adds/strips the peer identity in front)::

    request / reliable message:  [id, header, body, *buffers]
    reply:                       [id, header, body, *buffers]
    ack (receiver -> sender):    [header, body]            (an Ack message)

Every receiving object rejects bad frames (counted in ``rejected`` by reason, in the
``rlfleet_wire_rejected_frames_total`` Counter and the log) and keeps serving. A
frame above ``max_bytes`` is refused by libzmq itself (MAXMSGSIZE): it drops that
peer's connection before we see the frame, so such peers are not counted here.

A socket belongs to one thread (ZeroMQ sockets are not thread-safe). To serve several
sockets from one loop, register each object's ``.sock`` in a zmq.Poller and call its
``recv(0)`` when readable.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import zmq

from rlfleet.common.wire import curve as curve_setup
from rlfleet.common.wire.messages import (
    MAX_FRAME_BYTES,
    REJECT_REASONS,
    Message,
    WireError,
    decode,
    encode,
    record_rejection,
)
from rlfleet.common.wire.validation import DEFAULT_LIMITS, Limits, check_message, error_reply

log = logging.getLogger("rlfleet.wire")

Expect = type | tuple[type, ...] | None  # message type(s) a socket accepts; others rejected
DEFAULT_HWM = 1000  # messages queued per peer before send blocks / fails
_MAX_ID_BYTES = 256
REPLY_LINGER_MS = 500  # how long a closing server keeps sending queued replies


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (Z85 bytes, from zmq.curve_keypair()).

    A server needs public + secret; a client needs its own pair and server_public.
    Without a ZAP authenticator any client that knows server_public may connect:
    this encrypts traffic, it does not yet authenticate clients.
    """

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def generate(cls, server_public: bytes | None = None) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, server_public)


class PeerTimeout(TimeoutError):
    """The peer did not answer (or could not be reached) within timeout_s."""

    def __init__(self, address: str, timeout_s: float, what: str = "reply") -> None:
        super().__init__(f"no {what} from {address} within {timeout_s:.3g} s")
        self.address = address
        self.timeout_s = timeout_s


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind and return the actual endpoint ("tcp://10.0.0.5:0" -> "tcp://10.0.0.5:41231").

    Bind to the host's routable address when the endpoint is to be published in etcd;
    a wildcard bind ("tcp://0.0.0.0:0") returns the wildcard, which peers can't use.
    """
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def shared_context() -> zmq.Context:
    """The process's ZeroMQ context, able to hold as many sockets as the process may open
    files: ZeroMQ's default is 1,023 per context, and an env-host of a 1,000-rollout fleet
    holds two per rollout (its DEALER and that DEALER's monitor). The open-file limit is
    raised to its hard limit first (sockets are descriptors too)."""
    global _SHARED
    if _SHARED is None:
        ctx = zmq.Context.instance()
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            want = hard if hard != resource.RLIM_INFINITY else max(soft, _MAX_SOCKETS)
            if soft != resource.RLIM_INFINITY and soft < want:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
            limit = _MAX_SOCKETS if soft == resource.RLIM_INFINITY else min(_MAX_SOCKETS, soft)
            if ctx.get(zmq.MAX_SOCKETS) < limit:
                ctx.set(zmq.MAX_SOCKETS, limit)  # takes effect if no socket exists yet
        except (ImportError, OSError, ValueError, zmq.ZMQError) as exc:
            log.warning("keeping ZeroMQ's default socket limit: %s", exc)
        _SHARED = ctx
    return _SHARED


_SHARED: zmq.Context | None = None
_MAX_SOCKETS = 65536


def flush_before_exit(timeout_s: float = REPLY_LINGER_MS / 1000 + 0.5) -> bool:
    """Let what closed sockets left queued (a draining server's last replies) leave, then
    end the process's context; a daemon's last step before it exits. pyzmq does not end
    contexts at interpreter exit, so libzmq's I/O thread dies with the process and takes
    what it had not yet written: a large last reply never left.
    Bounded, because term() waits for every socket to be closed and one that a thread still
    holds must not keep the process alive. True: the context ended in time."""
    global _SHARED
    ctx, _SHARED = _SHARED, None
    if ctx is None:
        return True
    curve_setup.stop_guards(ctx)  # their threads close their sockets: term() need not wait on them
    ender = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    ender.start()
    ender.join(timeout_s)
    return not ender.is_alive()


def make_socket(kind: int, *, server: bool, ctx: zmq.Context | None = None,
                curve: CurveKeys | None = None, hwm: int = DEFAULT_HWM,
                max_bytes: int = MAX_FRAME_BYTES, edge: str = "") -> zmq.Socket:
    """A socket with the fleet's options; ``server`` is the binding side, and its ``edge``
    (common/wire/edges.py) says which roles' keys it admits under CURVE."""
    sock = (ctx or shared_context()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close() never blocks on unsent data; senders resend
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # per frame; bigger -> peer disconnected
    # ZMTP heartbeats notice a dead peer (kill -9, cable) and drop its pipe, so queued
    # messages stop going into a connection that will never deliver them.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
    if server:
        if kind == zmq.ROUTER:  # unroutable reply -> error we can see, not a silent drop
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    else:
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    if curve is None:
        curve_setup.arm(sock, server, edge)  # the process's keys, when CURVE is on (common/wire/curve.py)
    else:
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
        if server:
            sock.curve_server = True
        else:
            if curve.server_public is None:
                raise ValueError("a CURVE client needs CurveKeys.server_public")
            sock.curve_serverkey = curve.server_public
    return sock


# ----------------------------------------------------------------------------- helpers


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _ms_left(deadline: float | None) -> int | None:
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _id_from(frame: Any) -> str:
    raw = frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
    if not raw or len(raw) > _MAX_ID_BYTES:
        raise WireError("malformed", f"id frame of {len(raw)} bytes")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise WireError("malformed", "id frame is not ascii") from None


class _Endpoint:
    """What every wrapper shares: the socket, the rejection counters, closing.

    The binding side (``server``) publishes ``endpoint``; the connecting side may name
    several addresses, over which a DEALER spreads its messages round-robin.
    """

    def __init__(self, kind: int, address: str | Sequence[str], server: bool,
                 opts: dict[str, Any]) -> None:
        self.name: str = opts.pop("name")
        self.expect = opts.pop("expect", None)
        self.max_bytes: int = opts["max_bytes"]
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self.sock = make_socket(kind, server=server, **opts)
        try:
            if server:
                assert isinstance(address, str)
                self.endpoint = self.address = curve_setup.publish(bind(self.sock, address), self.sock)
            else:
                addresses = [address] if isinstance(address, str) else list(address)
                # Over several servers, queue only on live connections, so that round-robin
                # skips a dead one. Not with one: there is nowhere else to send, and with
                # IMMEDIATE libzmq discards replies that arrived but were not yet read when
                # the server disconnects (a draining daemon's last answers, lost under load).
                self.sock.setsockopt(zmq.IMMEDIATE, int(len(addresses) > 1))
                for a in addresses:
                    curve_setup.connect(self.sock, a)  # with the server key the address carries
                self.address = ",".join(addresses)
        except BaseException:
            self.sock.close(linger=0)
            raise

    limits: Limits = DEFAULT_LIMITS  # content checks (validation.py); a daemon may set its own

    def _decode(self, frames: list[Any], with_id: bool = True,
                peer: bytes | None = None) -> tuple[str, Message] | None:
        """Decode ``[id, header, body, *buffers]`` (``[header, ...]`` without id), content
        checked. None if rejected: counted, logged, refused to ``peer`` where the protocol
        has a refusal (``_refuse``), and the caller moves on to the next message."""
        rid, msg = "", None
        try:
            n_ids = 1 if with_id else 0
            if len(frames) < 2 + n_ids:
                raise WireError("truncated", f"{len(frames)} frames")
            rid = _id_from(frames[0]) if n_ids else ""
            msg = decode(frames[n_ids:], self.expect, max_bytes=self.max_bytes)
            check_message(msg, self.limits)
            return rid, msg
        except WireError as e:
            record_rejection(e, self.name, self.rejected)
            if msg is not None and peer is not None:
                self._refuse(peer, rid, msg, str(e)[:300])
            return None

    def _refuse(self, peer: bytes, rid: str, msg: Message, why: str) -> None:
        """Answer a decodable message rejected for its content; servers override."""

    def _recv_frames(self, deadline: float | None) -> list[Any] | None:
        """Next multipart message, or None once the deadline passes."""
        while self.sock.poll(_ms_left(deadline), zmq.POLLIN):
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
        return None

    def _send_routed(self, frames: list[Any]) -> bool:
        """Send from a ROUTER; False when the peer is gone or not keeping up."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return False
            raise

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- request / reply


class RequestServer(_Endpoint):
    """ROUTER side of request-reply. ``endpoint`` is the bound address to publish."""

    def __init__(self, address: str, *, expect: Expect = None, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None, hwm: int = DEFAULT_HWM,
                 max_bytes: int = MAX_FRAME_BYTES, name: str = "request-server", edge: str = "") -> None:
        opts = dict(expect=expect, ctx=ctx, curve=curve, hwm=hwm, max_bytes=max_bytes, name=name, edge=edge)
        super().__init__(zmq.ROUTER, address, True, opts)

    def recv(self, timeout: float | None = None) -> tuple[bytes, str, Message] | None:
        """Next valid request as (client_identity, request_id, msg); None on timeout.

        Rejected frames are skipped (and counted) within the same timeout.
        """
        deadline = _deadline(timeout)
        while (frames := self._recv_frames(deadline)) is not None:
            got = self._decode(frames[1:], peer=frames[0].bytes)
            if got is not None:
                return frames[0].bytes, got[0], got[1]
        return None

    def _refuse(self, peer: bytes, rid: str, msg: Message, why: str) -> None:
        reply = error_reply(msg, why)
        if reply is not None:
            self.reply(peer, rid, reply)  # type: ignore[arg-type]

    def reply(self, client_identity: bytes, request_id: str, msg: Message) -> bool:
        """Send the reply; False (logged) if that client is gone or not reading."""
        if self._send_routed([client_identity, request_id.encode(), *encode(msg)]):
            return True
        log.info("%s: reply %s dropped: client gone or not reading", self.name, request_id)
        return False

    def close(self) -> None:
        # Replies sent just before a drain closes the socket (the answers to the running
        # requests) must still leave: linger briefly instead of dropping them.
        self.sock.close(linger=REPLY_LINGER_MS)


class RequestClient(_Endpoint):
    """DEALER side of request-reply, with request ids and timeouts.

    With several addresses, requests are spread round-robin over connected servers.
    Replies to requests that timed out or were cancelled are discarded (``stale``).
    """

    def __init__(self, address: str | Sequence[str], *, expect: Expect = None,
                 ctx: zmq.Context | None = None, curve: CurveKeys | None = None,
                 hwm: int = DEFAULT_HWM, max_bytes: int = MAX_FRAME_BYTES,
                 name: str = "request-client") -> None:
        opts = dict(expect=expect, ctx=ctx, curve=curve, hwm=hwm, max_bytes=max_bytes, name=name)
        super().__init__(zmq.DEALER, address, False, opts)
        self._prefix = os.urandom(4).hex()  # ids unique fleet-wide: greppable across logs
        self._seq = itertools.count()
        self._outstanding: set[str] = set()
        self._ready: dict[str, Message] = {}  # replies that arrived while request() waited
        self.stale = 0

    def send(self, msg: Message, timeout_s: float = 10.0) -> str:
        """Send without waiting for the reply; returns the request id.

        Raises PeerTimeout if the send queue stays full for timeout_s (with several
        addresses: or no server is connected).
        """
        rid = f"{self._prefix}-{next(self._seq)}"
        frames = [rid.encode(), *encode(msg)]
        deadline = _deadline(timeout_s)
        while self.sock.poll(_ms_left(deadline), zmq.POLLOUT):
            try:  # NOBLOCK: the peer may vanish between poll and send
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._outstanding.add(rid)
            return rid
        raise PeerTimeout(self.address, timeout_s, "connected server")

    def cancel(self, request_id: str) -> None:
        """Stop waiting for this request; a late reply will be discarded."""
        self._outstanding.discard(request_id)
        self._ready.pop(request_id, None)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding) + len(self._ready)

    def _next_reply(self, deadline: float | None) -> tuple[str, Message] | None:
        while (frames := self._recv_frames(deadline)) is not None:
            got = self._decode(frames)
            if got is None:
                continue
            if got[0] in self._outstanding:
                self._outstanding.discard(got[0])
                return got
            self.stale += 1
            log.debug("%s: discarding stale reply %s", self.name, got[0])
        return None

    def poll_replies(self, timeout: float = 0.0) -> list[tuple[str, Message]]:
        """Replies that have arrived, waiting up to timeout for the first one."""
        out = list(self._ready.items())
        self._ready.clear()
        deadline = _deadline(0.0 if out else timeout)
        while (got := self._next_reply(deadline)) is not None:
            out.append(got)
            deadline = _deadline(0.0)
        return out

    def request(self, msg: Message, timeout_s: float) -> Message:
        """Send and wait for the matching reply; PeerTimeout after timeout_s."""
        deadline = time.monotonic() + timeout_s
        rid = self.send(msg, timeout_s)
        while (got := self._next_reply(deadline)) is not None:
            if got[0] == rid:
                return got[1]
            self._ready[got[0]] = got[1]  # a pipelined request's reply: keep for poll_replies
        self._outstanding.discard(rid)
        raise PeerTimeout(self.address, timeout_s)

