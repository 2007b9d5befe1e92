"""Faults: kill -9 of a middle relay and of the master mid-broadcast, an empty restart, a flipped byte."""

from __future__ import annotations

import numpy as np
import torch

from rlfleet.relay.publisher import WeightPublisher
from rlfleet.relay.reader import WeightReader, checksum_of
from tests.integration.helpers import wait_for
from tests.relay.fleet import blob_tensors, model_tensors

torch.set_num_threads(1)
CHUNK = 256 << 10
PACE = "0.03"  # seconds per chunk and hop: a 64-chunk version takes ~2 s per hop, time to kill mid-way


def _serves_exactly(fleet, rid: str, version: int, tensors) -> None:
    reader = WeightReader(fleet.store, fleet.job, f"host-{rid}")
    wait_for(f"{rid} to serve version {version}", lambda: version in reader.versions(), 40)
    with reader.open(version) as view:
        view.verify()  # every chunk against the manifest
        for name, arr in tensors.items():
            assert np.array_equal(view.tensors[name], arr), f"{rid}: {name} of version {version} differs"


def test_kill9_middle_relay_mid_broadcast_repairs_without_restarting(fleet):
    ids = fleet.start_chain(4, RLFLEET_RELAY_PACE_S=PACE)
    tensors = blob_tensors(1, 16)  # 16 MiB = 64 chunks
    report = WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK).publish(1, tensors)
    n = report.chunks
    # relay-2 is past the failed relay: it must not start over.
    wait_for("relay-2 to be part-way", lambda: fleet.progress("relay-2", 1) >= 8, 30, every_s=0.02)
    fleet.kill9("relay-1")
    survivors = [i for i in ids if i != "relay-1"]
    for rid in survivors:
        _serves_exactly(fleet, rid, 1, tensors)
    # relay-0 records the repair when its push to relay-2 is acknowledged complete.
    repairs = wait_for("relay-0 to record the repair", lambda: fleet.stats("relay-0")["repairs"], 10)
    assert repairs[-1]["successor"] == "relay-2", repairs
    assert repairs[-1]["resumed_from_chunk"] >= 8, repairs  # resumed where relay-2 stood, not at chunk 0
    assert repairs[-1]["repair_s"] >= 0, repairs  # recorded; how fast is the relay bench's to say
    for rid in ("relay-2", "relay-3"):  # every chunk arrived exactly once downstream of the failure
        assert fleet.stats(rid)["chunks_received"] == n, fleet.stats(rid)


def test_kill9_master_mid_broadcast_a_new_master_takes_over(fleet):
    ids = fleet.start_chain(3, RLFLEET_RELAY_PACE_S=PACE)
    pub = WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK, timeout_s=30)
    v1, v2 = blob_tensors(1, 16), blob_tensors(2, 16)
    pub.publish(1, v1)
    wait_for("relay-1 to be part-way through version 1", lambda: fleet.progress("relay-1", 1) >= 4, 30, every_s=0.02)
    fleet.kill9("relay-0")
    survivors = ids[1:]
    wait_for("a new master", lambda: fleet.master() in survivors, 15)
    report = pub.publish(2, v2)  # the trainer finds the new master through etcd
    assert report.master in survivors
    for rid in survivors:
        _serves_exactly(fleet, rid, 2, v2)
        # Version 1 never completed anywhere alive: it must not be served, partly or mixed.
        reader = WeightReader(fleet.store, fleet.job, f"host-{rid}")
        assert set(reader.versions()) <= {1, 2}
        if 1 in reader.versions():
            _serves_exactly(fleet, rid, 1, v1)
    assert fleet.store.get(fleet.keys.weights_latest).value["master"] == report.master
    pub.close()


def test_publish_in_flight_survives_a_master_death(fleet):
    fleet.start_chain(2)
    pub = WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK, timeout_s=30)
    pub.publish(1, model_tensors(1))
    wait_for("relay-1 to hold version 1", lambda: WeightReader(fleet.store, fleet.job, "host-relay-1").newest() == 1)
    fleet.kill9("relay-0")
    report = pub.publish(2, model_tensors(2))  # starts against the dead master, ends on relay-1
    assert report.master == "relay-1" and report.attempts >= 1
    _serves_exactly(fleet, "relay-1", 2, model_tensors(2))


def test_restarted_relay_with_an_empty_store_catches_up(fleet):
    ids = fleet.start_chain(3)
    tensors = model_tensors(7)
    WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK).publish(1, tensors)
    for rid in ids:
        _serves_exactly(fleet, rid, 1, tensors)
    reader = WeightReader(fleet.store, fleet.job, "host-relay-1")
    old_dir = reader.relay_dir
    fleet.kill9("relay-1")
    fleet.start("relay-1")
    # The new incarnation wipes its store at start, then fetches version 1 from its predecessor.
    wait_for("relay-1 to re-register", lambda: fleet.chain().members.get("relay-1") and
             fleet.chain().members["relay-1"].state == "running", 20)
    assert reader.relay_dir == old_dir
    _serves_exactly(fleet, "relay-1", 1, tensors)
    _serves_exactly(fleet, "relay-2", 1, tensors)


def test_a_corrupted_chunk_is_detected_refetched_and_never_served(fleet):
    # relay-0 flips one byte of chunk 3 of version 1 on its way to relay-1, once.
    fleet.start("relay-0", RLFLEET_RELAY_CORRUPT="1:1:3")
    wait_for("relay-0 to become master", lambda: fleet.master() == "relay-0", 20)
    fleet.start("relay-1")
    wait_for("2 relays in the chain", lambda: len(fleet.chain().order) == 2, 20)
    tensors = model_tensors(9)
    report = WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK).publish(1, tensors)
    _serves_exactly(fleet, "relay-1", 1, tensors)
    s = fleet.stats("relay-1")
    assert s["corrupt_chunks"] == 1 and s["chunks_received"] == report.chunks
    with WeightReader(fleet.store, fleet.job, "host-relay-1").open(1) as view:
        assert checksum_of(view) == checksum_of_published(tensors, report)
    assert "refused chunk 3 of 1/tp1" in fleet.log("relay-0")


def checksum_of_published(tensors, report) -> str:
    from rlfleet.relay.manifest import build_manifest, digest
    m, src = build_manifest(1, tensors, chunk_bytes=CHUNK)
    assert m.checksum == report.checksum
    return digest(src.pieces(0, m.total_bytes), m.algo)
