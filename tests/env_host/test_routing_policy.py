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
