"""Which trajectories may be trained, and which complete groups make the next batch.

Pure functions over wire messages (no I/O), shared by the intake thread and the
training loop of the daemon.

Staleness of a trajectory = trainer version at consumption − the weight version
that generated it. A multi-turn trajectory may span versions; its staleness is
that of its *oldest* turn (the most off-policy part decides).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlfleet.common.wire.messages import ScoredTrajectory

# Reasons a group is dropped by the trainer itself (others come from upstream
# in Trajectory.dropped_reason, or "reward_error" from ScoredTrajectory.reward_error).
STALENESS = "staleness"
NO_SIGNAL = "no_signal"  # every reward of the group equal: advantage 0 for all
INVALID = "invalid"
REWARD_ERROR = "reward_error"
NON_FINITE = "non_finite"  # a number that cannot be trained in float32 (guard.py)

_FLOAT32_MAX = 3.4028234663852886e38


class NonFiniteStep(Exception):
    """A training step refused for a non-finite or out-of-range number (guard.py); ``what``
    says which, with its value. ``weights_touched``: the optimizer had already updated the
    weights (they are not finite): the learner must be restored from a checkpoint."""

    def __init__(self, what: str, *, weights_touched: bool = False) -> None:
        super().__init__(what)
        self.what, self.weights_touched = what, weights_touched


def check_group_sizes(groups: Sequence[Sequence[ScoredTrajectory]]) -> None:
    """What every learner refuses before a step (ValueError: the loop drops the batch as
    invalid): no group, an empty one, or groups of different sizes (group-relative
    advantages need one G)."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("train_step needs at least one group and no empty group")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of different sizes {sorted(sizes)}: advantages need equal G")


def reward_problem(st: ScoredTrajectory, max_abs_reward: float) -> str:
    """Why this trajectory's reward cannot enter a float32 batch ("" if it can): 1e300 is
    finite in float64 and inf in float32, and inf - inf is a NaN advantage."""
    r = st.reward
    if not math.isfinite(r) or abs(r) > _FLOAT32_MAX:
        return f"{st.trajectory.trajectory_id}: reward {r!r} is not finite in float32"
    if abs(r) > max_abs_reward:
        return f"{st.trajectory.trajectory_id}: reward {r!r} outside ±{max_abs_reward:g} (trainer.max_abs_reward)"
    return ""


def group_reward_problem(trajectories: Sequence[ScoredTrajectory], max_abs_reward: float) -> str:
    for st in trajectories:
        problem = reward_problem(st, max_abs_reward)
        if problem:
            return problem
    return ""

# A log-prob a little above 0 is float noise from the engine; more is a bug.
_LOGPROB_SLACK = 1e-3


def drop_reason(st: ScoredTrajectory) -> tuple[str, str]:
    """(reason, detail) if upstream marked this trajectory dropped, else ("", "")."""
    t = st.trajectory
    if t.dropped_reason:
        return t.dropped_reason, f"{t.trajectory_id}: dropped upstream"
    if st.reward_error:
        return REWARD_ERROR, f"{t.trajectory_id}: {st.reward_error}"
    return "", ""


def identity_problem(st: ScoredTrajectory, launched: int) -> str:
    """Why this trajectory's ids break docs/design/dataflow.md's Identities ("" if they follow them):
    ``group_id = p<prompt_id>``, ``trajectory_id = p<prompt_id>-g<k>``, 0 <= k < the
    trajectories a prompt launches (G + env_host.redundant_samples, the spares whose first
    G to finish make the group). A
    trajectory outside its group's G slots (a forged ``p7-g99``) would otherwise take a
    real one's place and drop or poison its group (a squat)."""
    t = st.trajectory
    group = f"p{t.prompt_id}"
    if t.group_id != group:
        return f"group_id {t.group_id!r} is not {group!r} (prompt_id {t.prompt_id})"
    k = t.trajectory_id.removeprefix(f"{group}-g")
    if (k == t.trajectory_id or not (k.isascii() and k.isdigit()) or str(int(k)) != k
            or int(k) >= launched):
        return (f"trajectory_id {t.trajectory_id!r} is not {group}-g<k> with 0 <= k < {launched} "
                f"(task.group_size + env_host.redundant_samples)")
    return ""


