"""Failsafe leadership and fencing (docs/operations/failsafe.md) on a real 3-member etcd.

A partition of one daemon is made by giving its store only one member's endpoint and
killing that member: the other two keep a quorum, so a standby can take over.
"""

from __future__ import annotations

import numpy
import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import WeightsLatest
from rlfleet.common.control.session import Session
from rlfleet.daemons.trainer.publishing import AsyncPublisher
from rlfleet.relay.publisher import PublishFenced, WeightPublisher

from .helpers import wait_for

JOB = "fence"
TTL_S = 2


def session(store: EtcdStore, member_id: str) -> Session:
    s = Session(store, JobKeys(JOB), "trainer", member_id, ttl_s=TTL_S, elect=True, failsafe=True)
    s.campaign_after = 0.0  # campaign at once (the newcomer's wait is tested elsewhere)
    return s


def step_until(s: Session, what: str, ok, timeout_s: float = 20.0, keep: tuple[Session, ...] = ()) -> list[str]:
    """Step s until ok(s); the sessions in ``keep`` are stepped too (their leases kept)."""
    said: list[str] = []

    def once():
        for other in keep:
            other.step({"id": other.member_id})
        said.extend(s.step({"id": s.member_id}))
        return ok(s)
    wait_for(what, once, timeout_s=timeout_s, every_s=0.1)
    return said


@pytest.fixture
def stores(etcd3):
    a = EtcdStore([etcd3.endpoints[0]], timeout_s=0.5)  # the partitioned side
    b = EtcdStore(etcd3.endpoints[1:], timeout_s=0.5)
    yield a, b
    a.close()
    b.close()


def test_a_superseded_leader_is_fenced_and_cannot_publish(etcd3, stores):
    store_a, store_b = stores
    keys = JobKeys(JOB)
    a, b = session(store_a, "a"), session(store_b, "b")
    step_until(a, "a to lead", lambda s: s.is_leader)
    step_until(b, "b registered as standby", lambda s: s.lease is not None and not s.is_leader)
    term_a = a.term
    assert term_a == store_b.get(keys.leader("trainer")).create_revision
    assert store_b.get(keys.term("trainer")).value == {"term": term_a, "reign": term_a, "id": "a",
                                                       "since": a._leader_since}
    # a publishes while it leads: weights/latest carries its term.
    held = WeightPublisher(store_a, JOB, term=lambda: a.term if a.is_leader else 0)
    held._record_latest(_manifest(1), "relay-x")
    assert WeightsLatest.read(store_b, keys).term == term_a

    # -- partition a alone: it keeps its work but loses its authority at once ----------
    etcd3.kill_member(etcd3.members[0])
    said = step_until(a, "a in failsafe", lambda s: s.failsafe_since is not None)
    assert not a.is_leader and any("failsafe" in x for x in said)
    # b, with the quorum, takes over once a's lease has expired: a newer term.
    step_until(b, "b to take over", lambda s: s.is_leader, timeout_s=4 * TTL_S + 5)
    assert b.term > term_a and b.reign == b.term
    assert store_b.get(keys.term("trainer")).value["id"] == "b"
    newer = WeightPublisher(store_b, JOB, term=lambda: b.term)
    newer._record_latest(_manifest(2), "relay-x")

    # -- a's side heals: it learns it was superseded, and stays fenced ---------------
    # m0 comes back while b keeps its lease (stepped in the loop): b still leads then.
    etcd3.start_member(etcd3.members[0], wait=False)
    said = step_until(a, "a to see it was superseded", lambda s: s.failsafe_since is None, keep=(b,))
    assert not a.is_leader and a.term == 0
    assert any("superseded" in x and "fenced" in x for x in said), said
    # Its publisher, even if it still believed in its old term, is refused before a
    # chunk goes out (publish) and at the record (weights/latest keeps b's version).
    stale = WeightPublisher(store_a, JOB, term=lambda: term_a)
    with pytest.raises(PublishFenced):
        stale.publish(3, {"w": numpy.zeros(4, dtype=numpy.float32)})
    with pytest.raises(PublishFenced):
        stale._record_latest(_manifest(3), "relay-x")
    record = WeightsLatest.read(store_b, keys)
    assert (record.version, record.term) == (2, b.term)


def test_a_confirmed_failsafe_leader_keeps_its_reign_after_its_lease_expired(etcd3, stores):
    """No standby: a's lease expires while it is cut off (the quorum is there), yet nobody
    else led, so it takes a new term and keeps its reign (its in-memory state)."""
    store_a, store_b = stores
    keys = JobKeys(JOB)
    a = session(store_a, "a")
    step_until(a, "a to lead", lambda s: s.is_leader)
    first_term = a.term
    etcd3.kill_member(etcd3.members[0])
    step_until(a, "a in failsafe", lambda s: s.failsafe_since is not None)
    wait_for("a's leader key to expire", lambda: store_b.get(keys.leader("trainer")) is None,
             timeout_s=4 * TTL_S + 5)
    etcd3.start_member(etcd3.members[0])
    said = step_until(a, "a to lead again", lambda s: s.is_leader)
    assert a.reign == first_term and a.term > first_term
    assert any("continuing from in-memory state" in x for x in said), said
    assert store_b.get(keys.term("trainer")).value["reign"] == first_term


def test_a_leader_again_after_another_led_gets_a_new_reign(etcd3, stores):
    """a cut off; b takes over and dies; a wins the key back, but its memory is stale:
    a new reign (the trainer daemon restarts its worker from checkpoint and journal)."""
    store_a, store_b = stores
    a, b = session(store_a, "a"), session(store_b, "b")
    step_until(a, "a to lead", lambda s: s.is_leader)
    first_reign = a.reign
    etcd3.kill_member(etcd3.members[0])
    step_until(a, "a in failsafe", lambda s: s.failsafe_since is not None)
    step_until(b, "b to take over", lambda s: s.is_leader, timeout_s=4 * TTL_S + 5)
    b.close()  # resigns: the key is free again
    etcd3.start_member(etcd3.members[0])
    said = step_until(a, "a to lead again", lambda s: s.is_leader)
    assert a.reign == a.term > first_reign
    assert any("another trainer led during the outage" in x for x in said), said


def test_a_held_publication_waits_for_confirmed_leadership():
    """AsyncPublisher holds the newest version while may_publish is False, then sends it."""
    leading = {"now": False}
    sent: list[int] = []

    class Recorder:
        def publish(self, version, tensors):
            sent.append(version)

    pub = AsyncPublisher(Recorder(), may_publish=lambda: leading["now"])
    try:
        for v in (1, 2, 3):
            pub.submit(v, {})
        wait_for("the publisher to hold", lambda: pub.held == 1)
        assert sent == []
        leading["now"] = True
        wait_for("the newest version to go out", lambda: sent == [3])
    finally:
        pub.close()


def _manifest(version: int):
    from rlfleet.relay.manifest import build_manifest

    manifest, _ = build_manifest(version, {"w": numpy.full(4, version, dtype=numpy.float32)},
                                 chunk_bytes=1 << 20)
    return manifest
