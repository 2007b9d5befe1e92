"""Task definitions (prompts, environments, rule rewards) for env-hosts and reward-hosts."""

from __future__ import annotations

import inspect
from typing import Any

from rlfleet.common.spec.seams import TASKS

from .arithmetic import ArithmeticTask  # pure Python, cheap: importable directly
from .base import ANSWER_MARK, AsyncTaskEnv, Prompt, Split, Task, TaskEnv, split_of, undecoded_action


def get_task(name: str, **difficulty: Any) -> Task:
    """The task `name` at the given difficulty, e.g. get_task("arithmetic", digits=2).

    The names are the task registry's (kinds.py, registered as ``rlfleet.tasks`` entry
    points); a task module is imported on first use (gymnasium only where frozenlake
    runs). Unknown names and unknown difficulty knobs are ValueErrors that list the
    valid ones.
    """
    if name not in TASKS.kinds():
        raise ValueError(f"task: must be one of {TASKS.names()}, got {name!r}")
    cls = TASKS.get(name).task_class()  # type: ignore[attr-defined]
    knobs = list(inspect.signature(cls).parameters)
    unknown = sorted(set(difficulty) - set(knobs))
    if unknown:
        raise ValueError(f"task {name!r} has no knob(s) {unknown}; it has {knobs}")
    return cls(**difficulty)


__all__ = ["AsyncTaskEnv", "ANSWER_MARK", "ArithmeticTask", "Prompt", "Split", "Task", "TaskEnv",
           "get_task", "split_of", "undecoded_action"]
