"""The repack-planner seam: ``[repack_manager.planner]``, which rollouts hand their
running generations to which (Laminar §5, Algorithm 1, comes as a kind later).

A planner is plain code over the latest statistics of every live rollout, no
sockets: it returns the moves it wants; the repack-manager does the I/O.
``none`` (the default) plans nothing: the repack-manager only collects statistics.

Registered in pyproject.toml (``rlfleet.repack_planners``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from rlfleet.common.registry import Kind, KindConfig


class Move(NamedTuple):
    source: str  # rollout id that hands its running generations over
    destination: str  # rollout id (same weight version) that continues them


class RepackPlanner(abc.ABC):
    @abc.abstractmethod
    def plan(self, stats: Mapping[str, Any]) -> list[Move]:
        """Moves for now, given rollout id -> its latest RolloutStats."""


class NoPlanner(RepackPlanner):
    def plan(self, stats: Mapping[str, Any]) -> list[Move]:
        return []


class NoneConfig(KindConfig):
    kind: Literal["none"] = "none"


class NoneKind(Kind):
    Config = NoneConfig

    @classmethod
    def build(cls, config: NoneConfig, /, **_: Any) -> NoPlanner:
        return NoPlanner()
