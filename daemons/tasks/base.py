"""The Task interface shared by env-hosts (environments) and reward-hosts (rule rewards).

A task turns a seed into prompts, each prompt into an environment episode, and a finished
episode's completion texts into a rule reward. Everything here is pure Python (plus
gymnasium for frozenlake): no torch, no sockets, so both daemons can import it cheaply.

The conversation of one episode, as the env-host drives it::

    env = task.make_env()
    obs = env.reset(prompt)
    while True:
        text = task.format_turn(obs)                 # what the model is conditioned on
        completion = generate(text, max_new_tokens=task.max_new_tokens, stop=EOS)
        obs, reward, done, info = env.step(completion)
        if done:
            break
    assert task.reward(prompt, completions) == reward   # the reward-host's independent check

Each turn's prompt is built from the current observation alone: both tasks are Markov
in their observation, which keeps sequences short for the tiny model.

A task whose reward needs no completion text sets ``decodes_completion = False`` (the
sim task: random tokens, a coin-flip reward). The env-host then skips the tokenizer's
decode, and the action it passes to ``env.step`` and records in the Turn (which the
reward-host scores) is ``undecoded_action(trajectory_id, turn)`` instead of the text.
"""

from __future__ import annotations

import abc
import hashlib
import random
from typing import Any, Literal

from rlfleet.common.wire.messages import Prompt

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")

# One in EVAL_MODULUS problems (by content hash) belongs to the held-out eval split, so the
# splits are disjoint by construction whatever seeds or sizes are asked for.
EVAL_MODULUS = 8

# Marks "the answer follows" at the end of every turn prompt, for every task.
ANSWER_MARK = "="


# Prompt (one task instance) is declared with the wire messages (common/wire/messages.py): it
# crosses processes inside a Trajectory, and on to the reward workers, as that one value.


StepResult = tuple[str, float, bool, dict[str, Any]]


class TaskEnv(abc.ABC):
    """One episode at a time: reset(prompt), then step(completion) until done."""

    @abc.abstractmethod
    def reset(self, prompt: Prompt) -> str:
        """Start an episode; returns the first observation text."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply one model completion; returns (observation, reward, done, info).

        `reward` is this step's reward; an episode's return is the sum over its steps.
        Stepping a finished episode raises RuntimeError.
        """


class AsyncTaskEnv(TaskEnv):
    """An environment whose step waits on something outside the env-host (a remote
    sandbox, a simulated latency): the env-host awaits ``astep`` on its event loop, under
    the turn timeout, instead of calling ``step`` on a thread. ``reset`` stays a plain call."""

    @abc.abstractmethod
    async def astep(self, action_text: str) -> StepResult:
        """step(), awaited."""


class Task(abc.ABC):
    """A task family at one difficulty. Subclasses set the class attributes."""

    name: str = ""
    multi_turn: bool = False
    max_turns: int = 1          # the env ends the episode at this many turns
    max_new_tokens: int = 1     # per turn, excluding the end token
    # True only when make_env/reset/step are pure computation of a few microseconds that
    # cannot hang: the env-host then calls them on its event loop, without the thread hop
    # (and so without the turn timeout). False: each call runs on a thread of its own.
    env_calls_inline: bool = False
    # False: the reward and the env need no completion text, so the env-host does not
    # decode completions (for 10k-token ones that would be most of its work) and passes
    # undecoded_action(trajectory_id, turn) as each turn's action instead.
    decodes_completion: bool = True

    def tag(self, prompt: Prompt) -> str:
        """The prompt's kind for hardware-affinity routing (RollArt §5.2): the task's name,
        unless the task mixes kinds of prompts (the sim task's ``kinds``)."""
        return self.name

    def max_new_tokens_for(self, prompt: Prompt) -> int:
        """The per-turn token cap of this prompt's episodes (a kind may have its own)."""
        return self.max_new_tokens

    @abc.abstractmethod
    def difficulty(self) -> dict[str, Any]:
        """The knobs this task was built with (get_task(name, **difficulty()) rebuilds it)."""

    def make_prompts(self, split: Split, n: int, seed: int = 0) -> list[Prompt]:
        """n prompts of `split`, deterministic in (task, difficulty, split, n, seed).

        Draws with replacement from the split's distribution: small problem spaces (a
        4x4 lake has a few thousand maps) repeat, and a long training stream never runs
        dry. A prefix is stable: make_prompts(s, 10, k) == make_prompts(s, 20, k)[:10].
        """
        if split not in SPLITS:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        # str seeds hash with sha512 inside random.Random: stable across processes/runs.
        rng = random.Random(f"{self.name}:{sorted(self.difficulty().items())}:{split}:{seed}")
        out: list[Prompt] = []
        while len(out) < n:
            question, answer, instance_seed = self._sample(rng)
            if split_of(self.name, question) != split:
                continue
            uid = f"{self.name}-{split}-{seed}-{len(out)}-{content_digest(question)[:8]}"
            out.append(Prompt(self.name, split, uid, question, answer, instance_seed))
        return out

    @abc.abstractmethod
    def _sample(self, rng: random.Random) -> tuple[str, str, int]:
        """One random instance as (question, answer, instance seed), from either split."""

    @abc.abstractmethod
    def make_env(self) -> TaskEnv:
        """A fresh environment (reusable: reset starts a new episode)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, trajectory_texts: list[str]) -> float:
        """Rule reward of a finished episode from its completions alone (one per turn)."""

    def format_turn(self, observation: str) -> str:
        """The prompt text the model continues for one turn."""
        return observation + ANSWER_MARK

    @abc.abstractmethod
    def parse_action(self, completion: str) -> str | None:
        """The action in a completion, or None when it is malformed."""

    def target(self, prompt: Prompt, observation: str) -> str:
        """A correct completion for this observation (supervised warm start, tests)."""
        raise NotImplementedError


def undecoded_action(trajectory_id: str, turn: int) -> str:
    """The action text of a turn of a task with ``decodes_completion = False``: names the
    turn, so a reward computed from it is deterministic per trajectory, and identical on
    the env-host and the reward-host."""
    return f"<undecoded {trajectory_id} turn {turn}>"


def split_of(task_name: str, question: str) -> str:
    """Which split a problem belongs to, decided by a hash of its content."""
    h = hashlib.sha256(f"{task_name}\0{question}".encode()).digest()
    return "eval" if int.from_bytes(h[:8], "little") % EVAL_MODULUS == 0 else "train"


def content_digest(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()
