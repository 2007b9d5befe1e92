"""Task definitions (prompts, environments, rule rewards) for env-hosts and reward-hosts."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .arithmetic import ArithmeticTask  # pure Python, cheap: importable directly
from .base import ANSWER_MARK, Prompt, Split, Task, TaskEnv, split_of

# name -> (module, class). Imported on first use: gymnasium is only needed by the hosts
# that actually run frozenlake.
_REGISTRY: dict[str, tuple[str, str]] = {
    "arithmetic": ("arithmetic", "ArithmeticTask"),
    "frozenlake": ("frozenlake", "FrozenLakeTask"),
}
TASK_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def get_task(name: str, **difficulty: Any) -> Task:
    """The task `name` at the given difficulty, e.g. get_task("arithmetic", digits=2).

    Unknown names and unknown difficulty knobs are ValueErrors that list the valid ones.
    """
    if name not in _REGISTRY:
        raise ValueError(f"task: must be one of {list(TASK_NAMES)}, got {name!r}")
    module, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(f".{module}", __name__), class_name)
    knobs = list(inspect.signature(cls).parameters)
    unknown = sorted(set(difficulty) - set(knobs))
    if unknown:
        raise ValueError(f"task.difficulty: {name} has no knob(s) {unknown}; it has {knobs}")
    return cls(**difficulty)


__all__ = ["ANSWER_MARK", "TASK_NAMES", "ArithmeticTask", "Prompt", "Split", "Task", "TaskEnv",
           "get_task", "split_of"]
