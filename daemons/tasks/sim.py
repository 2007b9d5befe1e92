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

The agentic knobs (docs/guide/agentic.md), all off by default:

- ``max_turns`` ([task] max_turns): every episode lasts that many turns (a kind may set fewer).
- ``step_latency_mean_s`` / ``step_latency_std_s``: each env step waits a latency drawn from
  N(mu, sigma) clipped at 0 (ROLL Flash §5.2.1), in model seconds times ``time_scale``;
  ``failure_rate``: the probability that a step fails (the trajectory ends ``env_error``).
  The wait is an ``asyncio.sleep`` (``AsyncTaskEnv``): thousands of waiting environments
  cost the env-host no thread.
- ``zero_variance_share``: this share of prompts (by a hash of the uid) have one reward for
  every sample, half 0 and half 1: their GRPO groups carry no signal (dynamic filtering).
- ``kinds``: tagged prompt kinds with their own turns, observation length (prefill) and
  token cap, each a ``share`` of the prompts (hardware-affinity routing, RollArt §5.2).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import SPLITS, AsyncTaskEnv, Prompt, Split, StepResult, Task, TaskEnv, content_digest

DEFAULT_MAX_NEW_TOKENS = 16384
# More than any model profiled here can hold (Qwen2.5: 32K context, 128K with YaRN):
# a larger cap is a typo, and the KV capacity of a sim profile would be meaningless.
MAX_NEW_TOKENS_LIMIT = 131072
MAX_OBSERVATION_CHARS = 65536


class SimEnvFailure(RuntimeError):
    """A simulated environment failure (``failure_rate``): the trajectory ends env_error."""


@dataclass(frozen=True)
class SimKind:
    """A tagged kind of prompt: its share of the prompts and the shape of its episodes."""
    tag: str
    share: float
    turns: int
    observation_chars: int
    max_new_tokens: int


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from its parts (stable across processes)."""
    key = "\0".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") / 2.0**64


def _check(errors: list[str], name: str, value: Any, ok: bool, want: str) -> None:
    if isinstance(value, bool) or not ok:
        errors.append(f"{name}: must be {want}, got {value!r}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


class SimTask(Task):
    name = "sim"
    multi_turn = True
    env_calls_inline = True  # make_env/reset: microseconds; the latency is awaited (astep)
    decodes_completion = False

    def __init__(self, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, success_rate: float = 0.5,
                 max_turns: int = 1, step_latency_mean_s: float = 0.0, step_latency_std_s: float = 0.0,
                 failure_rate: float = 0.0, time_scale: float = 1.0, zero_variance_share: float = 0.0,
                 kinds: Sequence[Mapping[str, Any]] = ()) -> None:
        errors: list[str] = []
        _check(errors, "max_new_tokens", max_new_tokens, isinstance(max_new_tokens, int)
               and 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT, f"an integer in [1, {MAX_NEW_TOKENS_LIMIT}]")
        _check(errors, "max_turns", max_turns, isinstance(max_turns, int) and max_turns >= 1, "an integer >= 1")
        for name, value, upper in (("success_rate", success_rate, 1.0), ("failure_rate", failure_rate, 1.0),
                                   ("zero_variance_share", zero_variance_share, 1.0)):
            _check(errors, name, value, _number(value) and 0.0 <= value <= upper, "a number in [0, 1]")
        for name, value in (("step_latency_mean_s", step_latency_mean_s),
                            ("step_latency_std_s", step_latency_std_s)):
            _check(errors, name, value, _number(value) and value >= 0, "a number >= 0")
        _check(errors, "time_scale", time_scale, _number(time_scale) and time_scale > 0, "a number > 0")
        if errors:
            raise ValueError("; ".join(errors))
        self.success_rate = float(success_rate)
        self.max_new_tokens = self._max_new_tokens_knob = max_new_tokens
        self.max_turns = max_turns
        self.step_latency_mean_s, self.step_latency_std_s = float(step_latency_mean_s), float(step_latency_std_s)
        self.failure_rate, self.time_scale = float(failure_rate), float(time_scale)
        self.zero_variance_share = float(zero_variance_share)
        self.kinds = self._kinds(kinds)
        self.max_new_tokens = max(k.max_new_tokens for k in self.kinds)  # the manager's cap
        self._kinds_spec = [dict(k) for k in kinds]

    def _kinds(self, kinds: Sequence[Mapping[str, Any]]) -> tuple[SimKind, ...]:
        if not kinds:
            return (SimKind(self.name, 1.0, self.max_turns, 0, self.max_new_tokens),)
        out, errors = [], []
        for i, k in enumerate(kinds):
            where = f"kinds[{i}]"
            unknown = sorted(set(k) - {"tag", "share", "turns", "observation_chars", "max_new_tokens"})
            if unknown:
                errors.append(f"{where}: unknown keys {unknown}")
                continue
            tag, share = k.get("tag"), k.get("share")
            turns = k.get("turns", self.max_turns)
            obs, cap = k.get("observation_chars", 0), k.get("max_new_tokens", self.max_new_tokens)
            _check(errors, f"{where}.tag", tag, isinstance(tag, str) and tag.isidentifier(),
                   "a name (letters, digits, _)")
            _check(errors, f"{where}.share", share, _number(share) and share > 0, "a number > 0")
            _check(errors, f"{where}.turns", turns, isinstance(turns, int) and 1 <= turns <= self.max_turns,
                   f"an integer in [1, max_turns = {self.max_turns}]")
            _check(errors, f"{where}.observation_chars", obs, isinstance(obs, int)
                   and 0 <= obs <= MAX_OBSERVATION_CHARS, f"an integer in [0, {MAX_OBSERVATION_CHARS}]")
            _check(errors, f"{where}.max_new_tokens", cap, isinstance(cap, int)
                   and 1 <= cap <= MAX_NEW_TOKENS_LIMIT, f"an integer in [1, {MAX_NEW_TOKENS_LIMIT}]")
            out.append(SimKind(str(tag), float(share) if _number(share) else 0.0, turns, obs, cap))
        tags = [k.tag for k in out]
        if len(set(tags)) != len(tags):
            errors.append(f"kinds: tags must be distinct, got {tags}")
        if errors:
            raise ValueError("; ".join(errors))
        total = sum(k.share for k in out)
        return tuple(SimKind(k.tag, k.share / total, k.turns, k.observation_chars, k.max_new_tokens)
                     for k in out)

    def difficulty(self) -> dict[str, Any]:
        return {"max_new_tokens": self._max_new_tokens_knob, "success_rate": self.success_rate, "max_turns": self.max_turns,
                "step_latency_mean_s": self.step_latency_mean_s, "step_latency_std_s": self.step_latency_std_s,
                "failure_rate": self.failure_rate, "time_scale": self.time_scale,
                "zero_variance_share": self.zero_variance_share, "kinds": self._kinds_spec}

    def kind_of(self, prompt: Prompt) -> SimKind:
        """The prompt's kind, by a hash of its uid weighed by the kinds' shares."""
        if len(self.kinds) == 1:
            return self.kinds[0]
        u, acc = _unit("kind", prompt.uid), 0.0
        for k in self.kinds:
            acc += k.share
            if u < acc:
                return k
        return self.kinds[-1]

    def tag(self, prompt: Prompt) -> str:
        return self.kind_of(prompt).tag

    def max_new_tokens_for(self, prompt: Prompt) -> int:
        return self.kind_of(prompt).max_new_tokens

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
        """1.0 with probability success_rate, a deterministic function of (uid, texts);
        a zero-variance prompt's reward depends on its uid alone."""
        fixed = _unit("zero_variance", prompt.uid)
        if fixed < self.zero_variance_share:
            return 1.0 if fixed < self.zero_variance_share / 2 else 0.0
        u = _unit(prompt.uid, *trajectory_texts)
        return 1.0 if u < self.success_rate else 0.0


