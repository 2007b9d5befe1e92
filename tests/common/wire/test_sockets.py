"""Socket patterns over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from rlfleet.common.wire import messages as wire
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.async_client import AsyncRequestClient
from rlfleet.common.wire.messages import (
    Abort,
    Ack,
    GenerateRequest,
    GenerateResult,
    RepackOrder,
    RolloutStats,
    ScoredTrajectory,
    Trajectory,
    Turn,
    encode,
)
from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender
from rlfleet.common.wire.sockets import CurveKeys, PeerTimeout, RequestClient, RequestServer, bind, make_socket
from rlfleet.tools.run.etcd_local import free_port

LOCAL = "tcp://127.0.0.1:0"
BIG = 5000  # int32 elements: 20 kB, sent as an out-of-band frame


def all_messages(n: int) -> list[wire.Message]:
    """One of each message type, arrays of n elements (test_wire has the edge cases)."""
    turn = Turn(Int32Array(range(n)), Int32Array(range(n)), Float32Array([-0.5] * n), 2, "o", "a")
    traj = Trajectory("t1", 1, "g1", "task", [turn, turn], 0.5, {"k": "v"}, "")
    msgs = [
        GenerateRequest("r1", "t1", Int32Array(range(n)), 16, 0.7, 0.9, seed=7),
        GenerateResult("r1", Int32Array(range(n)), Float32Array([-0.25] * n), 3, "stop"),
        Abort("r1"),
        traj,
        ScoredTrajectory(traj, 1.0),
        RolloutStats(3, 1, 2, 10, 100, 55.5, rollout_id="ro1", time=1.7e9),
        RepackOrder("o1", "ro1", "ro2", ["r1"]),
        Ack(["t1"], ok=True),
    ]
    assert {type(m) for m in msgs} == set(wire.MESSAGE_TYPES.values())
    return msgs


def _traj(i: int) -> Trajectory:
    return Trajectory(f"t{i}", i, "g", "task", [], float(i))


def _request(n: int = 3) -> GenerateRequest:
    return GenerateRequest("r", "t", Int32Array(range(n)), 4, 1.0, 1.0)


def _result(rid: str = "r") -> GenerateResult:
    return GenerateResult(rid, Int32Array([1, 2]), Float32Array([-0.5, -0.25]), 1, "stop")


class EchoServer:
    """A RequestServer answering every request with ``answer(msg)`` in a thread."""

    def __init__(self, server: RequestServer, answer=lambda m: m, delay_s: float = 0.0) -> None:
        self.server, self.answer, self.delay_s = server, answer, delay_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.server.recv(0.02)
            if got is not None:
                time.sleep(self.delay_s)
                self.server.reply(got[0], got[1], self.answer(got[2]))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.server.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    e = EchoServer(RequestServer(LOCAL))
    yield e
    e.close()


def test_bind_returns_the_ephemeral_endpoint() -> None:
    sock = make_socket(zmq.ROUTER, server=True)
    try:
        endpoint = bind(sock, "tcp://127.0.0.1:0")
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert sock.getsockopt(zmq.LINGER) == 0
    finally:
        sock.close()


@pytest.mark.parametrize("n", [10, BIG], ids=["inline", "out-of-band"])
def test_every_type_round_trips_through_sockets(echo: EchoServer, n: int) -> None:
    with RequestClient(echo.server.endpoint) as client:
        for msg in all_messages(n):
            got = client.request(msg, timeout_s=2)
            assert got == msg and type(got) is type(msg)
        assert client.outstanding == 0


def test_pipelined_requests_are_matched_by_id(echo: EchoServer) -> None:
    with RequestClient(echo.server.endpoint) as client:
        ids = {client.send(Abort(f"a{i}")): f"a{i}" for i in range(50)}
        # A blocking request in the middle keeps the pipelined replies for later.
        assert client.request(Abort("middle"), timeout_s=2) == Abort("middle")
        got: dict[str, wire.Message] = {}
        deadline = time.monotonic() + 2
        while len(got) < 50 and time.monotonic() < deadline:
            got.update(client.poll_replies(timeout=0.1))
        assert {rid: m.request_id for rid, m in got.items()} == ids  # type: ignore[union-attr]


def test_client_times_out_when_no_server() -> None:
    with RequestClient(f"tcp://127.0.0.1:{free_port()}") as client:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout) as e:  # no server: only the timeout can end the wait
            client.request(Abort("x"), timeout_s=0.3)
        assert time.monotonic() - t0 > 0.25  # not given up before its timeout
        assert e.value.timeout_s == 0.3 and "127.0.0.1" in e.value.address
        assert isinstance(e.value, TimeoutError)


def test_late_reply_is_discarded() -> None:
    slow = EchoServer(RequestServer(LOCAL), delay_s=0.4)
    try:
        with RequestClient(slow.server.endpoint) as client:
            with pytest.raises(PeerTimeout):  # had it waited for the reply, it would have it
                client.request(Abort("first"), timeout_s=0.2)
            # The next request's wait sees the late "first" reply and skips it.
            assert client.request(Abort("second"), timeout_s=2) == Abort("second")
            assert client.stale == 1
    finally:
        slow.close()


def _garbage() -> list[list[bytes]]:
    header, body = encode(Abort("x"))
    tid = int(wire.MessageType.ABORT)
    return [
        [b"rid"],  # no payload at all
        [b"rid", header],  # truncated
        [b"rid", b"\x93\x01\x01", body],  # header array claims 3 items, has 2
        [b"rid", msgspec.msgpack.encode([9, tid, 0]), body],  # bad version
        [b"rid", msgspec.msgpack.encode([1, 77, 0]), body],  # unknown type
        [b"rid", header, body[:-1]],  # truncated body
        [b"rid", header, b"\x80\x04\x95garbage-pickle."],  # pickle
        [b"\xff\xfe", header, body],  # request id is not ascii
        [b"rid", header, body, b"extra"],  # extra frame
        [b"rid", *encode(_traj(1))],  # a valid message of a type this socket does not take
    ]


def _wait_for(cond, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def test_server_survives_garbage_and_counts_it() -> None:
    before = {r: wire.REJECTED_FRAMES.labels(reason=r)._value.get() for r in wire.REJECT_REASONS}
    srv = EchoServer(RequestServer(LOCAL, expect=(Abort, GenerateRequest)))
    raw = make_socket(zmq.DEALER, server=False)
    raw.connect(srv.server.endpoint)
    try:
        for frames in _garbage():
            raw.send_multipart(frames)
        with RequestClient(srv.server.endpoint) as client:
            assert client.request(Abort("ok"), timeout_s=2) == Abort("ok")
        _wait_for(lambda: sum(srv.server.rejected.values()) == len(_garbage()))
        rejected = srv.server.rejected
        assert rejected["truncated"] == 4 and rejected["bad_version"] == 1
        assert rejected["unknown_type"] == 1 and rejected["unexpected_type"] == 1
        assert rejected["malformed"] == 3
        after = {r: wire.REJECTED_FRAMES.labels(reason=r)._value.get() for r in wire.REJECT_REASONS}
        assert {r: after[r] - before[r] for r in after if after[r] != before[r]} == {
            r: n for r, n in rejected.items() if n
        }
    finally:
        raw.close()
        srv.close()


def test_oversized_frames_drop_the_peer_not_the_server() -> None:
    srv = EchoServer(RequestServer(LOCAL, max_bytes=64 * 1024))
    raw = make_socket(zmq.DEALER, server=False)
    raw.connect(srv.server.endpoint)
    try:
        raw.send_multipart([b"rid", *encode(_request(BIG * 4))])  # 80 kB frame
        with RequestClient(srv.server.endpoint) as client:
            assert client.request(_request(10), timeout_s=2) == _request(10)
    finally:
        raw.close()
        srv.close()


def test_reply_to_vanished_client_is_reported_not_raised() -> None:
    with RequestServer(LOCAL) as server:
        assert server.reply(b"\x00gone", "r1", Abort("x")) is False


def _pump(sender: ReliableSender, receiver: ReliableReceiver, seen: list[str],
          ack_if=lambda key: True) -> None:
    """One round of a same-thread sender/receiver pair; acks what ack_if allows."""
    sender.poll(0.005)
    keys = []
    for key, msg in receiver.drain(0.005):
        assert isinstance(msg, Trajectory) and msg.trajectory_id == key
        seen.append(key)
        if ack_if(key):
            keys.append(key)
    receiver.ack(keys)


def _recv_pumping(receiver: ReliableReceiver, sender: ReliableSender, timeout: float = 2.0):
    """receiver.recv, while the (same-thread) sender gets its poll() calls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sender.poll(0.005)
        got = receiver.recv(0.005)
        if got is not None:
            return got
    return None


