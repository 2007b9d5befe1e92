"""The repack planner's view of one rollout, and the checks a stats reply passes first.

A rollout answers the repack-manager's poll with a ``RolloutStats`` (common/wire/messages.py):
raw counters as the engine reports them. The planner wants two numbers per rollout
(Laminar §5.2): ``C_used``, the share of the KV cache in use, and ``N_reqs``, the
requests it holds (running + waiting), plus its weight version. ``check_stats`` turns
the replies of one poll into those ``RolloutLoad``s and refuses the impossible ones
(``C_used > 1``, negative counts, NaN, a rollout that is not a live member, a reply
from someone other than the rollout asked) with a ``Rejection`` that says why, so the
daemon counts them (``code`` is a small fixed set: a metric label) and never plans
on them.

Pure: no sockets, no etcd, no clock. ``common.wire`` is imported for type checking
only, so that the planner kinds' module (imported whenever a spec is validated)
stays free of numpy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.common.wire.messages import RolloutStats

__all__ = ["REJECTION_CODES", "Rejection", "RolloutLoad", "check_reply", "check_stats", "engine_batch_limit"]


@dataclass(frozen=True, slots=True)
class RolloutLoad:
    """One rollout as the planner sees it, from one accepted stats reply."""

    id: str
    version: int  # weight version it generates with
    c_used: float  # kv_used / kv_total, in [0, 1]
    n_reqs: int  # running + waiting: what a repack would move
    # The roofline batch B of its engine (Laminar §5.2: the most requests one decode
    # step holds before it turns compute-bound). None: unknown; the planner then needs
    # [repack_manager.planner] roofline_batch, or leaves this rollout out.
    batch_limit: int | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    rollout_id: str  # the rollout that was asked
    code: str  # one of REJECTION_CODES
    reason: str  # the numbers that were wrong

    def __str__(self) -> str:
        return f"rollout {self.rollout_id!r}: {self.reason}"


REJECTION_CODES = ("unknown_rollout", "wrong_rollout", "type", "non_finite", "negative",
                   "kv_total", "kv_over_capacity", "batch_limit")

_COUNTS = ("weight_version", "running", "waiting", "kv_used", "kv_total")
_RATES = ("tokens_per_s", "time")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_reply(asked: str, stats: RolloutStats, live: Collection[str],
                batch_limit: int | None = None) -> RolloutLoad | Rejection:
    """The load of ``asked`` from its reply ``stats``, or why the reply is refused.

    ``live``: the rollout ids registered as members now. ``batch_limit``: B of that
    rollout's engine, if the daemon knows it.
    """
    def no(code: str, reason: str) -> Rejection:
        return Rejection(asked, code, reason)

    if asked not in live:
        return no("unknown_rollout", "not a live rollout member")
    if stats.rollout_id != asked:
        return no("wrong_rollout", f"the reply names rollout {stats.rollout_id!r}")
    for name in _COUNTS:
        value = getattr(stats, name)
        if not _is_int(value):
            return no("type", f"{name} must be an integer, got {value!r}")
        if name == "kv_total" and value <= 0:
            return no("kv_total", f"kv_total must be > 0, got {value}")
        if value < 0:
            return no("negative", f"{name} must be >= 0, got {value}")
    for name in _RATES:
        value = getattr(stats, name)
        if not (_is_int(value) or isinstance(value, float)):
            return no("type", f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            return no("non_finite", f"{name} must be finite, got {value}")
    if stats.tokens_per_s < 0:
        return no("negative", f"tokens_per_s must be >= 0, got {stats.tokens_per_s}")
    if stats.kv_used > stats.kv_total:
        return no("kv_over_capacity", f"kv_used {stats.kv_used} > kv_total {stats.kv_total} "
                                      f"(C_used {stats.kv_used / stats.kv_total:.4g} > 1)")
    if batch_limit is not None and (not _is_int(batch_limit) or batch_limit <= 0):
        return no("batch_limit", f"batch_limit must be a positive integer, got {batch_limit!r}")
    return RolloutLoad(asked, stats.weight_version, stats.kv_used / stats.kv_total,
                       stats.running + stats.waiting, batch_limit)


def check_stats(replies: Mapping[str, RolloutStats], live: Collection[str],
                batch_limits: Mapping[str, int] | None = None,
                ) -> tuple[dict[str, RolloutLoad], list[Rejection]]:
    """The replies of one poll (asked rollout id -> its reply) split into the
    accepted loads (by rollout id) and the rejections, in the replies' order."""
    live = live if isinstance(live, (set, frozenset, dict)) else set(live)
    limits = batch_limits or {}
    loads: dict[str, RolloutLoad] = {}
    rejections: list[Rejection] = []
    for asked, stats in replies.items():
        checked = check_reply(asked, stats, live, limits.get(asked))
        if isinstance(checked, Rejection):
            rejections.append(checked)
        else:
            loads[asked] = checked
    return loads, rejections


def engine_batch_limit(engine_config: Any) -> int | None:
    """B from a ``[rollout.engine]`` table: its ``roofline_batch`` if the kind has one
    (a profile's roofline), else its ``max_batch`` (the most requests it decodes at
    once), else None."""
    for key in ("roofline_batch", "max_batch"):
        value = getattr(engine_config, key, None)
        if _is_int(value) and value > 0:
            return value
    return None
