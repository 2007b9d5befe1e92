"""The prompt stream is exactly task.make_prompts (docs/design/dataflow.md), ids are stable."""

from __future__ import annotations

import pytest

from rlfleet.common.spec.job import parse_spec
from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.prompts import (
    PromptStream,
    group_id,
    parse_trajectory_id,
    task_from_spec,
    task_kwargs,
    trajectory_id,
)

from .fakes import tokenizer_dir


@pytest.mark.parametrize("name,difficulty,n", [("arithmetic", {}, 300),
                                               ("frozenlake", {"max_turns": 8}, 40)])
def test_stream_matches_make_prompts(name, difficulty, n):
    task = get_task(name, **difficulty)
    stream = PromptStream(task, seed=11)
    expected = task.make_prompts("train", n, seed=11)
    assert stream.cached(0) is None  # nothing generated yet
    assert [stream.get(i) for i in reversed(range(n))] == expected[::-1]
    assert [stream.cached(i) for i in range(n)] == expected
    assert stream.cached(len(stream._prompts)) is None and stream.cached(-1) is None


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
    fl = spec_of({"max_turns": 8, "env": {"kind": "frozenlake", "size": 5}})
    assert task_kwargs(fl) == {"size": 5, "p": 0.75, "max_turns": 8}
    assert task_from_spec(fl).max_turns == 8 and task_from_spec(fl).size == 5
    ar = spec_of({"max_turns": 8, "env": {"kind": "arithmetic", "digits": 3}})
    # single-turn: [task] max_turns is not a knob of arithmetic
    assert task_kwargs(ar) == {"digits": 3, "min_digits": 2, "ops": "+"}
    assert task_from_spec(ar).difficulty() == get_task("arithmetic", digits=3).difficulty()


def test_task_defaults_are_the_task_classes_defaults():
    # An omitted knob must build the same task as before the knobs were typed.
    for kind in ("arithmetic", "frozenlake"):
        spec = spec_of({"max_turns": 12, "env": {"kind": kind}})
        kwargs = {"max_turns": 12} if kind == "frozenlake" else {}
        assert task_from_spec(spec).difficulty() == get_task(kind, **kwargs).difficulty()
