"""`rlfleet node add`'s phases (tools/ctl/node_ops.py JoinWatch) come from the records'
own timestamps: the same figures whether the command started before the host's agent
registered or long after it served."""

from __future__ import annotations

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import KeyValue
from rlfleet.tools.ctl.node_ops import JoinWatch

K = JobKeys("demo")


def member(role: str, member_id: str, started: float, **info) -> KeyValue:
    value = {"id": member_id, "role": role, "host": "h6", "pid": 7, "state": "running", "started": started, **info}
    return KeyValue(K.member(role, member_id), value, 1, 1, 0)


def snapshot(*, result: bool = True, placed_by_hand: bool = False) -> Cluster:
    """h6's agent registered at 100; admitted 103; placed 104; its relay and rollout
    started 106 and 107; the rollout loaded version 5 at 110 and served at 112."""
    def placement(role: str, member_id: str) -> KeyValue:
        value = {"host": "h6", "role": role, "id": member_id, **({} if placed_by_hand else {"since": 104.0})}
        return KeyValue(K.placement("h6", role, member_id), value, 1, 1, 0)
    rollout = {"first_weights_at": 110.0, "first_weights_version": 5, **({"first_result_at": 112.0} if result else {})}
    kvs = [KeyValue(K.node("h6"), {"host": "h6", "seen": 99.5, "agent": {"registered": 100.0}}, 1, 1, 0),
           KeyValue(K.admitted("h6"), {"pool": "rollout", "since": 103.0}, 1, 1, 0),
           placement("relay", "relay-h6-0"), placement("rollout", "rollout-h6-0"),
           member("relay", "relay-h6-0", 106.0, newest=5, first_version_at=108.0),
           member("rollout", "rollout-h6-0", 107.0, weight_version=5, **rollout)]
    return Cluster.from_kvs(K, kvs, taken_at=500.0)


def test_the_phases_are_the_records_whenever_the_command_looks():
    watch = JoinWatch("h6")
    assert watch.observe(snapshot()) == ["registered", "admit", "place", "start", "weights", "first_trajectory"]
    assert watch.done and watch.caught_up_to == 5
    record = watch.to_json()
    assert record["phases"] == {"admit_s": 3.0, "place_s": 1.0, "start_s": 3.0, "weights_s": 3.0,
                                "first_trajectory_s": 2.0}
    assert record["total_s"] == 12.0 and record["milestones_at"]["registered"] == 100.0
    assert watch.observe(snapshot()) == []  # a later look changes nothing


def test_it_waits_for_the_first_trajectory_then_takes_its_own_time():
    watch = JoinWatch("h6")
    assert watch.observe(snapshot(result=False))[-1] == "weights" and not watch.done
    assert watch.observe(snapshot()) == ["first_trajectory"] and watch.to_json()["total_s"] == 12.0


def test_a_host_the_spec_names_is_admitted_when_it_registers_and_clocks_never_run_back():
    watch = JoinWatch("h6", named=True)
    watch.observe(snapshot(placed_by_hand=True))  # no `since` on its placement
    assert watch.phases()["admit_s"] == 0.0 and watch.phases()["place_s"] == 0.0
    assert watch.phases()["start_s"] == 7.0  # from the registration to the last daemon's start


def test_phases_count_from_when_the_command_cleared_the_hosts_state():
    watch = JoinWatch("h6", floor=105.0)  # drained before: it could not join earlier
    watch.observe(snapshot())
    assert watch.at["registered"] == 105.0 and watch.phases()["admit_s"] == 0.0
    assert watch.to_json()["total_s"] == 7.0


def test_nothing_is_reached_before_the_agent_registers():
    assert JoinWatch("h7").observe(snapshot()) == []


def test_an_agent_registered_again_after_the_join_does_not_turn_every_phase_to_zero():
    c = snapshot()
    node = KeyValue(K.node("h6"), {"host": "h6", "seen": 499.0, "agent": {"registered": 500.0}}, 1, 1, 0)
    restarted = Cluster.from_kvs(K, [node, *(KeyValue(k, v, 1, 1, 0) for k, v in _kvs(c))], taken_at=600.0)
    watch = JoinWatch("h6")
    watch.observe(restarted)
    assert watch.registered_again == 500.0 and watch.at["registered"] == 103.0  # from the admission
    assert watch.to_json()["total_s"] == 9.0 and watch.to_json()["agent_registered_again_at"] == 500.0
    named = JoinWatch("h6", named=True)
    named.observe(restarted)
    assert named.at["registered"] == 106.0 and named.phases()["admit_s"] == 0.0  # the first daemon's start


def _kvs(cluster: Cluster):
    """The snapshot's records but its node, as (key, value)."""
    out = [(K.admitted(h), a.to_value()) for h, a in cluster.admissions.items()]
    out += [(K.placement(p.host, p.role, p.id), p.to_value()) for p in cluster.placement]
    out += [(K.member(m.role, m.id), {"id": m.id, "role": m.role, "host": m.host, "pid": m.pid, "state": m.state,
                                      "started": m.started, **m.info}) for m in cluster.all_members]
    return out