class SimEnv(AsyncTaskEnv):
    """``turns`` steps; each waits its simulated latency, may fail, and the last scores."""

    def __init__(self, task: SimTask) -> None:
        self.task = task
        self.prompt: Prompt | None = None
        self.kind = task.kinds[0]
        self.actions: list[str] = []
        self.done = True
        self._rng = random.Random()  # timing only: it need not repeat

    def reset(self, prompt: Prompt) -> str:
        self.prompt, self.done, self.actions = prompt, False, []
        self.kind = self.task.kind_of(prompt)
        return self._observation()

    def _observation(self) -> str:
        assert self.prompt is not None
        text = self.prompt.question if not self.actions else f"{self.prompt.question}:{len(self.actions)}"
        return text + "0" * self.kind.observation_chars  # '0': in every shipped tokenizer

    def latency_s(self) -> float:
        t = self.task
        if t.step_latency_mean_s == 0.0 and t.step_latency_std_s == 0.0:
            return 0.0
        return max(0.0, self._rng.gauss(t.step_latency_mean_s, t.step_latency_std_s)) * t.time_scale

    def step(self, action_text: str) -> StepResult:
        if self.done or self.prompt is None:
            raise RuntimeError("step() on a finished episode: call reset() first")
        if self.task.failure_rate and self._rng.random() < self.task.failure_rate:
            self.done = True
            raise SimEnvFailure(f"simulated environment failure (failure_rate {self.task.failure_rate:g})")
        self.actions.append(action_text)
        if len(self.actions) < self.kind.turns:
            return self._observation(), 0.0, False, {}
        self.done = True
        return "", self.task.reward(self.prompt, self.actions), True, {}

    async def astep(self, action_text: str) -> StepResult:
        delay = self.latency_s()
        if delay > 0:
            await asyncio.sleep(delay)
        return self.step(action_text)
