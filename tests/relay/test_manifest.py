"""Manifest: layout, chunk digests, and precise errors for bad input (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.relay.manifest import ALIGN, ChecksumMismatch, Manifest, ManifestError, build_manifest, tensor_views
from rlfleet.relay.reshard import shard_tensors, split_dim
from tests.relay.fleet import model_tensors


def _flat(manifest, src) -> bytearray:
    buf = bytearray(manifest.total_bytes)
    for i in range(manifest.n_chunks):
        start, end = manifest.chunk_range(i)
        buf[start:end] = b"".join(bytes(p) for p in src.pieces(start, end))
    return buf


def test_layout_roundtrip_and_alignment():
    tensors = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 5), dtype=np.float16),
               "c": np.arange(7, dtype=np.int64)[::2], "empty": np.zeros((0, 4), dtype=np.float32)}
    m, src = build_manifest(3, tensors, chunk_bytes=16)
    assert all(t.offset % ALIGN == 0 for t in m.tensors)
    assert m.n_chunks == -(-m.total_bytes // 16)
    views = tensor_views(m, _flat(m, src))
    for name, arr in tensors.items():
        assert views[name].dtype == arr.dtype and np.array_equal(views[name], arr)
    again = Manifest.loads(m.dumps())
    assert again == m


def test_every_chunk_verifies_and_a_flipped_byte_is_caught():
    m, src = build_manifest(1, {"w": np.random.default_rng(0).standard_normal(1000)}, chunk_bytes=1024)
    buf = _flat(m, src)
    for i in range(m.n_chunks):
        m.verify_chunk(i, memoryview(buf)[slice(*m.chunk_range(i))])
    buf[1500] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="chunk 1"):
        m.verify_chunk(1, memoryview(buf)[slice(*m.chunk_range(1))])


@pytest.mark.parametrize("tensors, message", [
    ({"w": [1.0, 2.0]}, "expected a numpy.ndarray, got list"),
    ({"w": np.array([object()])}, "holds Python objects"),
    ({"w": np.arange(3, dtype=">f4")}, "big-endian"),
    ({"": np.zeros(3)}, "non-empty strings"),
])
def test_bad_tensors_are_refused_with_the_reason(tensors, message):
    with pytest.raises(ManifestError, match=message):
        build_manifest(0, tensors, chunk_bytes=1024)


def test_bad_version_and_chunk_size():
    with pytest.raises(ManifestError, match="version must be an int >= 0"):
        build_manifest(-1, {"w": np.zeros(2)}, chunk_bytes=8)
    with pytest.raises(ManifestError, match="chunk_bytes must be > 0"):
        build_manifest(0, {"w": np.zeros(2)}, chunk_bytes=0)


def test_tampered_manifests_are_refused():
    m, _ = build_manifest(2, {"w": np.zeros(100, dtype=np.float32)}, chunk_bytes=64)
    d = m.to_json()
    with pytest.raises(ManifestError, match="does not match its chunk digests"):
        Manifest.from_json({**d, "chunks": ["0" * 16] + d["chunks"][1:]})
    with pytest.raises(ManifestError, match="outside the version"):
        Manifest.from_json({**d, "tensors": [{**d["tensors"][0], "offset": 10**9}]})
    with pytest.raises(ManifestError, match="format"):
        Manifest.from_json({**d, "format": 99})
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_json({"format": 1})
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.loads(b"{nope")


def test_tensor_parallel_split_rules():
    t = model_tensors(0, layers=1, hidden=64, vocab=128)
    assert split_dim("model.layers.0.self_attn.q_proj.weight", (64, 64), 2) == 0
    assert split_dim("model.layers.0.self_attn.o_proj.weight", (64, 64), 2) == 1
    assert split_dim("model.layers.0.mlp.down_proj.weight", (64, 128), 2) == 1
    assert split_dim("model.norm.weight", (64,), 2) is None
    assert split_dim("model.layers.0.self_attn.q_proj.weight", (63, 64), 2) is None  # not divisible
    items, replicated = shard_tensors(t, 2)
    by = {(n, r): a for n, a, r in items}
    q = t["model.layers.0.self_attn.q_proj.weight"]
    o = t["model.layers.0.self_attn.o_proj.weight"]
    assert np.array_equal(np.concatenate([by[("model.layers.0.self_attn.q_proj.weight", r)] for r in (0, 1)], 0), q)
    assert np.array_equal(np.concatenate([by[("model.layers.0.self_attn.o_proj.weight", r)] for r in (0, 1)], 1), o)
    assert "model.norm.weight" in replicated
    assert np.array_equal(by[("model.norm.weight", 1)], t["model.norm.weight"])
