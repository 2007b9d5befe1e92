"""The sim task: synthetic single-turn prompts and a coin-flip reward, for the simulated fleet.

The sim rollout engine makes completions from a timing model (random tokens of long-tail
lengths), so there is nothing to solve: what the fleet needs from a task is a stream of
distinct prompts, a per-turn token cap, and rewards with variance inside a GRPO group.

- Prompts: the question of prompt ``i`` of a split is ``"<seed>:<split>:<i>"`` (split 0
  train, 1 eval), so it is deterministic in (job seed, split, index), distinct per prompt
  (the sim engine derives a prompt's length from its token ids, so equal texts would be
  equal prompts) and disjoint between the splits. Digits and ':' only: every character
  exists in the shipped character tokenizer too, which has no lowercase letters.
- Reward: 1.0 with probability ``success_rate``, decided by a hash of the prompt's uid
  (which holds the job seed and the prompt index) and the turn's action text. The action
  of a task that does not decode its completions is ``base.undecoded_action(trajectory id,
  turn)``, so the reward is a deterministic function of (seed, trajectory id): the same
  on the env-host, on the reward-host that checks it, and when a turn is regenerated.
- ``decodes_completion = False``: the reward needs no text, and decoding 10k-token random
  completions would cost the env-host more than everything else it does.
- ``max_new_tokens``: the per-turn cap the engine's lengths are clipped to (default 16384,
  Laminar's setting: outputs of at most 16K tokens, Laminar §8 "Datasets").
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from .base import SPLITS, Prompt, Split, StepResult, Task, TaskEnv, content_digest

DEFAULT_MAX_NEW_TOKENS = 16384
# More than any model profiled here can hold (Qwen2.5: 32K context, 128K with YaRN):
# a larger cap is a typo, and the KV capacity of a sim profile would be meaningless.
MAX_NEW_TOKENS_LIMIT = 131072


class SimTask(Task):
    name = "sim"
    multi_turn = False
    max_turns = 1
    env_calls_inline = True  # reset/step: a hash, a few microseconds
    decodes_completion = False

    def __init__(self, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, success_rate: float = 0.5) -> None:
        errors = []
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not (
                1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT):
            errors.append(f"max_new_tokens: must be an integer in [1, {MAX_NEW_TOKENS_LIMIT}], "
                          f"got {max_new_tokens!r}")
        if isinstance(success_rate, bool) or not isinstance(success_rate, (int, float)) or not (
                0.0 <= success_rate <= 1.0):
            errors.append(f"success_rate: must be a number in [0, 1], got {success_rate!r}")
        if errors:
            raise ValueError("; ".join(errors))
        self.max_new_tokens = max_new_tokens
        self.success_rate = float(success_rate)

    def difficulty(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "success_rate": self.success_rate}

    def make_prompts(self, split: Split, n: int, seed: int = 0) -> list[Prompt]:
        """Prompt i is ``"<seed>:<split>:<i>"``: made by index, so distinct without drawing."""
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        tag = SPLITS.index(split)
        out = []
        for i in range(n):
            question = f"{seed}:{tag}:{i}"
            uid = f"{self.name}-{split}-{seed}-{i}-{content_digest(question)[:8]}"
            out.append(Prompt(self.name, split, uid, question, "", i))
        return out

    def _sample(self, rng: random.Random) -> tuple[str, str, int]:
        raise NotImplementedError("sim prompts are made by index: see make_prompts")

    def make_env(self) -> TaskEnv:
        return SimEnv(self)

    def parse_action(self, completion: str) -> str | None:
        return completion  # any completion is an answer: the reward is a coin flip

    def reward(self, prompt: Prompt, trajectory_texts: list[str]) -> float:
        """1.0 with probability success_rate, a deterministic function of (uid, texts)."""
        key = "\0".join([prompt.uid, *trajectory_texts]).encode()
        u = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") / 2.0**64  # [0, 1)
        return 1.0 if u < self.success_rate else 0.0


class SimEnv(TaskEnv):
    """One step: the observation is the question, the step flips the task's coin."""

    def __init__(self, task: SimTask) -> None:
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
        return "", self.task.reward(self.prompt, [action_text]), True, {}