def test_reliable_delivery_when_receiver_starts_late() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with ReliableSender(address, resend_after_s=0.2) as sender:
        for i in range(200):
            sender.send(f"t{i}", _traj(i))
        sender.poll(0.1)
        assert sender.pending() == 200  # nobody listening: all kept
        with ReliableReceiver(address, expect=Trajectory) as receiver:
            seen: list[str] = []
            deadline = time.monotonic() + 5
            while sender.pending() and time.monotonic() < deadline:
                _pump(sender, receiver, seen)
        assert sender.pending() == 0 and sender.flush(0.1)
        assert set(seen) == {f"t{i}" for i in range(200)}


def test_reliable_resends_what_was_not_acked() -> None:
    with ReliableReceiver(LOCAL) as receiver, \
            ReliableSender(receiver.endpoint, resend_after_s=0.1) as sender:
        for i in range(200):
            sender.send(f"t{i}", _traj(i))
        seen: list[str] = []
        # Drop (don't ack) the first delivery of every id, as a receiver that died
        # before journaling would.
        deadline = time.monotonic() + 5
        while sender.pending() and time.monotonic() < deadline:
            _pump(sender, receiver, seen, ack_if=lambda k: seen.count(k) > 1)
        assert sender.pending() == 0
        assert set(seen) == {f"t{i}" for i in range(200)}
        assert len(seen) >= 400 and sender.resends >= 200


