"""Multi-turn tool use: multiply two numbers with a calculator the environment runs in a sandbox.

    turn 1   "37*48="            -> "<37*48>"   a tool call: a Python expression in <...>
    (env)    runs print(eval("37*48")) in common/sandbox/parent.py and shows the output
    turn 2   "37*48=<37*48>1776=" -> "1776"     the final answer; reward 1.0 if right

The model may also answer at once ("37*48=" -> "1776"): the tiny model cannot
multiply two-digit numbers in its head, so the tool is what makes the task solvable.
Each turn's observation holds the whole exchange so far (the task stays Markov in it).
The tokenizer of models/tiny-qwen2 has digits, operators and "<>" but no lowercase
letters: the model can only write arithmetic; anything a test writes into a step runs
all the same, contained by the sandbox.

A step ends the episode with reward 0.0 when the action is neither a tool call nor an
integer (``invalid_action``), or when it is a tool call on the last turn. A tool call
whose expression raises (``<37*>``: SyntaxError) is an ordinary observation, "?", and
the episode goes on. A tool call the sandbox had to stop (a timeout, a limit, a denied
socket or write: `SandboxResult.contained`) or one that could not run at all raises
`ToolFailure`: the env-host drops the trajectory as ``env_error`` with the reason
("env.step raised ToolFailure: tool call '...': cpu_limit (...)") in its info, and the
host goes on serving the others.

The reward needs no tool: 1.0 iff every completion but the last is a tool call and the
last is the product (the reward-host checks it from the completions alone).
"""

from __future__ import annotations

import random
import re
import threading
from typing import Any

from rlfleet.common.sandbox.parent import Sandbox, SandboxLimits, SandboxResult

from .base import Prompt, StepResult, Task, TaskEnv

_NUMBER = re.compile(r"-?[0-9]+")
_OUTPUT_CHARS = 24  # of the tool's output shown to the model (its context is 256 tokens)
ERROR_OUTPUT = "?"  # what the model sees when the expression raised


class ToolFailure(RuntimeError):
    """The sandbox stopped a tool call (or could not run it): the episode cannot go on."""

    def __init__(self, call: str, reason: str, detail: str) -> None:
        super().__init__(f"tool call {call[:60]!r}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.detail = reason, detail


def tool_call(text: str) -> str | None:
    """The expression of a tool call "<expr>" (stripped), or None if `text` is not one."""
    text = text.strip()
    return text[1:-1] if len(text) > 2 and text[0] == "<" and text[-1] == ">" else None


def observation_after(question: str, call_text: str, output: str) -> str:
    """The observation after a tool call: the question, the call, what the tool printed."""
    return f"{question}={call_text.strip()}{output}"


class ToolUseTask(Task):
    name = "tool_use"
    multi_turn = True
    env_calls_inline = False  # a tool call is a subprocess: it blocks, and may hit its timeout

    # Defaults = the difficulty models/tiny-qwen2 is warm-started for (its warmstart.json).
    def __init__(self, digits: int = 2, min_digits: int = 2, max_turns: int = 2,
                 tool_timeout_s: float = 5.0) -> None:
        errors = []
        if not 1 <= min_digits <= digits <= 4:
            errors.append(f"digits: need 1 <= min_digits <= digits <= 4, got {min_digits}, {digits}")
        if max_turns < 1:
            errors.append(f"max_turns: must be >= 1, got {max_turns}")
        if not 0 < tool_timeout_s <= 60:
            errors.append(f"tool_timeout_s: must be in (0, 60], got {tool_timeout_s}")
        if errors:
            raise ValueError("; ".join(errors))
        self.digits, self.min_digits, self.max_turns = digits, min_digits, max_turns
        self.tool_timeout_s = tool_timeout_s
        # The longest action is the call "<a*b>": 2*digits + 3; one spare token.
        self.max_new_tokens = 2 * digits + 4
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    def difficulty(self) -> dict[str, Any]:
        return {"digits": self.digits, "min_digits": self.min_digits, "max_turns": self.max_turns,
                "tool_timeout_s": self.tool_timeout_s}

    def _operand(self, rng: random.Random) -> int:
        d = rng.randint(self.min_digits, self.digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    def _sample(self, rng: random.Random) -> tuple[str, str, int]:
        a, b = self._operand(rng), self._operand(rng)
        return f"{a}*{b}", str(a * b), 0

    @property
    def sandbox(self) -> Sandbox:
        """Made on first use: reward-hosts build the task too, and never call the tool."""
        with self._lock:
            if self._sandbox is None:
                # CPU below the wall clock: a busy loop is reported as cpu_limit, not timeout.
                cpu = max(1, int(self.tool_timeout_s) // 2)
                self._sandbox = Sandbox(SandboxLimits(wall_s=self.tool_timeout_s, cpu_s=cpu,
                                                      memory_mib=256, nproc=16, file_mib=1,
                                                      tmp_mib=4))
            return self._sandbox

    def run_tool(self, expression: str) -> SandboxResult:
        """Evaluate the expression in the sandbox; the code is data (repr), never spliced."""
        return self.sandbox.run(f"print(eval({expression!r}, {{}}))")

    def make_env(self) -> ToolUseEnv:
        return ToolUseEnv(self)

    def parse_action(self, completion: str) -> str | None:
        """A tool call "<expr>" or an integer literal (stripped), else None."""
        text = completion.strip()
        return text if tool_call(text) is not None or _NUMBER.fullmatch(text) else None

    def reward(self, prompt: Prompt, trajectory_texts: list[str]) -> float:
        if not 1 <= len(trajectory_texts) <= self.max_turns:
            return 0.0
        *calls, last = trajectory_texts
        if any(tool_call(t) is None for t in calls):
            return 0.0
        return 1.0 if last.strip() == prompt.answer else 0.0

    def target(self, prompt: Prompt, observation: str) -> str:
        """Call the tool on the question, then copy what it printed."""
        if observation == prompt.question:
            return f"<{prompt.question}>"
        return prompt.answer


class ToolUseEnv(TaskEnv):
    def __init__(self, task: ToolUseTask) -> None:
        self.task = task
        self.prompt: Prompt | None = None
        self.texts: list[str] = []
        self.done = True

    def reset(self, prompt: Prompt) -> str:
        self.prompt, self.texts, self.done = prompt, [], False
        return prompt.question

    def step(self, action_text: str) -> StepResult:
        if self.done or self.prompt is None:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.texts.append(action_text)
        turns = len(self.texts)
        expression = tool_call(action_text)
        if expression is not None and turns < self.task.max_turns:
            result = self.task.run_tool(expression)
            if result.ok:
                output = result.stdout.strip()[:_OUTPUT_CHARS]
            elif result.reason == "exception":
                output = ERROR_OUTPUT
            else:
                self.done = True
                raise ToolFailure(expression, result.reason, result.detail)
            obs = observation_after(self.prompt.question, action_text, output)
            return obs, 0.0, False, {"tool_call": True, "tool_error": not result.ok,
                                     "turns": turns}
        # An answer, a call on the last turn (no turn left to use it) or garbage: the end.
        self.done = True
        invalid = self.task.parse_action(action_text) is None
        reward = self.task.reward(self.prompt, self.texts)
        return "", reward, True, {"invalid_action": invalid, "turns": turns,
                                  "truncated": expression is not None}
