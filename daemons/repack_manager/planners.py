"""The repack-planner seam: ``[repack_manager.planner]``, which rollouts hand their
running generations to which.

A planner is plain code over the checked loads of the live rollouts (rollout_view.py:
``check_stats`` turns a poll's ``RolloutStats`` replies into ``RolloutLoad``s), no
sockets, no clock: it returns a ``RepackDecision``, the repack-manager does the I/O.

- ``none`` (the default) plans nothing: the repack-manager only collects statistics.
- ``laminar``: Laminar §5.2, Algorithm 1 (Best-Fit Trajectory Consolidation). Per
  weight version, the rollouts in ramp-down (KV usage falling and below ``c_max``,
  fewer than ``B`` requests) are packed onto the fewest of them: each, smallest KV
  footprint first, moves to the candidate that ends up most densely packed while
  staying within ``c_max`` of KV and ``B`` requests. The emptied sources then pull
  the newest weights.

Registered in pyproject.toml (``rlfleet.repack_planners``). This module is imported
whenever a spec is validated, so it stays stdlib-only (rollout_view imports
common.wire for type checking only).
"""

from __future__ import annotations

import abc
import hashlib
from bisect import bisect_left, bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from rlfleet.common.spec.fields import PosFloat, PosInt
from rlfleet.common.spec.registry import Kind, KindConfig, Problem

from .rollout_view import RolloutLoad, engine_batch_limit

__all__ = ["LaminarConfig", "LaminarKind", "LaminarPlanner", "Move", "NoPlanner", "NoneConfig", "NoneKind",
           "RepackDecision", "RepackPlanner", "plan_id"]

_NO_PREVIOUS: Mapping[str, RolloutLoad] = MappingProxyType({})


class Move(NamedTuple):
    source: str  # rollout id that hands its running generations over
    destination: str  # rollout id (same weight version) that continues them


@dataclass(frozen=True, slots=True)
class RepackDecision:
    """One planning round's decision. ``id`` is a digest of the planner's inputs
    (``plan_id``): the same loads give the same id, so a repack-manager that replans
    after a restart over unchanged stats finds its plan already recorded, and a
    changed fleet gets a new id."""

    id: str
    moves: tuple[Move, ...] = ()
    # The candidates S (ramp-down rollouts) of every version group, in the order
    # Algorithm 1 took them as sources (version, then C_used, then id).
    candidates: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.moves)


class RepackPlanner(abc.ABC):
    @abc.abstractmethod
    def plan(self, loads: Mapping[str, RolloutLoad],
             previous: Mapping[str, RolloutLoad] = _NO_PREVIOUS) -> RepackDecision:
        """The plan for now, given rollout id -> its load now (accepted stats only)
        and rollout id -> its load at the previous planning round (the daemon keeps
        these; a rollout missing from ``previous`` has no C_prev)."""


class NoPlanner(RepackPlanner):
    def plan(self, loads: Mapping[str, Any],
             previous: Mapping[str, Any] = _NO_PREVIOUS) -> RepackDecision:
        return RepackDecision("none")


class NoneConfig(KindConfig):
    kind: Literal["none"] = "none"


class NoneKind(Kind):
    Config = NoneConfig

    @classmethod
    def build(cls, config: NoneConfig, /, **_: Any) -> NoPlanner:
        return NoPlanner()


# ---- laminar: Algorithm 1 --------------------------------------------------------

Fraction = Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)]

# Slack for the bisection only: CanFit itself is evaluated exactly as written
# (C_load + s.C_used <= C_max) on every destination the bisection lets through, so
# this only has to cover the rounding of C_max - s.C_used.
_EPS = 1e-9


class LaminarConfig(KindConfig):
    kind: Literal["laminar"] = "laminar"
    c_max: Fraction = 0.99  # KV share that counts as full (Laminar Fig. 9: 99%)
    # B: the most requests a destination may hold after a repack. None: each
    # rollout's own, from its engine (RolloutLoad.batch_limit, which the daemon fills
    # from the engine profile); a rollout whose B is unknown is then left out.
    roofline_batch: PosInt | None = None
    # Seconds between planning rounds besides the one after each weight publish
    # (read by the repack-manager; the planner itself has no clock).
    interval_s: PosFloat = 5.0


class LaminarKind(Kind):
    Config = LaminarConfig

    @classmethod
    def build(cls, config: LaminarConfig, /, **_: Any) -> LaminarPlanner:
        return LaminarPlanner(config.c_max, config.roofline_batch)

    @classmethod
    def check(cls, config: LaminarConfig, sections: Mapping[str, BaseModel]) -> list[Problem]:
        rollout = sections.get("rollout")
        engine = getattr(rollout, "engine", None)
        if config.roofline_batch is None and engine is not None and engine_batch_limit(engine) is None:
            return [(("roofline_batch",), f"required: the {getattr(engine, 'kind', '?')!r} rollout engine "
                                          "has no roofline_batch or max_batch to take B from")]
        return []


