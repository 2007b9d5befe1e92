"""Both transports behind one interface: framing, scatter-gather payloads, dead peers; a UCX chain."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.relay.protocol import Chunk, ChunkAck, Hello
from rlfleet.relay.publisher import WeightPublisher
from rlfleet.relay.transport import get_transport, ucx_available
from tests.relay.fleet import RelayFleet, assert_holds, model_tensors

needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx not importable (pip install ucxx-cu12==0.52.0)")
TRANSPORTS = ["tcp", pytest.param("ucx", marks=needs_ucx)]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_headers_and_payloads_round_trip(name):
    t = get_transport(name)
    listener = t.listen("127.0.0.1")
    client = t.connect(listener.address, timeout=5)
    server = listener.accept(timeout=5)
    assert server is not None
    try:
        a, b = np.arange(1000, dtype=np.float32), np.arange(77, dtype=np.uint8)
        client.send(Hello("x"))
        client.send(Chunk(1, 1, 0, a.nbytes + b.nbytes), [a, b])  # two pieces, one payload
        assert server.recv(5) == Hello("x")
        head = server.recv(5)
        assert head == Chunk(1, 1, 0, a.nbytes + b.nbytes)
        buf = bytearray(head.nbytes)
        server.recv_payload_into(memoryview(buf), 5)
        assert bytes(buf) == a.tobytes() + b.tobytes()
        server.send(ChunkAck(1, 1, 0))
        assert client.recv(5) == ChunkAck(1, 1, 0)
        with pytest.raises(TimeoutError):
            client.recv(0.2)
        server.close()
        with pytest.raises(ConnectionError):
            client.recv(5)
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_connecting_to_nobody_is_a_connection_error(name):
    t = get_transport(name)
    listener = t.listen("127.0.0.1")
    address = listener.address
    listener.close()
    with pytest.raises(ConnectionError):
        t.connect(address, timeout=2).send(Hello("x"))


def test_unknown_transport_is_named():
    with pytest.raises(ValueError, match="unknown relay transport 'rdma'"):
        get_transport("rdma")


@needs_ucx
def test_chain_over_ucx(etcd, tmp_path):
    fleet = RelayFleet(etcd.members[0].endpoint, tmp_path, job="ucx", transport="ucx")
    try:
        ids = fleet.start_chain(2)
        assert all(fleet.address(r).startswith("ucx://") for r in ids)
        tensors = model_tensors(3)
        pub = WeightPublisher(fleet.store, fleet.job, transport="ucx", chunk_bytes=256 << 10, timeout_s=30)
        pub.publish(1, tensors)
        for rid in ids:
            assert_holds(fleet, rid, 1, tensors)
        pub.close()
    finally:
        fleet.close()


def test_tcp_send_survives_a_reader_thread_polling_with_timeouts():
    """A relay sends chunks on one thread while another reads acks with a timeout, on the
    same connection. Python's socket timeout is one mode per socket: when recv() set a
    timeout while the sender was in a blocking send to a full buffer, the send failed
    with EAGAIN ("Resource temporarily unavailable") or timed out, and the chain took a
    live relay for dead (seen at p=16 on a 16-core machine)."""
    import threading

    t = get_transport("tcp")
    listener = t.listen("127.0.0.1")
    sender = t.connect(listener.address, timeout=5)
    receiver = listener.accept(timeout=5)
    assert receiver is not None
    stop, ack_reader_errors = threading.Event(), []

    def read_acks() -> None:  # what the chain's ack reader does: short waits, nothing comes
        while not stop.is_set():
            try:
                sender.recv(0.001)
            except TimeoutError:
                pass
            except Exception as exc:  # noqa: BLE001
                ack_reader_errors.append(exc)
                return

    payload = np.zeros(256 << 10, dtype=np.uint8)  # many sends, each into a full buffer
    frames = 3000
    got = []

    def drain() -> None:  # a slow peer: the sender's buffer fills again and again
        for _ in range(frames):
            head = receiver.recv(30)
            receiver.discard_payload(head.nbytes, 30)
            got.append(head.layout)

    reader, drainer = threading.Thread(target=read_acks), threading.Thread(target=drain)
    reader.start()
    drainer.start()
    try:
        for i in range(frames):
            sender.send(Chunk(1, i, 0, payload.nbytes), [payload])
        drainer.join(60)
        assert got == list(range(frames)) and not ack_reader_errors
    finally:
        stop.set()
        reader.join(5)
        sender.close()
        receiver.close()
        listener.close()