def test_reliable_survives_receiver_restart() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    seen: list[str] = []
    with ReliableSender(address, resend_after_s=0.1, max_backoff_s=0.2) as sender:
        first = ReliableReceiver(address)
        for i in range(100):
            sender.send(f"t{i}", _traj(i))
        got = _recv_pumping(first, sender)
        assert got is not None
        seen.append(got[0])
        first.close()  # died holding unacked messages (and more queued in its socket)
        deadline = time.monotonic() + 2
        while True:  # the port may take a moment to be free again
            try:
                second = ReliableReceiver(address)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with second:
            deadline = time.monotonic() + 5
            while sender.pending() and time.monotonic() < deadline:
                _pump(sender, second, seen)
        assert sender.pending() == 0
        assert set(seen) == {f"t{i}" for i in range(100)}


def test_refused_ids_are_reported_not_resent() -> None:
    with ReliableReceiver(LOCAL) as receiver, ReliableSender(receiver.endpoint) as sender:
        sender.send("t1", _traj(1))
        got = _recv_pumping(receiver, sender)
        assert got is not None and got[0] == "t1"
        receiver.ack(["t1"], ok=False, error="schema: no turns")
        assert sender.flush(2)
        assert sender.failed == [("t1", "schema: no turns")]


def test_reliable_receiver_survives_garbage() -> None:
    with ReliableReceiver(LOCAL, expect=Trajectory) as receiver:
        raw = make_socket(zmq.DEALER, server=False)
        raw.connect(receiver.endpoint)
        try:  # (closing raw at once would discard its unsent frames: LINGER 0)
            for frames in _garbage()[:-1]:
                raw.send_multipart(frames)
            raw.send_multipart([b"a1", *encode(Abort("x"))])  # valid, unexpected type
            with ReliableSender(receiver.endpoint) as sender:
                sender.send("t7", _traj(7))
                got = _recv_pumping(receiver, sender)
                assert got is not None and got[0] == "t7" and got[1] == _traj(7)
                receiver.ack(["t7"])
                assert sender.flush(2)
            _wait_for(lambda: receiver.recv(0.01) is None and sum(receiver.rejected.values()) == 10)
        finally:
            raw.close()
        assert receiver.rejected["unexpected_type"] >= 1  # Abort headers: refused before the body


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_curve_round_trip() -> None:
    server_keys = CurveKeys.generate()
    srv = EchoServer(RequestServer(LOCAL, curve=server_keys))
    try:
        client_keys = CurveKeys.generate(server_public=server_keys.public)
        with RequestClient(srv.server.endpoint, curve=client_keys) as client:
            assert client.request(_request(BIG), timeout_s=2) == _request(BIG)
        # Plain-text and wrong-key clients never complete the handshake.
        with RequestClient(srv.server.endpoint) as plain:
            with pytest.raises(PeerTimeout):
                plain.request(Abort("x"), timeout_s=0.3)
        wrong = CurveKeys.generate(server_public=CurveKeys.generate().public)
        with RequestClient(srv.server.endpoint, curve=wrong) as bad:
            with pytest.raises(PeerTimeout):
                bad.request(Abort("x"), timeout_s=0.3)
    finally:
        srv.close()
    with pytest.raises(ValueError):
        make_socket(zmq.DEALER, server=False, curve=CurveKeys.generate()).close()


