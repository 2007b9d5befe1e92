"""The task seam: ``[task.env]``, one kind per task with its own typed knobs.

    [task.env]
    kind = "arithmetic"
    digits = 2

Registered in pyproject.toml (``rlfleet.tasks``); this module is imported whenever
a spec is validated, so it imports no task module (frozenlake needs gymnasium):
``task_class`` does, when a daemon builds the task. The knobs' bounds are the
task constructors' own, so a spec that validates builds.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictInt, StrictStr, ValidationInfo, field_validator

from rlfleet.common.registry import Kind, KindConfig
from rlfleet.common.spec_fields import fail, show

from .base import Task


class TaskKind(Kind):
    """A task family. ``task_kwargs`` are the keyword arguments of its Task class (they
    travel to reward workers, which rebuild the task with get_task)."""

    task_module: ClassVar[str]  # module under rlfleet.daemons.tasks
    task_class_name: ClassVar[str]
    multi_turn: ClassVar[bool] = False

    @classmethod
    def task_class(cls) -> type[Task]:
        module = importlib.import_module(f"rlfleet.daemons.tasks.{cls.task_module}")
        return getattr(module, cls.task_class_name)  # type: ignore[no-any-return]

    @classmethod
    def task_kwargs(cls, config: KindConfig, *, max_turns: int) -> dict[str, Any]:
        kwargs = config.model_dump(exclude={"kind"})
        if cls.multi_turn:
            kwargs["max_turns"] = max_turns  # [task] max_turns: the episode length
        return kwargs

    @classmethod
    def build(cls, config: KindConfig, /, *, max_turns: int = 1, **_: Any) -> Task:
        return cls.task_class()(**cls.task_kwargs(config, max_turns=max_turns))


Digits = Annotated[StrictInt, Field(ge=1, le=9)]


class ArithmeticConfig(KindConfig):
    # Defaults = the difficulty models/tiny-qwen2 is warm-started for (its warmstart.json).
    kind: Literal["arithmetic"] = "arithmetic"
    digits: Digits = 2  # the most digits an operand has
    min_digits: Digits = 2  # the fewest
    ops: StrictStr = "+"  # a non-empty subset of "+-"

    @field_validator("min_digits")
    @classmethod
    def _at_most_digits(cls, n: int, info: ValidationInfo) -> int:
        digits = info.data.get("digits")
        if digits is not None and n > digits:
            raise fail(f"must be <= digits ({digits}), got {n}")
        return n

    @field_validator("ops")
    @classmethod
    def _ops(cls, ops: str) -> str:
        if not ops or set(ops) - {"+", "-"}:
            raise fail(f"must be a non-empty string of '+' and '-', got {show(ops)}")
        return ops


class Arithmetic(TaskKind):
    """Single-turn addition/subtraction (arithmetic.py)."""

    Config = ArithmeticConfig
    task_module, task_class_name = "arithmetic", "ArithmeticTask"


class SimConfig(KindConfig):
    kind: Literal["sim"] = "sim"
    # The per-turn token cap (sim.py: 16384 is Laminar's 16K output limit; at most 128K).
    max_new_tokens: Annotated[StrictInt, Field(ge=1, le=131072)] = 16384
    # P(reward 1) per trajectory: with 0 < rate < 1 a GRPO group has variance.
    success_rate: float = Field(default=0.5, strict=True, ge=0, le=1, allow_inf_nan=False)


class Sim(TaskKind):
    """Synthetic single-turn prompts and a seeded coin-flip reward for the simulated fleet (sim.py)."""

    Config = SimConfig
    task_module, task_class_name = "sim", "SimTask"


class FrozenLakeConfig(KindConfig):
    # Defaults = the map family models/tiny-qwen2 is warm-started for (its warmstart.json).
    kind: Literal["frozenlake"] = "frozenlake"
    size: Annotated[StrictInt, Field(ge=2, le=12)] = 4  # the map is size x size
    p: float = Field(default=0.75, strict=True, gt=0, le=1, allow_inf_nan=False)  # P(frozen tile)


class FrozenLake(TaskKind):
    """Multi-turn FrozenLake, one move per turn (frozenlake.py); [task] max_turns caps the episode."""

    Config = FrozenLakeConfig
    task_module, task_class_name = "frozenlake", "FrozenLakeTask"
    multi_turn = True
