"""Hardware-affinity routing (RollArt §5.2, its requirement R1): ``[env_host.routing]
kind = "affinity"``.

Each prompt kind carries a tag (``Task.tag``: the sim task's ``kinds``), each rollout a
hardware label (its etcd record's ``hardware``: the sim engine's pool, a real rollout's
node label). The spec's ``prefer`` table maps tags to hardware; it IS the binding, and
the env-host publishes it with live counts (``routing/<env-host id>`` in etcd, the
``rlfleet_env_routed_total`` and ``rlfleet_env_route_fallbacks_total`` metrics).

A turn goes to the least loaded rollout of its tag's preferred hardware that has a free
slot; when every one of those is saturated (our outstanding requests >= its ``slots``),
to the least loaded rollout with a free slot of any other hardware (all serve the same
model: every pool is compatible) — RollArt's "falls back to compatible default resources
rather than stalling". When no slot is free anywhere, ``queue = true`` (the default)
holds the turn in the env-host until one frees, so the choice is made when a slot is
there to take; ``queue = false`` puts it on the preferred hardware's least loaded
rollout (relative to its slots) to wait inside that engine. A tag without a preference
goes to the least loaded rollout with a free slot, any hardware.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictStr

from rlfleet.common.spec.registry import Kind, KindConfig, Problem

from .routing_policy import R, Route, RoutingPolicy, least

Label = StrictStr


def choose_affine(candidates: Sequence[R], tag: str, prefer: Mapping[str, str],
                  hardware: Callable[[R], str], slots: Callable[[R], int | None],
                  rng: random.Random, queue: bool) -> tuple[R | None, bool]:
    """(the rollout, whether it is a fallback), or (None, False): wait for a slot.
    ``hardware(r)``: its label; ``slots(r)``: how many sequences it decodes at once
    (None: unknown, never saturated)."""
    def saturated(r: R) -> bool:
        n = slots(r)
        return n is not None and r.outstanding >= n

    wanted = prefer.get(tag)
    preferred = [r for r in candidates if wanted is None or hardware(r) == wanted]
    free = [r for r in preferred if not saturated(r)]
    if free:
        return least(free, rng), False
    others = [r for r in candidates if wanted is not None and hardware(r) != wanted and not saturated(r)]
    if others:
        return least(others, rng), True
    if queue:
        return None, False
    # Every slot taken: wait inside the preferred hardware's engine with the shortest
    # queue for its size (none of that hardware live: any rollout, a fallback).
    return least(preferred or list(candidates), rng,
                 load=lambda r: r.outstanding / max(1, slots(r) or 1)), not preferred


class Affinity(RoutingPolicy):
    def __init__(self, prefer: Mapping[str, str], queue: bool = True,
                 rng: random.Random | None = None) -> None:
        super().__init__()
        self.prefer = dict(prefer)
        self.queue = queue
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[R], route: Route | None = None) -> R | None:
        tag = route.tag if route is not None else ""
        r, fallback = choose_affine(candidates, tag, self.prefer, lambda c: self.traits(c).hardware,
                                    lambda c: self.traits(c).slots, self._rng,
                                    self.queue and route is not None)
        if r is not None:
            self.record(route, r, fallback)
        return r

    def bindings(self) -> dict[str, Any]:
        return {"prefer": dict(self.prefer), **super().bindings()}


class AffinityConfig(KindConfig):
    kind: Literal["affinity"] = "affinity"
    # tag (a prompt kind: the sim task's kinds[].tag, else the task's name) -> hardware
    # label (a sim pool's ``hardware``, a real rollout's node label ``hardware``)
    prefer: dict[Label, Label] = Field(default_factory=dict)
    queue: bool = True  # no free slot anywhere: wait in the env-host (else in the preferred engine)


def spec_tags(sections: Mapping[str, BaseModel]) -> list[str] | None:
    """The tags the job's task gives its prompts (None: the task section did not validate)."""
    task = sections.get("task")
    env = getattr(task, "env", None)
    if env is None:
        return None
    kinds = getattr(env, "kinds", None) or []
    return [k.tag for k in kinds] or [env.kind]


def spec_hardware(sections: Mapping[str, BaseModel]) -> list[str] | None:
    """The hardware labels the spec's rollouts carry (None: only known at run time)."""
    engine = getattr(sections.get("rollout"), "engine", None)
    labels = getattr(engine, "hardware_labels", None)
    return labels() if callable(labels) else None


class AffinityKind(Kind):
    Config = AffinityConfig

    @classmethod
    def build(cls, config: AffinityConfig, /, *, name: str = "env-host", **_: Any) -> Affinity:
        policy = Affinity(config.prefer, queue=config.queue)
        policy.name = name
        return policy

    @classmethod
    def check(cls, config: AffinityConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        problems: list[Problem] = []
        tags, hardware = spec_tags(sections), spec_hardware(sections)
        for tag, label in config.prefer.items():
            if tags is not None and tag not in tags:
                problems.append((("prefer", tag), f"unknown tag {tag!r} (the task's tags: "
                                                  f"{', '.join(map(repr, tags))})"))
            if hardware is not None and label not in hardware:
                problems.append((("prefer", tag), f"unknown hardware {label!r} (the rollouts': "
                                                  f"{', '.join(map(repr, hardware))})"))
        return problems
