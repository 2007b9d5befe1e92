"""weights/latest on a real etcd: one transaction per published version, never backwards."""

from __future__ import annotations

import numpy

from rlfleet.relay.manifest import build_manifest
from rlfleet.relay.publisher import WeightPublisher
from tests.integration.helpers import CountingStore


def _record(publisher: WeightPublisher, version: int) -> None:
    manifest, _ = build_manifest(version, {"w": numpy.full(4, version, dtype=numpy.float32)}, chunk_bytes=1 << 20)
    publisher._record_latest(manifest, "relay-0")


def test_latest_costs_one_request_per_version_and_never_moves_back(etcd):
    store = CountingStore(etcd.endpoints_arg)
    publisher = WeightPublisher(store, "latest")
    key = publisher.keys.weights_latest
    for version in range(1, 6):
        _record(publisher, version)
    assert store.get(key).value["version"] == 5
    assert store.calls.count("swap") == 5 and store.calls.count("get") == 1  # the get is the assert's

    # Another writer moved it ahead: our stale revision loses, and we do not move it back.
    store.put(key, {"version": 9, "bytes": 1, "checksum": "c", "master": "relay-1"})
    store.calls.clear()
    _record(publisher, 6)
    assert store.get(key).value["version"] == 9
    assert store.calls == ["swap", "get"]  # the lost swap said where the key stood
    store.calls.clear()
    _record(publisher, 10)  # at the revision the lost swap returned: one request
    assert store.calls == ["swap"]
    latest = store.get(key).value
    assert (latest["version"], latest["master"]) == (10, "relay-0")
    store.close()
