"""Batch selection (staleness bound, FIFO) and trajectory validation."""

from __future__ import annotations

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn
from rlfleet.daemons.trainer.batching import check_trajectory, drop_reason, select_groups, staleness

from .conftest import scored


def multi_version(prompt_id: int, k: int, versions: list[int]) -> ScoredTrajectory:
    turns = [Turn(Int32Array([1, 5]), Int32Array([7]), Float32Array([-0.1]), v, "o", "a")
             for v in versions]
    t = Trajectory(f"p{prompt_id}-g{k}", prompt_id, f"p{prompt_id}", "frozenlake", turns, 0.0)
    return ScoredTrajectory(t, 0.0)


def test_staleness_is_that_of_the_oldest_turn():
    assert staleness(multi_version(0, 0, [3, 5, 6]), trainer_version=7) == 4
    assert staleness(scored(0, 0, 1.0, version=7), 7) == 0


def test_select_takes_oldest_complete_groups_and_drops_stale_ones_whole():
    complete = [
        ("p0", [scored(0, 0, 1.0, version=9), scored(0, 1, 0.0, version=10)]),
        ("p1", [scored(1, 0, 1.0, version=10), multi_version(1, 1, [6, 10])]),  # 4 versions old
        ("p2", [scored(2, 0, 1.0, version=10), scored(2, 1, 0.0, version=10)]),
        ("p3", [scored(3, 0, 1.0, version=10), scored(3, 1, 0.0, version=10)]),
    ]
    sel = select_groups(complete, n_groups=2, trainer_version=10, max_staleness=2)
    assert sel.groups == ["p0", "p2"]
    assert sel.drops == [("p1", "staleness", "p1-g1: staleness 4 > max_staleness 2")]
    assert dict(sel.staleness) == {1: 1, 0: 3}
    # Unbounded: nothing is dropped, the oldest groups go first.
    sel = select_groups(complete, n_groups=2, trainer_version=10, max_staleness=None)
    assert sel.groups == ["p0", "p1"] and sel.drops == [] and dict(sel.staleness) == {1: 1, 0: 2, 4: 1}


def test_groups_without_signal_are_dropped_while_the_budget_lasts():
    complete = [
        ("p0", [scored(0, 0, 1.0), scored(0, 1, 1.0)]),  # all solved: advantage 0 for both
        ("p1", [scored(1, 0, 1.0), scored(1, 1, 0.0)]),
        ("p2", [scored(2, 0, 0.0), scored(2, 1, 0.0)]),  # none solved
        ("p3", [scored(3, 0, 0.0), scored(3, 1, 1.0)]),
        ("p4", [scored(4, 0, 0.5), scored(4, 1, 0.5)]),
    ]
    sel = select_groups(complete, n_groups=2, trainer_version=0, max_staleness=None, no_signal_budget=5)
    assert sel.groups == ["p1", "p3"]
    assert sel.drops == [("p0", "no_signal", "all 2 rewards 1.0"), ("p2", "no_signal", "all 2 rewards 0.0")]
    # The budget spent, such groups are trained as they come (a solved task still finishes).
    sel = select_groups(complete, n_groups=3, trainer_version=0, max_staleness=None, no_signal_budget=1)
    assert sel.groups == ["p1", "p2", "p3"] and [d[0] for d in sel.drops] == ["p0"]
    # Off by default.
    sel = select_groups(complete, n_groups=2, trainer_version=0, max_staleness=None)
    assert sel.groups == ["p0", "p1"] and sel.drops == []


def test_drop_reasons_from_upstream():
    assert drop_reason(scored(0, 0, 0.0, dropped_reason="env_error")) == (
        "env_error", "p0-g0: dropped upstream")
    assert drop_reason(scored(0, 1, 0.0, reward_error="sandbox timeout")) == (
        "reward_error", "p0-g1: sandbox timeout")
    assert drop_reason(scored(0, 2, 1.0)) == ("", "")


def test_check_trajectory_names_the_problem():
    assert check_trajectory(scored(0, 0, 1.0), vocab_size=38) == ""
    assert check_trajectory(scored(0, 0, 1.0, tokens=(7, 40)), 38) == (
        "p0-g0 turn 0: token id 40 outside the vocabulary (size 38)")
    assert check_trajectory(scored(0, 0, 1.0, tokens=(7, 8), logprobs=(-1.0,)), 38) == (
        "p0-g0 turn 0: 2 token ids but 1 log-probs (both must be 1-d and of equal length)")
    assert check_trajectory(scored(0, 0, 1.0, logprobs=(-1.0, float("nan"))), 38) == (
        "p0-g0 turn 0: log-prob nan is not a finite value <= 0")
    assert check_trajectory(scored(0, 0, float("inf")), 38) == "p0-g0: reward is inf"
    assert check_trajectory(scored(0, 0, 1.0, prompt=()), 38) == (
        "p0-g0 turn 0: prompt_token_ids must be a non-empty 1-d array")
    assert check_trajectory(scored(0, 0, 1.0, turns=0), 38) == "p0-g0: no turns"


def test_after_batch_holds_a_round_until_every_group_of_it_has_arrived():
    from rlfleet.daemons.trainer.batching import in_finished_rounds, prompt_of

    assert [prompt_of(g) for g in ("p0", "p17", "q3", "p", "p-1", "pa")] == [0, 17, None, None, None, None]
    arrived = {"p0", "p1", "p2", "p4", "p5"}  # rounds of 3: [0, 3) all in, [3, 6) lacks p3
    complete = ["p4", "p0", "p2", "odd"]      # p1: trained already (received, not complete)
    assert in_finished_rounds(complete, 3, arrived.__contains__) == ["p0", "p2", "odd"]
    arrived.add("p3")
    assert in_finished_rounds(complete, 3, arrived.__contains__) == ["p4", "p0", "p2", "odd"]
    assert in_finished_rounds([], 3, arrived.__contains__) == []