def check_trajectory(st: ScoredTrajectory, vocab_size: int | None, max_version: int | None = None) -> str:
    """Why this trajectory cannot be trained on ("" if it can). Precise, with the numbers.
    ``max_version``: the newest version the trainer ever made; no rollout can hold a later one."""
    t = st.trajectory
    if not math.isfinite(st.reward):
        return f"{t.trajectory_id}: reward is {st.reward}"
    if not t.turns:
        return f"{t.trajectory_id}: no turns"
    for k, turn in enumerate(t.turns):
        where = f"{t.trajectory_id} turn {k}"
        if turn.weight_version < 0 or (max_version is not None and turn.weight_version > max_version):
            return f"{where}: weight_version {turn.weight_version} was never made (newest: {max_version})"
        if len(turn.prompt_token_ids) == 0 or turn.prompt_token_ids.size != len(turn.prompt_token_ids):
            return f"{where}: prompt_token_ids must be a non-empty 1-d array"
        if turn.token_ids.size != turn.logprobs.size or len(turn.token_ids.shape) != 1:
            return (f"{where}: {turn.token_ids.size} token ids but {turn.logprobs.size} log-probs "
                    f"(both must be 1-d and of equal length)")
        if vocab_size is not None:
            ids = turn.prompt_token_ids.tolist() + turn.token_ids.tolist()
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                return f"{where}: token id {bad[0]} outside the vocabulary (size {vocab_size})"
        for lp in turn.logprobs.tolist():
            if not math.isfinite(lp) or lp > _LOGPROB_SLACK:
                return f"{where}: log-prob {lp} is not a finite value <= 0"
    return ""


def staleness(st: ScoredTrajectory, trainer_version: int) -> int:
    turns = st.trajectory.turns
    return trainer_version - min(t.weight_version for t in turns) if turns else 0


@dataclass
class Selection:
    groups: list[str] = field(default_factory=list)  # to train, in order
    drops: list[tuple[str, str, str]] = field(default_factory=list)  # (group, reason, detail)
    staleness: Counter[int] = field(default_factory=Counter)  # over the selected trajectories


def select_groups(complete: Sequence[tuple[str, Sequence[ScoredTrajectory]]], n_groups: int,
                  trainer_version: int, max_staleness: int | None,
                  no_signal_budget: int = 0, max_abs_reward: float | None = None) -> Selection:
    """Take up to n_groups complete groups, oldest first; a group holding any
    trajectory staler than max_staleness is dropped as a whole instead, and so is a
    group with a reward beyond ±max_abs_reward or not finite in float32 ("non_finite",
    guard.py), and a group whose rewards are all equal while ``no_signal_budget`` (drops
    of that kind still allowed for this batch) lasts."""
    sel = Selection()
    for group_id, trajectories in complete:
        if len(sel.groups) >= n_groups:
            break
        if max_abs_reward is not None:
            problem = group_reward_problem(trajectories, max_abs_reward)
            if problem:
                sel.drops.append((group_id, NON_FINITE, problem))
                continue
        ages = [staleness(st, trainer_version) for st in trajectories]
        if max_staleness is not None and max(ages, default=0) > max_staleness:
            worst = max(range(len(ages)), key=ages.__getitem__)
            sel.drops.append((group_id, STALENESS,
                              f"{trajectories[worst].trajectory.trajectory_id}: staleness "
                              f"{ages[worst]} > max_staleness {max_staleness}"))
            continue
        rewards = {st.reward for st in trajectories}
        if no_signal_budget > 0 and len(rewards) == 1:
            no_signal_budget -= 1
            sel.drops.append((group_id, NO_SIGNAL, f"all {len(trajectories)} rewards {rewards.pop()}"))
            continue
        sel.groups.append(group_id)
        sel.staleness.update(ages)
    return sel


def prompt_of(group_id: str) -> int | None:
    """The prompt id of a group id ``p<prompt_id>`` (docs/design/dataflow.md, Identities); None if
    it is not one."""
    digits = group_id[1:]
    return int(digits) if group_id[:1] == "p" and digits.isdigit() else None


def in_finished_rounds(complete: Sequence[str], prompts_per_round: int,
                       received: Callable[[str], bool]) -> list[str]:
    """after_batch: the complete groups whose round is finished, in their order.

    Round r is prompts r*P .. (r+1)*P - 1 (the env-hosts claim it as one, pacing.round_limit);
    it is finished once every one of its groups has reached the trainer (``received``:
    complete, trained or dropped). Until then none of its groups is filtered or trained:
    the synchronous batch rollout filters a batch only after its last generation. A group
    whose id names no prompt is never held back."""
    finished: dict[int, bool] = {}
    out = []
    for gid in complete:
        prompt = prompt_of(gid)
        if prompt is None:
            out.append(gid)
            continue
        r = prompt // prompts_per_round
        if r not in finished:
            finished[r] = all(received(f"p{p}") for p in range(r * prompts_per_round, (r + 1) * prompts_per_round))
        if finished[r]:
            out.append(gid)
    return out