class LaminarPlanner(RepackPlanner):
    def __init__(self, c_max: float = 0.99, roofline_batch: int | None = None) -> None:
        self.c_max = c_max
        self.roofline_batch = roofline_batch

    def batch_limit(self, load: RolloutLoad) -> int | None:
        return self.roofline_batch if self.roofline_batch is not None else load.batch_limit

    def is_candidate(self, load: RolloutLoad, prev: RolloutLoad | None) -> bool:
        """Line 3 of Algorithm 1: in ramp-down (C_used fell since the last round and is
        below C_max) and holding fewer than B requests. Besides the paper:
        - no C_prev, or a C_prev from another weight version, is no evidence of
          ramp-down (a rollout that just loaded new weights starts from an empty
          cache, so its old C_prev would read as a fall): not a candidate;
        - N_reqs == 0: nothing to move, and as a destination it would be held on an
          old version while it should pull the newest (it does so by itself as soon as
          it is empty): not a candidate;
        - B unknown (no roofline_batch, no batch_limit): no bound to pack against."""
        limit = self.batch_limit(load)
        return (prev is not None and prev.version == load.version
                and load.c_used < min(self.c_max, prev.c_used)
                and 0 < load.n_reqs and limit is not None and load.n_reqs < limit)

    def plan(self, loads: Mapping[str, RolloutLoad],
             previous: Mapping[str, RolloutLoad] = _NO_PREVIOUS) -> RepackDecision:
        groups: dict[int, list[RolloutLoad]] = {}
        for load in loads.values():
            if self.is_candidate(load, previous.get(load.id)):
                groups.setdefault(load.version, []).append(load)
        moves: list[Move] = []
        candidates: list[str] = []
        for version in sorted(groups):
            group = sorted(groups[version], key=lambda r: (r.c_used, r.id))  # line 4
            candidates.extend(r.id for r in group)
            moves.extend(self._best_fit(group))
        return RepackDecision(plan_id(f"laminar:{self.c_max!r}:{self.roofline_batch}", loads, previous),
                    tuple(moves), tuple(candidates))

    def _best_fit(self, group: Sequence[RolloutLoad]) -> list[Move]:
        """Lines 5-13 over one version's candidates, sorted by C_used.

        The paper recomputes each destination's load by summing the plan (O(|S|^2)
        sums per source); here every candidate that may still receive sits in a list
        sorted by (C_load, id) with its load kept up to date, so the best fit is a
        bisection to C_max - s.C_used and a walk down past those that would break B.
        The choice is the same: the largest C_load that fits, ties to the larger id.
        """
        c_max = self.c_max
        open_ = sorted((r.c_used, r.id) for r in group)  # not emptied: may receive
        n_load = {r.id: r.n_reqs for r in group}
        limit = {r.id: self.batch_limit(r) for r in group}
        receiving: set[str] = set()
        moves: list[Move] = []
        for s in group:
            # A destination never becomes a source within a plan: its own requests
            # and those in flight to it would have to move twice. (The paper's line 7
            # skips only emptied rollouts.) An emptied rollout is never a destination:
            # it left open_ when it was emptied (line 9, d not in E).
            if s.id in receiving:
                continue
            top = bisect_right(open_, (c_max - s.c_used + _EPS,))
            for j in range(top - 1, -1, -1):
                c_load, d = open_[j]
                if (d != s.id and n_load[d] + s.n_reqs <= limit[d]  # type: ignore[operator]
                        and c_load + s.c_used <= c_max):  # CanFit, line 17
                    break
            else:
                continue  # D_s empty: s keeps its requests, and may still receive later
            moves.append(Move(s.id, d))
            k = bisect_left(open_, (s.c_used, s.id))  # s is emptied: it leaves open_
            del open_[k]
            del open_[j - 1 if k < j else j]
            n_load[d] += s.n_reqs
            receiving.add(d)
            if n_load[d] < limit[d]:  # type: ignore[operator]
                insort(open_, (c_load + s.c_used, d))
            # else d holds B requests: no candidate (N_reqs >= 1) fits it any more, and
            # dropping it spares the walks of later sources.
        return moves


def plan_id(planner: str, loads: Mapping[str, RolloutLoad], previous: Mapping[str, RolloutLoad]) -> str:
    """A digest of what a plan was made from: the planner and its settings, and every
    rollout's load and previous load."""
    h = hashlib.blake2b(planner.encode(), digest_size=8)
    for rid in sorted(loads):
        r, p = loads[rid], previous.get(rid)
        h.update(f"\n{rid}\0{r.version}\0{r.c_used!r}\0{r.n_reqs}\0{r.batch_limit}".encode())
        if p is not None:
            h.update(f"\0{p.version}\0{p.c_used!r}".encode())
    return f"plan-{h.hexdigest()}"
