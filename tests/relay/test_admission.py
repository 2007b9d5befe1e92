"""A relay trusts no size a peer declares: hostile chunk headers and offers cost it nothing.

The relay under test is a real process (tests/relay/node_proc.py) where its memory is
measured (VmRSS), and an in-process `RelayNode` where hypothesis throws many headers at
it (allocations measured with tracemalloc).
"""

from __future__ import annotations

import shutil
import threading
import tracemalloc
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.relay.admission import Limits, Refused, check_offer
from rlfleet.relay.manifest import build_manifest
from rlfleet.relay.node import NodeConfig, RelayNode
from rlfleet.relay.protocol import Chunk, ChunkAck, Done, Hello, Offer, Reject, State, Want
from rlfleet.relay.shm import MISSING, object_stem
from rlfleet.relay.status import query_relay
from tests.integration.helpers import wait_for
from tests.relay.hostile import RawPeer, RelayProcess, frame, huge_manifest, rss_bytes

GIB = 1 << 30
MIB = 1 << 20
U64 = 2**64 - 1


@pytest.fixture
def relay_proc(tmp_path):
    procs = []

    def start(**kw):
        procs.append(RelayProcess(tmp_path, **kw))
        return procs[-1]

    yield start
    for p in procs:
        p.close()


def _greet(peer: RawPeer) -> State:
    peer.send(Hello("mallory"))
    state = peer.recv()
    assert isinstance(state, State)
    return state


def test_a_chunk_header_for_nothing_offered_costs_no_memory_and_drops_the_connection(relay_proc):
    relay = relay_proc()
    peer = RawPeer(relay.address)
    _greet(peer)
    before = rss_bytes(relay.pid)
    # 1 GiB announced for an object nobody offered; then the peer just keeps the connection open.
    peer.send(Chunk(version=7, layout=1, index=0, nbytes=GIB))
    peak, closed = before, False
    for _ in range(100):  # up to ~5 s, sampling the relay's memory meanwhile
        peak = max(peak, rss_bytes(relay.pid))
        if peer.closed_by_relay(0.05):
            closed = True
            break
    peak = max(peak, rss_bytes(relay.pid))
    assert peak - before < 64 * MIB, f"relay memory grew by {(peak - before) / MIB:.0f} MiB for a bare header"
    assert closed, "the relay kept the connection of a peer that sent a chunk for nothing it offered"
    stats = query_relay(relay.address, timeout=5)
    assert stats["refused"] == {"unoffered": 1}
    assert "no such object was offered on this connection" in relay.log()
    peer.close()


def test_an_offer_above_the_ceiling_is_rejected_before_any_allocation(relay_proc):
    relay = relay_proc(max_object_bytes=64 * MIB)
    peer = RawPeer(relay.address)
    _greet(peer)
    before = rss_bytes(relay.pid)
    peer.send(Offer(huge_manifest(3, GIB).to_json()))
    reply = peer.recv()
    assert isinstance(reply, Reject) and "more than this relay's ceiling of 67108864" in reply.reason
    # Offered within the ceiling, then a chunk header claiming more than the chunk the manifest names.
    peer.send(Offer(huge_manifest(4, 32 * MIB).to_json()))
    assert isinstance(peer.recv(), Want)
    peer.send(Chunk(version=4, layout=1, index=0, nbytes=GIB))
    assert peer.closed_by_relay(5), "an oversized chunk header did not drop the connection"
    assert rss_bytes(relay.pid) - before < 64 * MIB
    stats = query_relay(relay.address, timeout=5)
    assert stats["refused"] == {"oversize": 1, "bad_chunk": 1}, stats
    assert stats["progress"] == {"4/tp1": [0, 1]}  # version 3 never reached the store
    log = relay.log()
    assert "refusing an offer" in log and "the manifest says this chunk is 33554432 bytes" in log


@pytest.mark.parametrize("tensor,why", [
    ({"name": "w", "dtype": "<f4", "shape": [16], "offset": -64, "nbytes": 64}, "outside the version"),
    ({"name": "w", "dtype": "<f4", "shape": [16], "offset": 4096, "nbytes": 64}, "outside the version"),
    ({"name": "w", "dtype": "<f4", "shape": [2**40], "offset": 0, "nbytes": 2**42}, "outside the version"),
    ({"name": "w", "dtype": "<f4", "shape": [16], "offset": 0, "nbytes": 65}, "bytes for shape"),
])
def test_offers_whose_tensors_fall_outside_the_object_are_rejected(relay_proc, tensor, why):
    relay = relay_proc()
    peer = RawPeer(relay.address)
    _greet(peer)
    m = huge_manifest(5, 4096).to_json()
    m["tensors"] = [tensor]
    peer.send(Offer(m))
    reply = peer.recv()
    assert isinstance(reply, Reject) and why in reply.reason, reply
    assert query_relay(relay.address, timeout=5)["progress"] == {}


# ------------------------------------------------------- in-process, property-based
@pytest.fixture(scope="module")
def node():
    n = RelayNode(NodeConfig("relay-h", f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}",
                             max_object_bytes=64 * MIB)).start()
    yield n
    n.stop()
    shutil.rmtree(n.config.store_dir, ignore_errors=True)


