"""The prompt stream is exactly task.make_prompts (docs/dataflow.md), ids are stable."""

from __future__ import annotations

import pytest

from rlfleet.common.spec import parse_spec
from rlfleet.daemons.tasks.prompts import (
    PromptStream,
    group_id,
    parse_trajectory_id,
    task_from_spec,
    task_kwargs,
    trajectory_id,
)
from rlfleet.daemons.tasks import get_task

from .fakes import tokenizer_dir


@pytest.mark.parametrize("name,difficulty,n", [("arithmetic", {}, 300),
                                               ("frozenlake", {"max_turns": 8}, 40)])
def test_stream_matches_make_prompts(name, difficulty, n):
    task = get_task(name, **difficulty)
    stream = PromptStream(task, seed=11)
    expected = task.make_prompts("train", n, seed=11)
    assert [stream.get(i) for i in reversed(range(n))] == expected[::-1]


def test_ids_beyond_the_first_chunk_extend_the_same_stream():
    task = get_task("arithmetic", digits=1, min_digits=1)  # few distinct problems: the stream repeats them
    stream = PromptStream(task, seed=0)
    assert stream.get(3000) == task.make_prompts("train", 3001, seed=0)[3000]
    with pytest.raises(ValueError, match="prompt_id: must be >= 0"):
        stream.get(-1)


def test_ids():
    assert (group_id(12), trajectory_id(12, 3)) == ("p12", "p12-g3")
    assert parse_trajectory_id("p12-g3") == (12, 3)
    for bad in ("12-g3", "p12", "p-g1", "px-g1", "p1-gx"):
        with pytest.raises(ValueError, match="not a trajectory id"):
            parse_trajectory_id(bad)


def spec_of(task: dict):
    return parse_spec({"job": {"name": "t"}, "model": {"path": str(tokenizer_dir())}, "task": task})


def test_task_from_spec_applies_max_turns_to_multi_turn_tasks():
    fl = spec_of({"name": "frozenlake", "max_turns": 8, "difficulty": {"size": 5}})
    assert task_kwargs(fl) == {"size": 5, "max_turns": 8}
    assert task_from_spec(fl).max_turns == 8
    explicit = spec_of({"name": "frozenlake", "max_turns": 8, "difficulty": {"max_turns": 6}})
    assert task_from_spec(explicit).max_turns == 6
    ar = spec_of({"name": "arithmetic", "difficulty": {"digits": 2}})
    assert task_kwargs(ar) == {"digits": 2} and task_from_spec(ar).digits == 2
