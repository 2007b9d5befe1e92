"""Weight store and reader: complete-only visibility, read holds, freeing (real etcd, real shm)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.relay.manifest import build_manifest
from rlfleet.relay.reader import WeightReader, WeightsUnavailable
from rlfleet.relay.shm import RejectError, WeightStore
from tests.integration.helpers import wait_for

JOB = "shm"


@pytest.fixture
def local(etcd):
    """A weight store registered as relay 'r0' on host 'h0', and an etcd client."""
    directory = f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}/r0"
    ws = WeightStore(directory, keep_versions=1)
    store = EtcdStore(etcd.members[0].endpoint)
    store.put(JobKeys(JOB).member("relay", "r0"), {"id": "r0", "host": "h0", "shm_dir": directory,
                                                   "state": "running", "addresses": {}})
    yield ws, store
    ws.close()
    store.close()
    shutil.rmtree(os.path.dirname(directory), ignore_errors=True)


def _receive(ws: WeightStore, version: int, tensors, upto: int | None = None):
    """What a receiver does: begin, then write + verify chunks (all, or the first `upto`)."""
    m, src = build_manifest(version, tensors, chunk_bytes=4096)
    obj, missing = ws.begin(m)
    for i in missing[:upto]:
        assert ws.claim(obj, i)
        start, end = m.chunk_range(i)
        obj.view(i)[:] = b"".join(bytes(p) for p in src.pieces(start, end))
        ws.commit(obj, i)
    return m, obj


def test_a_partial_version_is_never_visible(local):
    ws, store = local
    tensors = {"w": np.random.default_rng(1).standard_normal(10_000).astype(np.float32)}
    reader = WeightReader(store, JOB, "h0")
    m, obj = _receive(ws, 4, tensors, upto=5)
    assert 0 < obj.n_present < m.n_chunks
    assert reader.newest() is None
    with pytest.raises(WeightsUnavailable, match="no complete version"):
        with reader.open():
            pass
    with pytest.raises(WeightsUnavailable, match="version 4"):
        with reader.open(4):
            pass
    for i in range(5, m.n_chunks):  # the rest arrives
        assert ws.claim(obj, i)
        start, end = m.chunk_range(i)
        obj.view(i)[:] = tensors["w"].view(np.uint8)[start:end]
        ws.commit(obj, i)
    assert reader.newest() == 4
    with reader.open() as view:
        assert view.version == 4 and np.array_equal(view.tensors["w"], tensors["w"])
        assert not view.tensors["w"].flags.writeable
        with pytest.raises(ValueError):
            view.tensors["w"][0] = 1.0
        view.verify()


def test_a_held_version_is_not_freed_until_released(local):
    ws, store = local
    reader = WeightReader(store, JOB, "h0")
    v1 = {"w": np.full(5000, 1.0, dtype=np.float32)}
    _receive(ws, 1, v1)
    with reader.open(1) as view:
        _receive(ws, 2, {"w": np.full(5000, 2.0, dtype=np.float32)})
        assert ws.collect() == []            # keep_versions=1, but v1 is held
        assert np.all(view.tensors["w"] == 1.0)
        assert reader.newest() == 2          # the newer one is visible meanwhile
    assert ws.collect() == [(1, 1)]
    assert reader.versions() == [2]
    with pytest.raises(WeightsUnavailable, match="no longer"):
        with reader.open(1):
            pass


def test_a_reader_killed_while_holding_releases_its_hold(local, tmp_path):
    ws, store = local
    _receive(ws, 1, {"w": np.zeros(3000, dtype=np.float32)})
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from rlfleet.common.control.etcd_store import EtcdStore\n"
        "from rlfleet.relay.reader import WeightReader\n"
        f"r = WeightReader(EtcdStore({store.describe()!r}), {JOB!r}, 'h0')\n"
        "with r.open(1):\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"holding"
        _receive(ws, 2, {"w": np.ones(3000, dtype=np.float32)})
        assert ws.collect() == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_for("v1 freed after its reader died", lambda: ws.collect() == [(1, 1)], 5)


def test_same_version_with_other_contents_is_refused(local):
    ws, _ = local
    _receive(ws, 7, {"w": np.zeros(100, dtype=np.float32)})
    other, _ = build_manifest(7, {"w": np.ones(100, dtype=np.float32)}, chunk_bytes=4096)
    with pytest.raises(RejectError, match="refusing different contents"):
        ws.begin(other)
    same, _ = build_manifest(7, {"w": np.zeros(100, dtype=np.float32)}, chunk_bytes=4096)
    assert ws.begin(same)[1] == []  # already complete: nothing missing
