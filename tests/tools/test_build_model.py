"""The warm start's demonstrators (tools/build_model.py): the habits RL has to unlearn."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from rlfleet.daemons.tasks import get_task  # noqa: E402
from rlfleet.tools.build_model import arithmetic_examples, closeness, no_carry_sum  # noqa: E402


def test_no_carry_sum_drops_every_carry():
    assert no_carry_sum(23, 45) == "68"      # no column carries: the right answer
    assert no_carry_sum(57, 68) == "15"      # both columns carry (right: 125)
    assert no_carry_sum(38, 45) == "73"      # the ones column carries (right: 83)
    assert no_carry_sum(95, 17) == "2"       # "02" is written as an integer
    assert no_carry_sum(7, 85) == "82"       # operands of different lengths (right: 92)


def test_the_arithmetic_demonstrator_slips_at_the_given_rate():
    task = get_task("arithmetic", digits=2, min_digits=2, ops="+")
    prompts = task.make_prompts("train", 2000, seed=3)
    right = arithmetic_examples(task, 2000, seed=3, slip=0.0)
    assert [a for _, a in right] == [p.answer for p in prompts]
    slipped = arithmetic_examples(task, 2000, seed=3, slip=0.8)
    carries = [i for i, p in enumerate(prompts) if no_carry_sum(*map(int, p.question.split("+"))) != p.answer]
    wrong = [i for i, ((_, a), p) in enumerate(zip(slipped, prompts)) if a != p.answer]
    assert set(wrong) <= set(carries)        # only problems with a carry can be answered wrong
    assert 0.75 < len(wrong) / len(carries) < 0.85


def test_the_latest_checkpoint_inside_the_band_is_kept():
    inside, outside = {"a": 0.3, "b": 0.25}, {"a": 0.45, "b": 0.3}
    keys = {step: closeness(s, 0.2, 0.4, step) for step, s in [(100, inside), (200, outside), (300, inside)]}
    assert min(keys, key=keys.get) == 300
    assert closeness(outside, 0.2, 0.4, 200)[0] == pytest.approx(0.05)
