"""Multi-turn FrozenLake on the real gymnasium environment (deterministic, not slippery).

Observation: the map rows joined by newlines, with the agent's cell shown as 'P', e.g.::

    PFFF
    FHFH
    FFFH
    HFFG

The turn prompt is that text + "\\n=", and the model answers with one action character
L, D, R or U (gymnasium's actions 0..3) then the end token. Reaching G pays 1.0 and ends
the episode; falling into H ends it with 0.0; so does running out of max_turns.

Malformed actions: a completion that is not exactly one of L/D/R/U (after stripping
whitespace) is a no-op turn: the agent stays put, the turn counts towards max_turns, the
reward is 0 and info["invalid_action"] is True. The episode goes on, so one bad token
costs a turn, not the episode.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from .base import Prompt, StepResult, Task, TaskEnv

ACTIONS = "LDRU"  # index = gymnasium FrozenLake action id (0 left, 1 down, 2 right, 3 up)
_MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
AGENT = "P"


def parse_action(completion: str) -> str | None:
    """The action character, or None unless the stripped completion is exactly L/D/R/U."""
    text = completion.strip()
    return text if len(text) == 1 and text in ACTIONS else None


def render(desc: list[str], row: int, col: int) -> str:
    """The map with the agent's cell replaced by 'P'."""
    rows = list(desc)
    rows[row] = rows[row][:col] + AGENT + rows[row][col + 1:]
    return "\n".join(rows)


def parse_observation(observation: str) -> tuple[list[str], int, int]:
    """Inverse of render: (desc, row, col). The cell under 'P' is 'S' at the start, else 'F'.

    Only meaningful for non-terminal observations (the agent stands on S or F).
    """
    rows = observation.split("\n")
    for r, line in enumerate(rows):
        c = line.find(AGENT)
        if c >= 0:
            under = "S" if (r, c) == (0, 0) else "F"
            rows[r] = line[:c] + under + line[c + 1:]
            return rows, r, c
    raise ValueError(f"no agent '{AGENT}' in observation {observation!r}")


def goal_distances(desc: list[str]) -> dict[tuple[int, int], int]:
    """BFS distance (in moves) from every cell that can reach G without crossing a hole."""
    n_rows, n_cols = len(desc), len(desc[0])
    goal = next((r, c) for r in range(n_rows) for c in range(n_cols) if desc[r][c] == "G")
    dist = {goal: 0}
    queue = collections.deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n_rows and 0 <= nc < n_cols and (nr, nc) not in dist \
                    and desc[nr][nc] != "H":
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def optimal_actions(desc: list[str], row: int, col: int,
                    dist: dict[tuple[int, int], int] | None = None) -> list[str]:
    """Actions that move one step closer to G (empty if G is unreachable from here)."""
    dist = goal_distances(desc) if dist is None else dist
    here = dist.get((row, col))
    if here is None or here == 0:
        return []
    return [a for a, (dr, dc) in _MOVES.items() if dist.get((row + dr, col + dc)) == here - 1]


def shortest_path(desc: list[str]) -> list[str] | None:
    """A shortest action sequence from S (top-left) to G, or None if there is none."""
    dist = goal_distances(desc)
    r, c = 0, 0
    if (r, c) not in dist:
        return None
    path = []
    while dist[(r, c)] > 0:
        a = optimal_actions(desc, r, c, dist)[0]
        path.append(a)
        r, c = r + _MOVES[a][0], c + _MOVES[a][1]
    return path


class FrozenLakeTask(Task):
    name = "frozenlake"
    multi_turn = True
    max_new_tokens = 1  # one action character; the end token follows

    # Defaults = the difficulty models/tiny-qwen2 is warm-started for (its warmstart.json);
    # p=0.75 has more holes than gymnasium's 0.8.
    def __init__(self, size: int = 4, p: float = 0.75, max_turns: int | None = None) -> None:
        errors = []
        if not 2 <= size <= 12:
            errors.append(f"size: must be in [2, 12], got {size}")
        if not 0.0 < p <= 1.0:
            errors.append(f"p: frozen-tile probability must be in (0, 1], got {p}")
        if max_turns is not None and max_turns < 1:
            errors.append(f"max_turns: must be >= 1, got {max_turns}")
        if errors:
            raise ValueError("; ".join(errors))
        self.size, self.p = size, p
        # 3*size leaves room for a detour or two beyond the 2*(size-1) Manhattan minimum.
        self.max_turns = 3 * size if max_turns is None else max_turns

    def difficulty(self) -> dict[str, Any]:
        return {"size": self.size, "p": self.p, "max_turns": self.max_turns}

    def _sample(self, rng: random.Random) -> tuple[str, str, int]:
        while True:
            seed = rng.randrange(2**31)
            desc = generate_random_map(size=self.size, p=self.p, seed=seed)
            path = shortest_path(desc)
            # generate_random_map guarantees a path; ours must also fit in max_turns.
            if path is not None and len(path) <= self.max_turns:
                return "\n".join(desc), "", seed

    def make_env(self) -> FrozenLakeEnv:
        return FrozenLakeEnv(self.max_turns)

    def format_turn(self, observation: str) -> str:
        return observation + "\n="

    def parse_action(self, completion: str) -> str | None:
        return parse_action(completion)

    def reward(self, prompt: Prompt, trajectory_texts: list[str]) -> float:
        """Replay the completions on a fresh environment; 1.0 iff the goal was reached.

        Completions after the episode ended (it cannot continue) are ignored.
        """
        env = self.make_env()
        env.reset(prompt)
        total = 0.0
        for text in trajectory_texts:
            _, r, done, _ = env.step(text)
            total += r
            if done:
                break
        return total

    def target(self, prompt: Prompt, observation: str) -> str:
        desc, r, c = parse_observation(observation)
        actions = optimal_actions(desc, r, c)
        if not actions:
            raise ValueError(f"no way to the goal from ({r}, {c}) in {prompt.uid}")
        return actions[0]


class FrozenLakeEnv(TaskEnv):
    """Text wrapper around gymnasium's FrozenLake-v1 (is_slippery=False)."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self._gym: gymnasium.Env | None = None
        self._desc: list[str] = []
        self.state = 0
        self.turns = 0
        self.done = True

    def _observation(self) -> str:
        n_cols = len(self._desc[0])
        return render(self._desc, self.state // n_cols, self.state % n_cols)

    def reset(self, prompt: Prompt) -> str:
        desc = prompt.question.split("\n")
        if desc != self._desc or self._gym is None:
            if self._gym is not None:
                self._gym.close()
            # max_episode_steps above ours so gymnasium never truncates before we do.
            self._gym = gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=False,
                                       max_episode_steps=self.max_turns + 1)
            self._desc = desc
        self.state, _ = self._gym.reset(seed=0)  # not slippery: the seed changes nothing
        self.turns, self.done = 0, False
        return self._observation()

    def step(self, action_text: str) -> StepResult:
        if self.done or self._gym is None:
            raise RuntimeError("step() on a finished episode: call reset() first")
        self.turns += 1
        action = parse_action(action_text)
        if action is not None:
            state, reward, terminated, _, _ = self._gym.step(ACTIONS.index(action))
            self.state, reward, invalid = int(state), float(reward), False
        else:
            reward, terminated, invalid = 0.0, False, True  # no-op turn (see module doc)
        self.done = bool(terminated) or self.turns >= self.max_turns
        info = {"invalid_action": invalid, "turns": self.turns,
                "terminated": bool(terminated), "truncated": self.done and not terminated}
        return self._observation(), reward, self.done, info
