"""The env-host routing seam: ``[env_host.routing]``, which rollout gets a turn.

The Router (routing.py) does the I/O: it keeps the live rollouts, narrows them to
the ones a turn may use (not excluded, not suspect, with fallbacks) and asks the
policy to choose among those. A policy is plain code over ``RolloutLoad``s, no
sockets, unit-tested in process. Later kinds: hardware affinity, prefix locality.

Registered in pyproject.toml (``rlfleet.env_routers``).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeVar

from rlfleet.common.registry import Kind, KindConfig


class RolloutLoad(Protocol):
    id: str
    outstanding: int  # this env-host's requests in flight to that rollout


R = TypeVar("R", bound=RolloutLoad)


class RoutingPolicy(abc.ABC):
    @abc.abstractmethod
    def choose(self, candidates: Sequence[R]) -> R:
        """One of ``candidates`` (never empty) for the next turn."""


class LeastLoaded(RoutingPolicy):
    """Fewest of our own requests outstanding; ties broken at random so that env-hosts
    that all see idle rollouts do not all pick the first one."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[R]) -> R:
        least = min(r.outstanding for r in candidates)
        return self._rng.choice([r for r in candidates if r.outstanding == least])


class LeastLoadedConfig(KindConfig):
    kind: Literal["least_loaded"] = "least_loaded"


class LeastLoadedKind(Kind):
    Config = LeastLoadedConfig

    @classmethod
    def build(cls, config: LeastLoadedConfig, /, **_: Any) -> LeastLoaded:
        return LeastLoaded()
