"""The env-host routing seam: ``[env_host.routing]``, which rollout gets a turn.

The Router (routing.py) does the I/O: it keeps the live rollouts, narrows them to
the ones a turn may use (not excluded, not suspect, with fallbacks) and asks the
policy to choose among those. A policy is plain code over ``RolloutLoad``s, no
sockets, unit-tested in process. What a policy knows of each rollout beyond our own
outstanding requests — its hardware label and its slots, from its etcd record — is
handed to it by the env-host daemon (``set_fleet``), replaced whole on each change.

Kinds (docs/guide/agentic.md):
- ``least_loaded`` (default): each turn on the rollout with the fewest of our requests
  outstanding. Every sample of a prompt is its own request placed on any rollout:
  ROLL Flash's *prompt replication*. ``queue = true`` adds its *queue scheduling*: a
  turn waits in the env-host while every rollout's slots are full, and goes to the
  first slot that frees (``None`` from ``choose``), rather than queueing inside one
  rollout that it can then never leave.
- ``group_sticky``: every turn of a prompt's group on one rollout, chosen least-loaded
  for the group's first request and kept (moved only when that rollout is gone or
  excluded): one G-sample request per prompt, the baseline of prompt replication.
- ``affinity`` (affinity.py): each prompt kind's tag to its preferred hardware.

Registered in pyproject.toml (``rlfleet.env_routers``).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

from prometheus_client import Counter

from rlfleet.common.spec.registry import Kind, KindConfig

# Per tag and hardware label, what every policy chose (a fallback: not the tag's
# preferred hardware while that was saturated; only the affinity kind has them).
ROUTED = Counter("rlfleet_env_routed_total", "Turns routed, by prompt tag and the rollout's hardware",
                 ["id", "tag", "hardware"])
FALLBACKS = Counter("rlfleet_env_route_fallbacks_total",
                    "Turns routed off their tag's preferred hardware because it was saturated",
                    ["id", "tag", "hardware"])

# A sticky group is remembered this long (in groups): far more than are ever in flight
# on one env-host, so a live group is never forgotten, and memory stays bounded.
STICKY_GROUPS = 65536


class RolloutLoad(Protocol):
    id: str
    outstanding: int  # this env-host's requests in flight to that rollout


R = TypeVar("R", bound=RolloutLoad)


@dataclasses.dataclass(frozen=True)
class Route:
    """What a turn says about itself: its prompt's group (GRPO: the G samples of one
    prompt) and its prompt's kind (``Task.tag``)."""

    group: str = ""
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class RolloutTraits:
    """A rollout's record: its hardware label ('' unknown) and how many sequences it
    decodes at once (None unknown: never counted as saturated)."""

    hardware: str = ""
    slots: int | None = None


def group_of(trajectory_id: str) -> str:
    """'p12-g3' -> 'p12' (daemons/tasks/prompts.py's ids); any other id is its own group."""
    group, sep, _ = trajectory_id.rpartition("-g")
    return group if sep and group else trajectory_id


