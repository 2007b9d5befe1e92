"""The decisions of common/control/switchover.py: what a leader and a candidate do about a
`switchover/<role>` request."""

from __future__ import annotations

from rlfleet.common.control.operations import Switchover
from rlfleet.common.control.switchover import DONE, HAND_OVER, STAY, leader_action, vacancy_target

ROLE = "resource-manager"


def test_the_leader_hands_over_to_another_member():
    assert leader_action(Switchover(ROLE, to="rm-1", from_="rm-0"), "rm-0") == HAND_OVER
    assert leader_action(Switchover(ROLE, to="rm-1"), "rm-0") == HAND_OVER  # written without a from


def test_the_leader_stays_without_a_request_or_with_one_it_cannot_act_on():
    assert leader_action(None, "rm-0") == STAY
    assert leader_action(Switchover.parse(ROLE, {"from": "rm-0"}), "rm-0") == STAY  # malformed: no target
    assert leader_action(Switchover.parse(ROLE, "rm-1"), "rm-0") == STAY  # not an object
    # Asked of a leader that is gone: the leader now in office leaves it to expire.
    assert leader_action(Switchover(ROLE, to="rm-2", from_="rm-1"), "rm-0") == STAY


def test_a_request_naming_the_leader_is_done():
    assert leader_action(Switchover(ROLE, to="rm-0", from_="rm-1"), "rm-0") == DONE


def test_on_a_vacancy_only_the_target_may_campaign():
    assert vacancy_target(Switchover(ROLE, to="rm-1")) == "rm-1"
    assert vacancy_target(None) == ""
    assert vacancy_target(Switchover.parse(ROLE, {"to": 7})) == ""  # malformed: anyone may lead
