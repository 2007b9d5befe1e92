"""The resource-manager's admission policy (daemons/resource_manager/admission.py): pure
code, so every rule is checked here on plain records."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.control.operations import Admission, NodeState
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import parse_spec
from rlfleet.daemons.resource_manager.admission import Fleet, decide

BASE = {
    "job": {"name": "live"},
    "model": {"path": str(Path(__file__).parents[3] / "models" / "tiny-qwen2")},
    "task": {"env": {"kind": "arithmetic"}},
}
NAMED = [{"name": "h1", "roles": {"trainer": 1, "resource-manager": 1, "repack-manager": 1, "env-host": 1,
                                  "reward-host": 1, "relay": 1, "rollout": 1}}]
POOLS = [
    {"name": "gpu", "labels": {"kind": "gpu"}, "roles": {"relay": 1, "rollout": 2}, "capacity": 1},
    {"name": "cpu", "labels": {"kind": "cpu"}, "roles": {"env-host": 1}},
    {"name": "any", "roles": {"reward-host": 1}, "capacity": 1},
]


def spec(pools=POOLS):
    return parse_spec({**BASE, "placement": {"hosts": NAMED, "pools": pools}})


def ids(decision, host):
    return sorted(p.member_id for p in decision.placed if p.host == host)


def test_a_registered_host_joins_the_first_matching_pool_with_room():
    d = decide(spec(), Fleet(nodes={"g1": {"kind": "gpu"}, "g2": {"kind": "gpu"}, "c1": {"kind": "cpu", "x": "y"},
                                    "z": {}}), now=5.0)
    assert {a.host: a.pool for a in d.admit} == {"g1": "gpu", "g2": "any", "c1": "cpu"}
    assert ids(d, "g1") == ["relay-g1-0", "rollout-g1-0", "rollout-g1-1"]
    assert ids(d, "c1") == ["env-host-c1-0"]
    assert ids(d, "g2") == ["reward-host-g2-0"]  # gpu was full: the fallback took it
    assert d.waiting == {"z": "every matching pool is full: any (1/1)"}
    assert {p.member_id for p in d.placed if p.host == "h1"} >= {"trainer-0", "rollout-0"}


def test_without_a_matching_pool_or_any_pool_a_host_waits_with_the_reason():
    d = decide(spec(POOLS[:2]), Fleet(nodes={"x": {"kind": "tpu"}}), now=0)
    assert d.admit == () and d.waiting == {"x": "no pool matches its labels {kind=tpu}"}
    d = decide(spec([]), Fleet(nodes={"x": {}}), now=0)
    assert "no [[placement.pools]]" in d.waiting["x"]


def test_an_admission_outlives_its_agent_and_counts_against_capacity():
    fleet = Fleet(nodes={"g2": {"kind": "gpu"}}, admissions={"g1": Admission("g1", "gpu", 1.0)})
    d = decide(spec(), fleet, now=2)
    assert ids(d, "g1") == ["relay-g1-0", "rollout-g1-0", "rollout-g1-1"]  # agent gone: still placed
    assert [(a.host, a.pool) for a in d.admit] == [("g2", "any")]


def test_cordon_keeps_what_runs_and_admits_nothing_new():
    fleet = Fleet(nodes={"g1": {"kind": "gpu"}, "c1": {"kind": "cpu"}},
                  admissions={"g1": Admission("g1", "gpu", 1.0)},
                  node_states={"g1": NodeState("g1", "cordoned"), "c1": NodeState("c1", "cordoned")})
    d = decide(spec(), fleet, now=2)
    assert ids(d, "g1") == ["relay-g1-0", "rollout-g1-0", "rollout-g1-1"]
    assert d.admit == () and d.waiting == {"c1": "cordoned: not admitted"}


def test_drain_unplaces_a_named_or_admitted_host_and_ends_drained_when_nothing_runs():
    fleet = Fleet(nodes={"g1": {"kind": "gpu"}}, admissions={"g1": Admission("g1", "gpu", 1.0)},
                  node_states={"g1": NodeState("g1", "draining"), "h1": NodeState("h1", "draining")},
                  busy_hosts=frozenset({"h1"}))
    d = decide(spec(), fleet, now=2)
    assert ids(d, "g1") == [] and ids(d, "h1") == []
    assert d.drained == ("g1",)  # h1 still runs something: not yet
    assert d.forget == ()        # a drained host keeps its pool: uncordon places it again


def test_remove_forgets_the_admission_and_a_vanished_pool_forgets_its_hosts():
    fleet = Fleet(nodes={"g1": {"kind": "gpu"}},
                  admissions={"g1": Admission("g1", "gpu", 1.0), "old": Admission("old", "gone", 1.0)},
                  node_states={"g1": NodeState("g1", "removed")})
    d = decide(spec(), fleet, now=2)
    assert d.forget == ("g1", "old") and d.admit == ()
    assert d.waiting == {"g1": "removed: not admitted (rlfleet node add admits it)"}


def test_named_hosts_are_never_admitted_into_a_pool():
    d = decide(spec(), Fleet(nodes={"h1": {"kind": "gpu"}}), now=0)
    assert d.admit == () and d.waiting == {}


def test_a_pool_that_gives_gpus_admits_only_hosts_with_that_many_and_assigns_each_daemon_its_own():
    pools = [{"name": "gpu", "labels": {"kind": "gpu"}, "roles": {"relay": 1, "rollout": 2},
              "gpus_per_daemon": {"rollout": 2}}, {"name": "any", "roles": {"env-host": 1}}]
    fleet = Fleet(nodes={"g1": {"kind": "gpu"}, "g2": {"kind": "gpu"}}, gpus={"g1": 4, "g2": 2})
    d = decide(spec(pools), fleet, now=0)
    assert {a.host: a.pool for a in d.admit} == {"g1": "gpu", "g2": "any"}  # g2 has 2 GPUs, the pool needs 4
    assert {p.member_id: p.gpus for p in d.placed if p.host == "g1"} == {
        "relay-g1-0": (), "rollout-g1-0": (0, 1), "rollout-g1-1": (2, 3)}
    assert {p.member_id: p.gpus for p in d.placed if p.host == "g2"} == {"env-host-g2-0": ()}
    assert all(p.gpus is not None for p in d.placed)  # every daemon of the job: CUDA_VISIBLE_DEVICES set
    d = decide(spec(pools[:1]), Fleet(nodes={"c1": {"kind": "gpu"}}), now=0)
    assert d.waiting == {"c1": "it has 0 GPU(s); every matching pool needs more: gpu (4)"}


def test_a_job_that_gives_no_gpus_leaves_every_daemons_devices_alone():
    assert all(p.gpus is None for p in decide(spec(), Fleet(nodes={"g1": {"kind": "gpu"}}), now=0).placed)


@pytest.mark.parametrize("pools, message", [
    ([{"name": "a", "roles": {"rollout": 1}, "gpus_per_daemon": {"relay": 1}}],
     "pool 'a': gpus_per_daemon.relay = 1, but it places no relay"),
    ([{"name": "a", "roles": {"rollout": 1}}, {"name": "b", "labels": {"k": "v"}, "roles": {"rollout": 1}}],
     "put the fallback pool last"),
    ([{"name": "a", "labels": {"k": "v"}, "roles": {"rollout": 1}},
      {"name": "a", "roles": {"rollout": 1}}], "duplicate pool name"),
    ([{"name": "a", "roles": {"rollout": 0}}], "places nothing"),
    ([{"name": "a", "roles": {"trainer": 1}}], "placement.pools[0].roles"),
    ([{"name": "a/b", "roles": {"rollout": 1}}], "placement.pools[0].name"),
])
def test_bad_pools_are_refused_by_validation(pools, message):
    with pytest.raises(SpecError) as err:
        spec(pools)
    assert message in str(err.value)