def _small_version(version: int):
    data = np.random.default_rng(version).integers(0, 255, 4 * 4096 - 100, dtype=np.uint8)
    return build_manifest(version, {"w": data}, chunk_bytes=4096)  # 4 chunks, the last one short


MANIFEST, SOURCE = _small_version(7)
INTS = st.one_of(st.integers(-2**63, U64), st.sampled_from([-1, 0, 1, 3, 4, 4096, 3996, 2**31, 2**32, U64]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(version=st.one_of(st.just(7), INTS), layout=st.one_of(st.just(1), INTS), index=INTS, nbytes=INTS)
def test_no_chunk_header_allocates_what_it_declares(node, version, layout, index, nbytes):
    peer = RawPeer(node.address)
    try:
        _greet(peer)
        peer.send(Offer(MANIFEST.to_json()))
        assert isinstance(peer.recv(), Want)
        valid = (version, layout) == (7, 1) and 0 <= index < 4 and nbytes == [4096, 4096, 4096, 3996][index]
        refused_before = sum(node.stats()["refused"].values())
        tracemalloc.start()
        try:
            peer.send({"type": "Chunk", "version": version, "layout": layout, "index": index, "nbytes": nbytes})
            if valid:  # the one well-formed case: the relay waits for exactly these bytes
                peer.send_raw(b"".join(bytes(p) for p in SOURCE.pieces(*MANIFEST.chunk_range(index))))
                assert isinstance(peer.recv(), ChunkAck)
            else:
                assert peer.closed_by_relay(5), "a bad chunk header did not drop the connection"
                wait_for("the refusal to be counted",
                         lambda: sum(node.stats()["refused"].values()) == refused_before + 1, 5)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * MIB, f"{peak} bytes allocated for a header declaring {nbytes}"
    finally:
        peer.close()


def test_duplicate_chunks_are_read_past_and_acknowledged_once(node):
    manifest, src = _small_version(8)
    peer = RawPeer(node.address)
    _greet(peer)
    peer.send(Offer(manifest.to_json()))
    assert isinstance(peer.recv(), Want)
    payload = b"".join(bytes(p) for p in src.pieces(*manifest.chunk_range(0)))
    before = node.store.chunks_received
    for _ in range(3):
        peer.send(Chunk(8, 1, 0, len(payload)), payload)
        assert peer.recv() == ChunkAck(8, 1, 0)
    assert node.store.chunks_received == before + 1
    assert node.stats()["progress"]["8/tp1"] == [1, 4]
    peer.close()


def test_a_truncated_stream_leaves_the_chunk_missing_and_a_later_sender_completes_it(node):
    manifest, src = _small_version(9)
    chunk = lambda i: b"".join(bytes(p) for p in src.pieces(*manifest.chunk_range(i)))  # noqa: E731
    peer = RawPeer(node.address)
    _greet(peer)
    peer.send(Offer(manifest.to_json()))
    assert isinstance(peer.recv(), Want)
    peer.send_raw(frame(Chunk(9, 1, 1, 4096)) + chunk(1)[:1000])
    peer.close()  # mid-payload
    obj = node.store.get((9, 1))

    def offered_and_wanted_whole() -> RawPeer | None:
        # state[1] is MISSING before the node has even read the torn chunk too, so the
        # proof that the torn write was undone is a new sender being asked for chunk 1.
        again = RawPeer(node.address)
        _greet(again)
        again.send(Offer(manifest.to_json()))
        if again.recv() == Want(9, 1, [0, 1, 2, 3]):
            return again
        again.close()
        return None

    again = wait_for("a new sender to be asked for the torn chunk again", offered_and_wanted_whole, 10)
    assert obj.state[1] == MISSING
    assert not (node.store.dir / f"{object_stem(9, 1)}.json").exists()
    for i in range(4):
        again.send(Chunk(9, 1, i, len(chunk(i))), chunk(i))
        assert again.recv() == ChunkAck(9, 1, i)
    assert isinstance(again.recv(), Done)
    assert (node.store.dir / f"{object_stem(9, 1)}.json").exists()
    again.close()


def test_the_policy_is_one_function_both_transports_share():
    # serve() (link.py) is the only receiving end, for TCP and UCX alike; its checks are these.
    with pytest.raises(Refused) as exc:
        check_offer(huge_manifest(1, 2 * GIB), Limits(GIB))
    assert exc.value.kind == "oversize"
    check_offer(huge_manifest(1, GIB), Limits(GIB))  # at the ceiling: fine
    with pytest.raises(ValueError):
        Limits(0)


def test_a_peer_that_only_announces_a_huge_header_costs_little(relay_proc):
    relay = relay_proc()
    peer = RawPeer(relay.address)
    before = rss_bytes(relay.pid)
    peer.send_raw((16 << 20).to_bytes(4, "big") + b"\x81")  # announces a 16 MiB header, sends 1 byte
    done = threading.Event()
    samples = []

    def sample():
        while not done.is_set():
            samples.append(rss_bytes(relay.pid))
            done.wait(0.02)

    t = threading.Thread(target=sample)
    t.start()
    try:
        assert not peer.closed_by_relay(1.0)  # a slow sender may be legitimate: it waits
    finally:
        done.set()
        t.join()
    assert max(samples) - before < 8 * MIB
    peer.close()
