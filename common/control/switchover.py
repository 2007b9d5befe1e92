"""What a singleton's members do about a `switchover/<role>` request (docs/operations/switchover.md):
the decisions alone, kept apart from common/control/session.py, which does the reads and writes.

The leader reads the request once a cycle; a candidate reads it only when the leader
key is vacant (no cost while a leader is in place)."""

from __future__ import annotations

from rlfleet.common.control.operations import Switchover

STAY, DONE, HAND_OVER = "stay", "done", "hand-over"


def leader_action(request: Switchover | None, me: str) -> str:
    """What the leader `me` does about the request: STAY (none, malformed, or addressed to
    another leader: it expires by itself), DONE (it names us: delete it), HAND_OVER."""
    if request is None or request.problem or not request.to:
        return STAY
    if request.to == me:
        return DONE
    if request.from_ and request.from_ != me:
        return STAY  # asked of a leader that is gone: not ours to act on
    return HAND_OVER


def vacancy_target(request: Switchover | None) -> str:
    """Who alone may campaign while the leader key is vacant: the request's target, or ""
    (anyone) when no well-formed request stands."""
    if request is None or request.problem:
        return ""
    return request.to
