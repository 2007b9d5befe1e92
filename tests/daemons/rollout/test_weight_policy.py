"""The rollout's weight-update policy in process: no engine, reader or socket."""

from __future__ import annotations

import threading

from rlfleet.daemons.rollout.weight_policy import KEEP, WeightAction, WeightUpdatePolicy


def test_the_reader_is_asked_at_most_every_check_every_s():
    p = WeightUpdatePolicy(check_every_s=0.05)
    assert [p.check_due(t) for t in (10.0, 10.01, 10.049, 10.05, 10.06)] == [True, False, False, True, False]


def test_a_newer_version_loads_at_once_when_nothing_runs():
    p = WeightUpdatePolicy()
    assert p.decide(serving=3, running=False) == KEEP  # the reader said nothing yet
    p.saw(3)
    assert p.decide(serving=3, running=False) == KEEP and p.pending(3) is None
    p.saw(5)  # versions may be skipped: the newest is loaded
    assert p.decide(serving=3, running=False) == WeightAction(5, cut_running=False)
    p.saw(4)  # older than what is served: never loaded
    assert p.decide(serving=5, running=False) == KEEP


def test_running_requests_are_never_mixed_unless_released():
    p = WeightUpdatePolicy()
    p.saw(2)
    assert p.decide(serving=1, running=True) == KEEP  # wait for the batch to drain
    assert p.hold(serving=1)  # and hold new requests back so it can
    p.release()
    assert p.decide(serving=1, running=True) == WeightAction(2, cut_running=True)
    assert not p.released  # used up by the load


def test_a_release_waits_for_the_version_while_requests_run_and_lapses_when_idle():
    p = WeightUpdatePolicy()
    p.release()
    assert p.decide(serving=1, running=True) == KEEP and p.released  # kept: no newer version yet
    p.saw(2)
    assert p.decide(serving=1, running=True) == WeightAction(2, cut_running=True)
    p.release()
    p.saw(2)
    assert p.decide(serving=2, running=False) == KEEP and not p.released  # nothing to cut: moot


def test_a_held_request_waits_at_most_hold_max_s():
    p = WeightUpdatePolicy(hold_max_s=2.0)
    assert p.admit(serving=1, held_since=0.0, now=0.0)  # nothing pending: admitted at once
    p.saw(2)
    assert not p.admit(serving=1, held_since=10.0, now=11.9)
    assert p.admit(serving=1, held_since=10.0, now=12.0)  # under version 1, after all


def test_a_refused_version_is_skipped_until_a_newer_one_appears():
    p = WeightUpdatePolicy()
    p.saw(2)
    p.refused(2)
    assert p.decide(serving=1, running=False) == KEEP and not p.hold(serving=1)
    p.saw(3)
    assert p.decide(serving=1, running=False) == WeightAction(3)


def test_release_may_come_from_another_thread():
    p = WeightUpdatePolicy()
    p.saw(2)
    t = threading.Thread(target=p.release)
    t.start()
    t.join()
    assert p.decide(serving=1, running=True) == WeightAction(2, cut_running=True)