class RoutingPolicy(abc.ABC):
    name = "env-host"  # the metrics' id label

    def __init__(self) -> None:
        self.fleet: Mapping[str, RolloutTraits] = {}
        # (tag, hardware) -> [routed, fallbacks]: what the env-host publishes (routing/<id>)
        self.counts: dict[tuple[str, str], list[int]] = {}

    def set_fleet(self, fleet: Mapping[str, RolloutTraits]) -> None:
        """Each live rollout's traits (from another thread: replaced whole, never mutated)."""
        self.fleet = dict(fleet)

    @abc.abstractmethod
    def choose(self, candidates: Sequence[R], route: Route | None = None) -> R | None:
        """One of ``candidates`` (never empty) for the next turn, or None: wait until a
        slot frees (only when ``route`` is given; a continuation's choice never waits)."""

    # -- helpers for the kinds ---------------------------------------------------------
    def traits(self, r: RolloutLoad) -> RolloutTraits:
        return self.fleet.get(r.id) or RolloutTraits()

    def saturated(self, r: RolloutLoad) -> bool:
        slots = self.traits(r).slots
        return slots is not None and r.outstanding >= slots

    def record(self, route: Route | None, r: RolloutLoad, fallback: bool = False) -> None:
        tag, hardware = (route.tag if route else ""), self.traits(r).hardware
        n = self.counts.setdefault((tag, hardware), [0, 0])
        n[0] += 1
        ROUTED.labels(self.name, tag, hardware).inc()
        if fallback:
            n[1] += 1
            FALLBACKS.labels(self.name, tag, hardware).inc()

    def bindings(self) -> dict[str, Any]:
        """What the env-host publishes: per tag and hardware, turns routed and fallbacks."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (tag, hardware), (routed, fallbacks) in sorted(self.counts.items()):
            out.setdefault(tag, {})[hardware] = {"routed": routed, "fallbacks": fallbacks}
        return {"counts": out}


def least(candidates: Sequence[R], rng: random.Random, load: Any = None) -> R:
    """The least loaded (``load(r)``, default our outstanding requests); ties at random so
    that env-hosts that all see idle rollouts do not all pick the first one."""
    load = load or (lambda r: r.outstanding)
    lowest = min(load(r) for r in candidates)
    return rng.choice([r for r in candidates if load(r) == lowest])


class LeastLoaded(RoutingPolicy):
    """Fewest of our own requests outstanding (prompt replication); ``queue``: hold a
    turn in the env-host while every candidate's slots are full."""

    def __init__(self, rng: random.Random | None = None, queue: bool = False) -> None:
        super().__init__()
        self._rng = rng or random.Random()
        self.queue = queue

    def choose(self, candidates: Sequence[R], route: Route | None = None) -> R | None:
        if self.queue and route is not None:
            free = [r for r in candidates if not self.saturated(r)]
            if not free:
                return None
            candidates = free
        r = least(candidates, self._rng)
        self.record(route, r)
        return r


class GroupSticky(RoutingPolicy):
    """A prompt's whole group on one rollout (the baseline of prompt replication)."""

    def __init__(self, rng: random.Random | None = None, remember: int = STICKY_GROUPS) -> None:
        super().__init__()
        self._rng = rng or random.Random()
        self._remember = remember
        self._bound: collections.OrderedDict[str, str] = collections.OrderedDict()  # group -> rollout

    def choose(self, candidates: Sequence[R], route: Route | None = None) -> R | None:
        group = route.group if route is not None else ""
        rid = self._bound.get(group) if group else None
        r = next((c for c in candidates if c.id == rid), None) if rid is not None else None
        if r is None:  # the group's first turn, or its rollout is gone / excluded: rebind
            r = least(candidates, self._rng)
            if group:
                self._bound[group] = r.id
                while len(self._bound) > self._remember:
                    self._bound.popitem(last=False)
        if group:
            self._bound.move_to_end(group)
        self.record(route, r)
        return r

    def bound(self, group: str) -> str | None:
        return self._bound.get(group)


class LeastLoadedConfig(KindConfig):
    kind: Literal["least_loaded"] = "least_loaded"
    # Queue scheduling (ROLL Flash §5.1.1): wait in the env-host while every rollout's
    # slots (its record's ``slots``) are full, instead of queueing inside a rollout.
    queue: bool = False


class LeastLoadedKind(Kind):
    Config = LeastLoadedConfig

    @classmethod
    def build(cls, config: LeastLoadedConfig, /, *, name: str = "env-host", **_: Any) -> LeastLoaded:
        policy = LeastLoaded(queue=config.queue)
        policy.name = name
        return policy


class GroupStickyConfig(KindConfig):
    kind: Literal["group_sticky"] = "group_sticky"


class GroupStickyKind(Kind):
    Config = GroupStickyConfig

    @classmethod
    def build(cls, config: GroupStickyConfig, /, *, name: str = "env-host", **_: Any) -> GroupSticky:
        policy = GroupSticky()
        policy.name = name
        return policy
