"""The torch-free parts every engine shares: the token-rate window."""

from __future__ import annotations

import pytest

from rlfleet.daemons.rollout.engines.api import TokenRate


def test_rate_is_zero_before_any_token():
    assert TokenRate().per_s(now=100.0) == 0.0


def test_rate_counts_tokens_since_the_first_step_in_the_window():
    rate = TokenRate(window_s=5.0)
    for t in range(10):  # 8 tokens a second for 10 s
        rate.add(8, now=100.0 + t)
    # Steps at 105..109 are within 5 s of 110 (104 just left): 40 tokens over 5 s.
    assert rate.per_s(now=110.0) == pytest.approx(40 / 5.0)


def test_one_early_step_does_not_read_as_a_burst():
    rate = TokenRate()
    rate.add(32, now=100.0)
    assert rate.per_s(now=100.0) == pytest.approx(32 / 0.1)


def test_an_idle_engine_falls_back_to_zero():
    rate = TokenRate(window_s=5.0)
    rate.add(100, now=100.0)
    assert rate.per_s(now=105.5) == 0.0
