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

from pydantic import Field, StrictInt, StrictStr, field_validator

from rlfleet.common.spec.fields import Section, fail, not_beyond, show
from rlfleet.common.spec.registry import Kind, KindConfig

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

    _at_most_digits = not_beyond("min_digits", "digits", at_least=False)

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


Share = Annotated[float, Field(strict=False, ge=0, le=1, allow_inf_nan=False)]
NonNegSeconds = Annotated[float, Field(strict=False, ge=0, allow_inf_nan=False)]
TokenCap = Annotated[StrictInt, Field(ge=1, le=131072)]


class SimKindConfig(Section):
    """One tagged kind of sim prompt (sim.py ``kinds``)."""

    tag: Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    share: Annotated[float, Field(strict=False, gt=0, allow_inf_nan=False)]  # relative weight
    turns: Annotated[StrictInt, Field(ge=1)] | None = None  # None: [task] max_turns
    observation_chars: Annotated[StrictInt, Field(ge=0, le=65536)] = 0  # prompt length (prefill)
    max_new_tokens: TokenCap | None = None  # None: the task's


class SimConfig(KindConfig):
    kind: Literal["sim"] = "sim"
    # The per-turn token cap (sim.py: 16384 is Laminar's 16K output limit; at most 128K).
    max_new_tokens: TokenCap = 16384
    # P(reward 1) per trajectory: with 0 < rate < 1 a GRPO group has variance.
    success_rate: float = Field(default=0.5, strict=True, ge=0, le=1, allow_inf_nan=False)
    # The agentic knobs (docs/guide/agentic.md): an env step's latency ~ N(mean, std) clipped at 0,
    # in model seconds x time_scale; the probability that a step fails (env_error).
    step_latency_mean_s: NonNegSeconds = 0.0
    step_latency_std_s: NonNegSeconds = 0.0
    failure_rate: Share = 0.0
    time_scale: Annotated[float, Field(strict=False, gt=0, allow_inf_nan=False)] = 1.0
    zero_variance_share: Share = 0.0  # prompts whose samples all get one reward (no signal)
    kinds: list[SimKindConfig] = []  # tagged prompt kinds (hardware-affinity routing)

    @field_validator("kinds")
    @classmethod
    def _distinct_tags(cls, kinds: list[SimKindConfig]) -> list[SimKindConfig]:
        tags = [k.tag for k in kinds]
        if len(set(tags)) != len(tags):
            raise fail(f"tags must be distinct, got {show(tags)}")
        return kinds


class Sim(TaskKind):
    """Synthetic prompts, a seeded coin-flip reward, simulated env latency and failures (sim.py)."""

    Config = SimConfig
    task_module, task_class_name = "sim", "SimTask"
    multi_turn = True  # [task] max_turns: the episode length

    @classmethod
    def task_kwargs(cls, config: KindConfig, *, max_turns: int) -> dict[str, Any]:
        kwargs = super().task_kwargs(config, max_turns=max_turns)
        kwargs["kinds"] = [{k: v for k, v in kind.items() if v is not None} for kind in kwargs["kinds"]]
        return kwargs


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


class ToolUseConfig(KindConfig):
    # Defaults = the difficulty models/tiny-qwen2 is warm-started for (its warmstart.json).
    kind: Literal["tool_use"] = "tool_use"
    digits: Annotated[StrictInt, Field(ge=1, le=4)] = 2  # the most digits a factor has
    min_digits: Annotated[StrictInt, Field(ge=1, le=4)] = 2
    # Wall clock of one tool call in the sandbox (its CPU limit is half of it): keep it
    # under [env_host] turn_timeout_s, or the turn times out before the tool does.
    tool_timeout_s: float = Field(default=5.0, strict=True, gt=0, le=60, allow_inf_nan=False)

    _at_most_digits = not_beyond("min_digits", "digits", at_least=False)


class ToolUse(TaskKind):
    """Multiplication with a calculator tool run in a sandbox (tool_use.py); [task] max_turns
    caps the calls plus the answer."""

    Config = ToolUseConfig
    task_module, task_class_name = "tool_use", "ToolUseTask"
    multi_turn = True

    @classmethod
    def uses_sandbox(cls, config: ToolUseConfig, /) -> bool:
        return True  # the env-host runs each tool call in it (reward-hosts never call it)
