"""The chain end to end: real relay processes, real etcd, real shared memory."""

from __future__ import annotations

import time

import numpy as np
import torch

from rlfleet.common.control.records import RelayMaster
from rlfleet.relay.publisher import WeightPublisher
from rlfleet.relay.reader import WeightReader
from rlfleet.relay.status import chain_status, chain_table, versions_table
from tests.integration.helpers import wait_for
from tests.relay.fleet import assert_holds, model_tensors

torch.set_num_threads(1)
CHUNK = 256 << 10


def test_versions_reach_every_relay_and_the_trainer_does_not_wait_for_the_chain(fleet):
    ids = fleet.start_chain(3, RLFLEET_RELAY_PACE_S="0.01")  # slow hops: v1 is still travelling when v2 comes
    pub = WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK, timeout_s=30)
    v1, v2, v3 = model_tensors(1), model_tensors(2), model_tensors(3)
    last = WeightReader(fleet.store, fleet.job, f"host-{ids[-1]}")
    r1 = pub.publish(1, v1)
    r2 = pub.publish(2, v2)   # allowed while 1 is still on its way down
    at_the_end_when_published = last.versions()
    assert (r1.master, r2.master) == ("relay-0", "relay-0")
    assert r1.chunks == r1.chunks_sent > 10 and r2.attempts == 1
    # The stall is the push to the master only: when publish(2) returns, version 2 has not
    # reached the end of the chain (each paced hop takes r1.chunks x 10 ms per version).
    assert 2 not in at_the_end_when_published, at_the_end_when_published
    for rid in ids:
        assert_holds(fleet, rid, 2, v2)
    latest = fleet.store.get(fleet.keys.weights_latest).value
    assert latest == {"version": 2, "bytes": r2.bytes, "checksum": r2.checksum, "master": "relay-0"}
    wait_for("relay/chain written by the master",
             lambda: (fleet.store.get(fleet.keys.relay_chain) or None) and
             fleet.store.get(fleet.keys.relay_chain).value["order"] == ids, 10)

    # keep_versions = 2: a third version frees the first everywhere.
    pub.publish(3, v3)
    for rid in ids:
        assert_holds(fleet, rid, 3, v3)
        reader = WeightReader(fleet.store, fleet.job, f"host-{rid}")
        wait_for(f"{rid} to free version 1", lambda: 1 not in reader.versions(), 10)
        assert reader.newest() == 3
    # relay/master describes the running chain: relay-0 was elected holding nothing
    # (newest null, issue 10 point 6), and its value follows the versions it holds.
    wait_for("relay/master to say version 3",
             lambda: RelayMaster.read(fleet.store, fleet.keys).newest == 3, 10)

    status = chain_status(fleet.store, fleet.job)
    assert status["master"] == "relay-0" and status["order"] == ids
    assert status["versions"]["3/tp1"]["complete"] == ids or \
        wait_for("members to report version 3", lambda: chain_status(fleet.store, fleet.job)["versions"]
                 ["3/tp1"]["complete"] == ids, 10)
    by_id = {r["id"]: r for r in chain_status(fleet.store, fleet.job)["relays"]}
    assert by_id["relay-0"]["live"]["successor"] == "relay-1"
    assert by_id["relay-1"]["live"]["chunks_received"] >= 2 * r1.chunks  # v2 and v3 at least (v1 may be skipped)
    assert by_id["relay-2"]["live"]["receive_bytes_per_s"] > 0
    assert chain_table(status).row_count == 3 and versions_table(status).row_count >= 1
    pub.close()


def test_two_way_tensor_parallel_layout_travels_the_chain(fleet):
    ids = fleet.start_chain(2)
    readers = {rid: WeightReader(fleet.store, fleet.job, f"host-{rid}", layout=2) for rid in ids}
    wait_for("the master to see the tp2 request", lambda: 2 in fleet.chain().layouts, 10)
    time.sleep(0.3)  # the master's topology watcher picks the request up
    tensors = model_tensors(5)
    WeightPublisher(fleet.store, fleet.job, chunk_bytes=CHUNK).publish(1, tensors)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    for rid, reader in readers.items():
        wait_for(f"{rid} to hold version 1 in layout tp2", lambda: reader.newest() == 1, 30)
        halves_q, halves_down = [], []
        for rank in (0, 1):
            with reader.open(1, rank=rank) as view:
                assert view.layout == 2 and view.rank == rank
                halves_q.append(view.tensors["model.layers.0.self_attn.q_proj.weight"].copy())
                halves_down.append(view.tensors["model.layers.1.mlp.down_proj.weight"].copy())
                assert np.array_equal(view.tensors["model.norm.weight"], tensors["model.norm.weight"])
                assert view.manifest.source_checksum  # derived from the full version it names
        assert halves_q[0].shape == (q.shape[0] // 2, q.shape[1])
        assert np.array_equal(np.concatenate(halves_q, 0), q)
        assert np.array_equal(np.concatenate(halves_down, 1), down)
        assert_holds(fleet, rid, 1, tensors)  # the unsharded layout is there too


def test_a_relay_behind_the_latest_version_is_stuck_only_when_nothing_new_came_for_a_while():
    from rlfleet.relay.status import STUCK_AFTER_S, lagging

    now = 10_000.0
    relays = [{"id": "fresh", "state": "running", "newest": 7, "newest_at": now - 1},
              {"id": "stuck", "state": "running", "newest": 3, "newest_at": now - STUCK_AFTER_S - 1},
              {"id": "old-relay", "state": "running", "newest": 3},  # no newest_at: cannot tell, so stuck
              {"id": "current", "state": "running", "newest": 8, "newest_at": now - 100},
              {"id": "draining", "state": "draining", "newest": 1, "newest_at": now - 100}]
    assert lagging(relays, latest=8, now=now) == (["stuck", "old-relay"], ["fresh"])
