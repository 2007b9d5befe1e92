"""Single-turn multi-digit addition (or subtraction): "37+85=" -> "122" then the end token."""

from __future__ import annotations

import random
import re
from typing import Any

from .base import Prompt, StepResult, Task, TaskEnv

_NUMBER = re.compile(r"-?[0-9]+")


class ArithmeticTask(Task):
    """Operands of min_digits..digits digits (digit count uniform, then value uniform).

    Subtraction keeps the larger operand first, so answers are never negative and the
    answer vocabulary is digits only.
    """

    name = "arithmetic"
    multi_turn = False
    max_turns = 1
    env_calls_inline = True  # reset/step: string parsing, under a microsecond

    # Defaults = the difficulty models/tiny-qwen2 is warm-started for (its warmstart.json).
    def __init__(self, digits: int = 2, min_digits: int = 2, ops: str = "+") -> None:
        errors = []
        if not 1 <= min_digits <= digits <= 9:
            errors.append(f"digits: need 1 <= min_digits <= digits <= 9, got {min_digits}, {digits}")
        if not ops or set(ops) - {"+", "-"}:
            errors.append(f"ops: must be a non-empty subset of '+-', got {ops!r}")
        if errors:
            raise ValueError("; ".join(errors))
        self.digits, self.min_digits, self.ops = digits, min_digits, ops
        # Longest answer is digits+1 ("999+999" -> "1998"); one spare token for a wrong guess.
        self.max_new_tokens = digits + 2

    def difficulty(self) -> dict[str, Any]:
        return {"digits": self.digits, "min_digits": self.min_digits, "ops": self.ops}

    def _operand(self, rng: random.Random) -> int:
        d = rng.randint(self.min_digits, self.digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    def _sample(self, rng: random.Random) -> tuple[str, str, int]:
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.ops)
        if op == "-" and a < b:
            a, b = b, a
        return f"{a}{op}{b}", str(a + b if op == "+" else a - b), 0

    def make_env(self) -> TaskEnv:
        return ArithmeticEnv(self)

    def parse_action(self, completion: str) -> str | None:
        """The stripped completion if it is an integer literal, else None (malformed)."""
        text = completion.strip()
        return text if _NUMBER.fullmatch(text) else None

    def reward(self, prompt: Prompt, trajectory_texts: list[str]) -> float:
        # Exact string match: "0122" or "122 " -> parsed differently -> "0122" is wrong.
        if len(trajectory_texts) != 1:
            return 0.0
        return 1.0 if self.parse_action(trajectory_texts[0]) == prompt.answer else 0.0

    def target(self, prompt: Prompt, observation: str) -> str:
        return prompt.answer


class ArithmeticEnv(TaskEnv):
    """The one-step environment: the observation is the question, the step scores the answer."""

    def __init__(self, task: ArithmeticTask) -> None:
        self.task = task
        self.prompt: Prompt | None = None
        self.done = True

    def reset(self, prompt: Prompt) -> str:
        self.prompt, self.done = prompt, False
        return prompt.question

    def step(self, action_text: str) -> StepResult:
        if self.done or self.prompt is None:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.done = True
        parsed = self.task.parse_action(action_text)
        reward = self.task.reward(self.prompt, [action_text])
        return "", reward, True, {"parsed": parsed, "invalid_action": parsed is None}
