"""LogThrottle on a fake clock: one line per key per interval, the held-back count in the next."""

from __future__ import annotations

import logging

import pytest

from rlfleet.common.log_throttle import LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval_and_the_next_says_how_many_were_held():
    clock = Clock()
    t = LogThrottle(10.0, clock=clock)
    assert t.admit("a") == 0
    assert [t.admit("a") for _ in range(5)] == [None] * 5
    assert t.admit("b") == 0  # keys are independent
    clock.now += 9.999
    assert t.admit("a") is None
    clock.now += 0.001  # an interval after a's last line
    assert t.admit("a") == 6
    assert t.admit("a") is None
    clock.now += 60
    assert t.admit("a") == 1 and t.admit("b") == 0


def test_log_writes_the_count_in_the_text_and_as_a_field(caplog):
    clock = Clock()
    t = LogThrottle(5.0, clock=clock)
    log = logging.getLogger("rlfleet.test.throttle")
    caplog.set_level(logging.INFO, logger=log.name)
    results = [t.warning(log, "refused", "refused %s", f"t{i}", extra={"event": "refused"}) for i in range(4)]
    clock.now += 5
    results.append(t.log(log, logging.INFO, "refused", "refused %s", "t4"))
    assert results == [True, False, False, False, True]
    assert [(r.levelno, r.getMessage(), r.suppressed) for r in caplog.records] == [
        (logging.WARNING, "refused t0", 0),
        (logging.INFO, "refused t4 (3 more like this since the last such line, not logged)", 3)]
    assert caplog.records[0].event == "refused"


def test_many_keys_do_not_grow_without_bound():
    clock = Clock()
    t = LogThrottle(10.0, clock=clock, max_keys=100)
    for i in range(1000):
        assert t.admit(i) == 0
        clock.now += 0.001
    assert len(t._keys) <= 100
    assert t.admit(999) is None  # the newest keys are kept, still within their interval


def test_a_zero_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        LogThrottle(0)