def test_async_client_concurrent_requests_and_timeout(echo: EchoServer) -> None:
    async def main() -> None:
        client = AsyncRequestClient(echo.server.endpoint, expect=GenerateResult)
        try:
            calls = [client.request(_result(f"r{i}"), timeout_s=2) for i in range(20)]
            results = await asyncio.gather(*calls)
            assert [r.request_id for r in results] == [f"r{i}" for i in range(20)]
            # one by one: each reply must wake the loop by itself (no watchdog reads)
            for i in range(20):
                assert (await client.request(_result(f"s{i}"), timeout_s=0.9)).request_id == f"s{i}"
            assert client.late_reads == 0
        finally:
            client.close()
        absent = AsyncRequestClient(f"tcp://127.0.0.1:{free_port()}")
        try:
            with pytest.raises(PeerTimeout) as e:  # no server: only the timeout can end the wait
                await absent.request(Abort("x"), 0.2)
            assert e.value.timeout_s == 0.2
        finally:
            absent.close()

    asyncio.run(main())


def test_ack_type_is_the_only_thing_a_sender_accepts() -> None:
    # A sender pointed at the wrong kind of peer counts what comes back, keeps going.
    with ReliableReceiver(LOCAL) as receiver, ReliableSender(receiver.endpoint) as sender:
        sender.send("t1", _traj(1))
        got = _recv_pumping(receiver, sender)
        assert got is not None
        identity = receiver._senders["t1"]
        receiver.sock.send_multipart([identity, *encode(Abort("not an ack"))])
        receiver.ack(["t1"])
        assert sender.flush(2)
        assert sender.rejected["unexpected_type"] == 1


def test_take_acked_names_the_acknowledged_keys():
    from rlfleet.common.wire.messages import Abort
    from rlfleet.common.wire.reliable import ReliableReceiver, ReliableSender

    receiver = ReliableReceiver("tcp://127.0.0.1:0")
    sender = ReliableSender(receiver.endpoint, resend_after_s=0.2)
    try:
        sender.send("a", Abort("a"))
        sender.send("b", Abort("b"))
        got = {}
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            for key, _ in receiver.drain(0.05):
                got[key] = True
            sender.poll(0.01)
        receiver.ack(["a"])
        receiver.ack(["b"], ok=False, error="no")
        acked = []
        while len(acked) < 2 and time.monotonic() < deadline:
            sender.poll(0.05)
            acked += sender.take_acked()
        assert sorted(acked) == [("a", True, ""), ("b", False, "no")]
        assert sender.take_acked() == [] and sender.pending() == 0
    finally:
        sender.close()
        receiver.close()


def test_the_shared_context_holds_more_sockets_than_zeromqs_default_1023():
    # An env-host of a 1,000-rollout fleet holds a DEALER and its monitor per rollout.
    import zmq

    from rlfleet.common.wire.sockets import make_socket

    socks = [make_socket(zmq.DEALER, server=False) for _ in range(1100)]
    try:
        assert len(socks) == 1100
    finally:
        for sock in socks:
            sock.close()


# A server that answers one request and exits at once, the way a daemon does at the end
# of a drain: close (with its reply linger), then flush_before_exit (tools/cli.py).
_ANSWER_AND_EXIT = """
import sys
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import GenerateResult
from rlfleet.common.wire.sockets import RequestServer, flush_before_exit
n = int(sys.argv[1])
server = RequestServer("tcp://127.0.0.1:0")
print(server.endpoint, flush=True)
identity, rid, _ = server.recv(30)
server.reply(identity, rid, GenerateResult(rid, Int32Array.frombuffer(bytes(4 * n)),
                                           Float32Array.frombuffer(bytes(4 * n)), 0, "abort"))
server.close()
flush_before_exit()
"""


@pytest.mark.parametrize("tokens", [4, 8 << 20], ids=["small", "64MB"])
def test_a_reply_sent_as_the_server_exits_arrives_though_read_after_the_exit(tokens: int) -> None:
    """Small: the reply is in the client's queue when the server disconnects, and read only
    after (a busy client): with ZMQ_IMMEDIATE libzmq dropped it. 64 MB: the reply is not
    yet written when the server's process exits: without ending the context it never was."""
    import subprocess
    import sys

    from rlfleet.common.wire.validation import Limits

    server = subprocess.Popen([sys.executable, "-c", _ANSWER_AND_EXIT, str(tokens)],
                              stdout=subprocess.PIPE, text=True)
    try:
        with RequestClient(server.stdout.readline().strip()) as client:
            client.limits = Limits(max_tokens=tokens)
            rid = client.send(Abort("x"), timeout_s=10)
            assert server.wait(30) == 0
            got = dict(client.poll_replies(10.0))
            assert rid in got and len(got[rid].token_ids) == tokens
    finally:
        server.kill()
        server.wait()
