"""The chunk transport over a job secret: who may talk to a relay, and what a forged frame costs."""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import uuid

import numpy as np
import pytest

from rlfleet.relay.auth import MAGIC, NONCE_BYTES, TAG_BYTES, AuthError
from rlfleet.relay.link import Link
from rlfleet.relay.manifest import build_manifest
from rlfleet.relay.node import NodeConfig, RelayNode
from rlfleet.relay.protocol import Chunk, ChunkAck, Hello, Offer, ProtocolError, State, Want
from rlfleet.relay.publisher import PublishTimeout, WeightPublisher, _FullSource
from rlfleet.relay.shm import MISSING, object_stem
from rlfleet.relay.transport import TcpTransport, get_transport
from tests.integration.helpers import wait_for
from tests.relay.fleet import assert_holds, model_tensors
from tests.relay.hostile import RawPeer, frame

SECRET = b"s" * 16 + os.urandom(16)
OTHER = b"o" * 16 + os.urandom(16)


@pytest.fixture
def node():
    n = RelayNode(NodeConfig("relay-a", f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}", secret=SECRET)).start()
    yield n
    n.stop()
    shutil.rmtree(n.config.store_dir, ignore_errors=True)


def _refusals(node, kind: str = "auth") -> int:
    return node.stats()["refused"].get(kind, 0)


def _version(version: int = 1):
    data = np.random.default_rng(version).integers(0, 255, 5 * 4096, dtype=np.uint8)
    return build_manifest(version, {"w": data}, chunk_bytes=4096)


def test_a_peer_with_the_secret_pushes_a_version(node):
    manifest, src = _version()
    link = Link(TcpTransport(SECRET).connect(node.address), "trainer", role="publisher")
    result = link.push(manifest, _FullSource(manifest, src))
    assert result.chunks_sent == manifest.n_chunks
    assert node.store.get(manifest.key).complete and node.stats()["authenticated"]
    assert node.stats()["refused"] == {}
    link.close()


def test_a_peer_without_the_secret_is_refused_at_the_handshake(node, caplog):
    conn = TcpTransport(None).connect(node.address)
    with pytest.raises(ProtocolError, match="this relay needs the job secret"):
        Link(conn, "intruder", reply_timeout_s=5)
    wait_for("the refusal to be counted", lambda: _refusals(node) == 1, 5)
    # Logged on the relay's serve thread after the count: wait for it too.
    wait_for("the refusal to be logged", lambda: "peer sent no authentication handshake" in caplog.text, 5)
    assert node.store.have() == []


def test_a_peer_with_another_secret_is_refused_on_both_sides(node, caplog):
    with pytest.raises(AuthError, match="holds another job secret"):
        TcpTransport(OTHER).connect(node.address)  # the relay's proof does not check out for it
    wait_for("the relay to count the abandoned handshake", lambda: _refusals(node) == 1, 5)
    # One that ignores the relay's proof and answers anyway is refused by the relay's check.
    peer = RawPeer(node.address)
    cn = os.urandom(NONCE_BYTES)
    peer.send_raw(MAGIC + cn)
    sn = peer.recv_exact(len(MAGIC) + NONCE_BYTES + TAG_BYTES)[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    peer.send_raw(hmac.new(OTHER, b"client" + cn + sn, hashlib.sha256).digest())
    assert peer.closed_by_relay(5)
    wait_for("the second refusal to be counted", lambda: _refusals(node) == 2, 5)
    assert "peer's handshake proof is wrong" in caplog.text


def test_a_replayed_handshake_is_refused(node):
    honest = RawPeer(node.address, SECRET)  # records every byte it sends
    honest.send(Hello("trainer"))
    assert isinstance(honest.recv(), State)
    honest.close()
    replay = RawPeer(node.address)
    for data in honest.sent_raw:  # the same client nonce, proof and first frame, byte for byte
        try:
            replay.send_raw(data)
        except OSError:
            break
    assert replay.closed_by_relay(5)
    wait_for("the replay to be refused and counted", lambda: _refusals(node) == 1, 5)
    assert node.stats()["refused"] == {"auth": 1}


def test_a_replayed_frame_within_a_connection_is_refused(node):
    peer = RawPeer(node.address, SECRET)
    peer.send(Hello("trainer"))
    assert isinstance(peer.recv(), State)
    peer.send_raw(peer.sent_raw[-1])  # the Hello frame again, tags and all
    assert peer.closed_by_relay(5)
    wait_for("the replayed frame to be refused", lambda: _refusals(node) == 1, 5)


def test_a_tampered_chunk_drops_the_connection_and_is_never_published(node, caplog):
    manifest, src = _version(2)
    good = [b"".join(bytes(p) for p in src.pieces(*manifest.chunk_range(i))) for i in range(manifest.n_chunks)]
    peer = RawPeer(node.address, SECRET)
    peer.send(Hello("trainer"))
    assert isinstance(peer.recv(), State)
    peer.send(Offer(manifest.to_json()))
    assert isinstance(peer.recv(), Want)
    for i in range(manifest.n_chunks - 1):
        peer.send(Chunk(2, 1, i, len(good[i])), good[i])
        assert peer.recv() == ChunkAck(2, 1, i)
    # The last chunk changed on its way (one bit), its tag computed over the original.
    last = manifest.n_chunks - 1
    bad = bytearray(good[last])
    bad[100] ^= 1
    peer.send(Chunk(2, 1, last, len(bad)), bytes(bad), tag_payload=good[last])
    assert peer.closed_by_relay(5), "a forged chunk did not drop the connection"
    wait_for("the forgery to be counted", lambda: _refusals(node) == 1, 5)
    assert "authentication tag does not match" in caplog.text
    obj = node.store.get(manifest.key)
    assert not obj.complete and obj.state[last] == MISSING
    assert not (node.store.dir / f"{object_stem(2, 1)}.json").exists()  # no reader can see it
    # An honest sender then completes it with the right bytes.
    link = Link(TcpTransport(SECRET).connect(node.address), "trainer", role="publisher")
    assert link.push(manifest, _FullSource(manifest, src)).chunks_sent == 1
    assert bytes(obj.view(last)) == good[last]
    link.close()


def test_a_frame_without_tags_after_the_handshake_is_refused(node):
    peer = RawPeer(node.address, SECRET)
    peer.send_raw(frame(Hello("trainer")) * 3)  # authenticated connection, untagged frames
    assert peer.closed_by_relay(5)
    wait_for("the untagged frame to be refused", lambda: _refusals(node) == 1, 5)


def test_ucx_with_a_job_secret_is_refused_not_downgraded():
    with pytest.raises(RuntimeError, match="cannot authenticate peers"):
        get_transport("ucx", SECRET)


def test_a_chain_of_relay_daemons_with_a_job_secret(fleet, tmp_path, monkeypatch):
    secret_file = tmp_path / "job.secret"
    secret_file.write_bytes(SECRET.hex().encode())
    secret_file.chmod(0o600)
    ids = fleet.start_chain(2, RLFLEET_JOB_SECRET_FILE=str(secret_file))
    tensors = model_tensors(4)
    # Without the secret nobody gets in: not the trainer, not a status query.
    intruder = WeightPublisher(fleet.store, fleet.job, chunk_bytes=64 << 10, timeout_s=2)
    with pytest.raises(PublishTimeout, match="needs the job secret"):
        intruder.publish(1, tensors)
    monkeypatch.setenv("RLFLEET_JOB_SECRET_FILE", str(secret_file))
    pub = WeightPublisher(fleet.store, fleet.job, chunk_bytes=64 << 10, timeout_s=30)
    pub.publish(1, tensors)
    for rid in ids:
        assert_holds(fleet, rid, 1, tensors)
    stats = fleet.stats("relay-0")
    assert stats["authenticated"] and stats["refused"].get("auth", 0) >= 1
    pub.close()
