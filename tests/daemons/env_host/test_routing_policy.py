"""The routing policy alone: plain code over (id, outstanding), no sockets."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from rlfleet.daemons.env_host.routing_policy import LeastLoaded


@dataclasses.dataclass
class Load:
    id: str
    outstanding: int


def test_least_loaded_picks_the_fewest_outstanding():
    policy = LeastLoaded(random.Random(0))
    loads = [Load("r0", 3), Load("r1", 1), Load("r2", 2)]
    assert all(policy.choose(loads).id == "r1" for _ in range(20))


def test_ties_are_spread_at_random():
    policy = LeastLoaded(random.Random(0))
    loads = [Load("r0", 0), Load("r1", 0), Load("r2", 5)]
    picks = Counter(policy.choose(loads).id for _ in range(400))
    assert set(picks) == {"r0", "r1"} and min(picks.values()) > 150


# -- routes, traits and the kinds of issue 15 (prompt replication, hardware affinity) ------------
from rlfleet.daemons.env_host.affinity import Affinity  # noqa: E402
from rlfleet.daemons.env_host.routing_policy import GroupSticky, RolloutTraits, Route, group_of  # noqa: E402


def test_group_of_a_trajectory_is_its_prompt():
    assert group_of("p12-g3") == "p12" and group_of("p1-g2-g5") == "p1-g2" and group_of("x") == "x"


def test_group_sticky_keeps_a_group_on_its_first_rollout():
    policy = GroupSticky(random.Random(0))
    loads = [Load("r0", 0), Load("r1", 0), Load("r2", 0)]
    first = policy.choose(loads, Route("p7"))
    first.outstanding += 10  # the group's other samples follow it, however loaded it gets
    assert all(policy.choose(loads, Route("p7")) is first for _ in range(20))
    other = policy.choose(loads, Route("p8"))  # a new group: least loaded, not the busy one
    assert other is not first and policy.bound("p8") == other.id


def test_group_sticky_moves_a_group_whose_rollout_is_gone_or_excluded():
    policy = GroupSticky(random.Random(0))
    loads = [Load("r0", 0), Load("r1", 3)]
    assert policy.choose(loads, Route("p1")).id == "r0"
    moved = policy.choose([Load("r1", 3), Load("r2", 5)], Route("p1"))  # r0 excluded / dead
    assert moved.id == "r1" and policy.bound("p1") == "r1"
    assert policy.choose([Load("r0", 0), Load("r1", 3)], Route("p1")).id == "r1"  # sticky to the new one


def test_group_sticky_forgets_the_oldest_groups_beyond_its_bound():
    policy = GroupSticky(random.Random(0), remember=2)
    loads = [Load("r0", 0)]
    for g in ("p1", "p2", "p3"):
        policy.choose(loads, Route(g))
    assert policy.bound("p1") is None and policy.bound("p3") == "r0"


def test_least_loaded_queue_waits_while_every_slot_is_full():
    policy = LeastLoaded(random.Random(0), queue=True)
    policy.set_fleet({"r0": RolloutTraits("h", 2), "r1": RolloutTraits("h", 2)})
    loads = [Load("r0", 2), Load("r1", 1)]
    assert policy.choose(loads, Route("p1")).id == "r1"
    loads[1].outstanding = 2
    assert policy.choose(loads, Route("p1")) is None  # full: wait in the env-host
    assert policy.choose(loads) is not None  # a continuation (no route) never waits
    assert LeastLoaded(random.Random(0)).choose(loads, Route("p1")) is not None  # queue off: as before


def test_unknown_slots_are_never_saturated():
    policy = LeastLoaded(random.Random(0), queue=True)
    assert policy.choose([Load("r0", 1000)], Route("p1")).id == "r0"


def _fleet():
    traits = {"a0": RolloutTraits("h800", 2), "a1": RolloutTraits("h800", 2),
              "b0": RolloutTraits("h20", 2), "b1": RolloutTraits("h20", 2)}
    return traits, [Load(rid, 0) for rid in traits]


def test_affinity_sends_each_tag_to_its_preferred_hardware():
    traits, loads = _fleet()
    policy = Affinity({"prefill": "h800", "decode": "h20"}, rng=random.Random(0))
    policy.set_fleet(traits)
    for _ in range(2):
        r = policy.choose(loads, Route("p", "prefill"))
        assert traits[r.id].hardware == "h800"
        r.outstanding += 1
        d = policy.choose(loads, Route("q", "decode"))
        assert traits[d.id].hardware == "h20"
        d.outstanding += 1
    assert policy.counts == {("prefill", "h800"): [2, 0], ("decode", "h20"): [2, 0]}


def test_affinity_falls_back_when_the_preferred_pool_is_saturated():
    traits, loads = _fleet()
    policy = Affinity({"prefill": "h800"}, rng=random.Random(0))
    policy.set_fleet(traits)
    for r in loads:
        if traits[r.id].hardware == "h800":
            r.outstanding = 2  # both H800s full
    r = policy.choose(loads, Route("p", "prefill"))
    assert traits[r.id].hardware == "h20"
    assert policy.counts[("prefill", "h20")] == [1, 1]  # routed, and a fallback
    assert policy.bindings() == {"prefer": {"prefill": "h800"},
                                 "counts": {"prefill": {"h20": {"routed": 1, "fallbacks": 1}}}}


def test_affinity_with_no_free_slot_waits_or_queues_on_the_preferred_pool():
    traits, loads = _fleet()
    for r in loads:
        r.outstanding = 2
    loads[1].outstanding = 3
    waiting = Affinity({"prefill": "h800"}, rng=random.Random(0))
    waiting.set_fleet(traits)
    assert waiting.choose(loads, Route("p", "prefill")) is None
    queueing = Affinity({"prefill": "h800"}, queue=False, rng=random.Random(0))
    queueing.set_fleet(traits)
    assert queueing.choose(loads, Route("p", "prefill")).id == "a0"  # the H800 with the shorter queue


def test_affinity_spreads_an_unpreferred_tag_over_every_pool():
    traits, loads = _fleet()
    policy = Affinity({"prefill": "h800"}, rng=random.Random(0))
    policy.set_fleet(traits)
    picks = Counter(traits[policy.choose(loads, Route("x", "other")).id].hardware for _ in range(200))
    assert set(picks) == {"h800", "h20"}
    assert all(n == 0 for _, n in policy.counts.values())  # no fallbacks without a preference
