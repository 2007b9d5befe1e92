"""The task a job runs and its deterministic train prompt stream (docs/design/dataflow.md).

Shared by the daemons that must agree on them: env-hosts (the stream, the ids),
reward-hosts (the task's keyword arguments) and the trainer (the task it evaluates).

`prompt_id` indexes `task.make_prompts("train", n, seed=spec.job.seed)`, whose prefix is
stable in n. `PromptStream` asks make_prompts for a doubling n as ids grow, so each
prompt is generated about twice in total, without copying the task's sampling logic.
"""

from __future__ import annotations

import threading
from typing import Any

from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.seams import TASKS
from rlfleet.daemons.tasks import Prompt, Task

_FIRST_CHUNK = 1024


def task_kwargs(spec: JobSpec) -> dict[str, Any]:
    """Keyword arguments of get_task for this job: the knobs of [task.env], plus
    task.max_turns for a multi-turn task."""
    env = spec.task.env
    return TASKS.get(env.kind).task_kwargs(env, max_turns=spec.task.max_turns)  # type: ignore[attr-defined, no-any-return]


def task_from_spec(spec: JobSpec) -> Task:
    """The one Task object env-hosts and reward-hosts of a job agree on."""
    return TASKS.build(spec.task.env, max_turns=spec.task.max_turns)  # type: ignore[no-any-return]


class PromptStream:
    """prompt_id -> Prompt, identical to make_prompts(split, n, seed)[prompt_id].

    Thread-safe; generation happens in the caller's thread (keep it off an event loop).
    """

    def __init__(self, task: Task, seed: int, split: str = "train") -> None:
        self.task, self.seed, self.split = task, seed, split
        self._prompts: list[Prompt] = []
        self._lock = threading.Lock()

    def get(self, prompt_id: int) -> Prompt:
        if prompt_id < 0:
            raise ValueError(f"prompt_id: must be >= 0, got {prompt_id}")
        with self._lock:
            if prompt_id >= len(self._prompts):
                n = max(_FIRST_CHUNK, 2 * len(self._prompts), prompt_id + 1)
                self._prompts = self.task.make_prompts(self.split, n, seed=self.seed)  # type: ignore[arg-type]
            return self._prompts[prompt_id]

    def cached(self, prompt_id: int) -> Prompt | None:
        """get(prompt_id) if it is already generated (cheap: no generation), else None."""
        prompts = self._prompts  # replaced whole, never mutated: no lock needed to read
        return prompts[prompt_id] if 0 <= prompt_id < len(prompts) else None


# ---------------------------------------------------------------- identities (dataflow.md)
def group_id(prompt_id: int) -> str:
    return f"p{prompt_id}"


def trajectory_id(prompt_id: int, k: int) -> str:
    return f"p{prompt_id}-g{k}"


def parse_trajectory_id(tid: str) -> tuple[int, int]:
    """'p12-g3' -> (12, 3); ValueError for anything else."""
    p, sep, g = tid.partition("-g")
    if not sep or not p.startswith("p") or not p[1:].isdigit() or not g.isdigit():
        raise ValueError(f"not a trajectory id (p<prompt>-g<k>): {tid!r}")
    return int(p[1:]), int(g)
