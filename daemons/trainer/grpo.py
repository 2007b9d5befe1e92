"""GRPO math, as pure functions over tensors: advantages, the token batch, the loss.

No sockets, no model, no optimizer here: the learner calls these, and the unit
tests check them against numbers computed by hand.

Conventions
- A *row* is one Turn: input = prompt_token_ids + token_ids; only the positions
  of token_ids (the generated tokens) carry loss. Every row of a trajectory gets
  that trajectory's advantage.
- Everything token-level is aligned with the *targets* ``input_ids[:, 1:]``:
  column j holds the log-prob the model assigns to token j+1 given tokens 0..j.
- Behaviour log-probs are the rollout's ``Turn.logprobs`` (log-probs of the
  sampled tokens under the distribution it sampled from).
- Aggregation: ``"token"`` (default) averages over every generated token of the
  batch (each token weighs the same, long answers are not down-weighted: the
  DAPO choice); ``"sequence"`` averages tokens within a row, then rows (the
  original GRPO formula).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from rlfleet.common.wire.messages import ScoredTrajectory

from .batching import check_group_sizes
from .guard import require_finite

Aggregate = Literal["token", "sequence"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_g) / (std_g + eps) for rewards of shape [groups, G].

    std is the population std (divides by G): a group of one gets advantage 0
    instead of NaN, and a group whose rewards are all equal carries no signal.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass
class TokenBatch:
    """Right-padded rows; the last four fields are aligned with targets (width T-1)."""

    input_ids: torch.Tensor  # [N, T] long, padded with pad_id
    attention_mask: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T-1] float: 1 where the target is a generated token
    behaviour_logprobs: torch.Tensor  # [N, T-1] float, 0 where loss_mask is 0
    advantages: torch.Tensor  # [N] float, per row (= its trajectory's)
    row_trajectory: list[int]  # row -> index of its trajectory in the input order
    prompt_lengths: list[int] = field(default_factory=list)  # row -> its prompt tokens

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def build_batch(trajectories: Sequence[ScoredTrajectory], advantages: Sequence[float],
                pad_id: int = 0) -> TokenBatch:
    """One row per Turn of every trajectory (see the module docstring)."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    rows: list[tuple[list[int], int, list[float], float, int]] = []
    for i, (st, adv) in enumerate(zip(trajectories, advantages)):
        for k, turn in enumerate(st.trajectory.turns):
            prompt, gen, lp = turn.prompt_token_ids.tolist(), turn.token_ids.tolist(), turn.logprobs.tolist()
            if len(gen) != len(lp):
                raise ValueError(f"{st.trajectory.trajectory_id} turn {k}: {len(gen)} tokens but "
                                 f"{len(lp)} log-probs")
            if not prompt:
                raise ValueError(f"{st.trajectory.trajectory_id} turn {k}: empty prompt")
            if gen:
                rows.append((prompt + gen, len(prompt), lp, float(adv), i))
    if not rows:
        raise ValueError("no generated tokens in the batch")
    width = max(len(ids) for ids, *_ in rows)
    # Built as nested lists and converted once: one tensor op per field instead of four
    # small ones per row (the rows are short; the per-op overhead was the cost).
    input_ids, attention, loss_mask, behaviour = [], [], [], []
    for ids, n_prompt, lp, _, _ in rows:
        pad = width - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        attention.append([1] * len(ids) + [0] * pad)
        # Target j+1 is predicted at column j: generated tokens sit at n_prompt..len-1.
        loss_mask.append([0.0] * (n_prompt - 1) + [1.0] * len(lp) + [0.0] * pad)
        behaviour.append([0.0] * (n_prompt - 1) + lp + [0.0] * pad)
    return TokenBatch(torch.tensor(input_ids, dtype=torch.long),
                      torch.tensor(attention, dtype=torch.long),
                      torch.tensor(loss_mask, dtype=torch.float32),
                      torch.tensor(behaviour, dtype=torch.float32),
                      torch.tensor([r[3] for r in rows], dtype=torch.float32),
                      [r[4] for r in rows], [r[1] for r in rows])


def batch_of_groups(groups: Sequence[Sequence[ScoredTrajectory]], pad_id: int,
                    vocab_size: int) -> TokenBatch:
    """The batch of one optimizer step on whole GRPO groups (every trainer backend's first
    move): equal group sizes, group-relative advantages, token ids inside the vocabulary.
    Rewards or advantages that are not finite in float32 raise guard.NonFiniteStep."""
    check_group_sizes(groups)
    # float64 first: a reward of 1e300 must read as "1e300", not as float32's inf
    rewards = torch.tensor([[st.reward for st in g] for g in groups], dtype=torch.float64)
    require_finite("rewards (as float32)", rewards.float())
    advantages = group_advantages(rewards.float())
    require_finite("advantages", advantages)
    flat = [st for g in groups for st in g]
    batch = build_batch(flat, advantages.flatten().tolist(), pad_id=pad_id)
    too_big = int(batch.input_ids.max())
    if too_big >= vocab_size or int(batch.input_ids.min()) < 0:
        raise ValueError(f"token id {too_big} outside the model's vocabulary ({vocab_size})")
    return batch


def group_stats(groups: Sequence[Sequence[ScoredTrajectory]]) -> dict[str, float]:
    """What every backend's step reports about its groups, beside its own figures."""
    rewards = torch.tensor([[st.reward for st in g] for g in groups], dtype=torch.float32)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "trajectories": sum(len(g) for g in groups), "groups": len(groups)}


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution.

    logits [N, T, V] -> both [N, T-1]. Temperature divides the logits first, so the
    log-probs match a rollout that sampled at that temperature. Entropy is computed
    without gradient (a statistic, not part of the loss).
    """
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def masked_mean(values: torch.Tensor, mask: torch.Tensor, aggregate: Aggregate,
                denominator: float | None = None) -> torch.Tensor:
    """The mean of ``values`` over masked tokens as the loss aggregates: every token alike
    ("token"), or per row, then over rows ("sequence"); ``denominator`` as in clipped_loss."""
    if aggregate == "token":
        denom = denominator if denominator is not None else mask.sum().item()
        return (values * mask).sum() / max(denom, 1.0)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    denom = denominator if denominator is not None else float(mask.shape[0])
    return ((values * mask).sum(dim=1) / lengths).sum() / max(denom, 1.0)


def clipped_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, clip_eps: float, aggregate: Aggregate = "token",
                 denominator: float | None = None, entropy: torch.Tensor | None = None,
                 ratio_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate with ratio exp(logp - behaviour_logp), to minimise.

    Per token: -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A). ``ratio_cap`` c (> 1) is
    dual-clip PPO (Ye et al. 2020): for A < 0 the objective is max(that, c * A), so a
    very stale token whose ratio ran away cannot dominate the step. ``denominator``
    overrides the normaliser (the whole batch's token count for "token", its row
    count for "sequence") so that micro-batches add up to the full-batch loss.

    Stats (over masked tokens): ratio_mean; clip_frac, the share of tokens where the
    clipped term was the smaller one or the dual clip held (their gradient is zero); approx_kl, the k3
    estimate of KL(behaviour || current) = mean(ratio - 1 - log ratio); entropy.
    """
    if aggregate not in ("token", "sequence"):
        raise ValueError(f"aggregate must be 'token' or 'sequence', got {aggregate!r}")
    log_ratio = (logp - behaviour_logp) * mask  # 0 on padding: ratio 1, no overflow
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].expand_as(ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = torch.minimum(unclipped, clipped)
    bounded = clipped < unclipped
    if ratio_cap is not None:
        dual = (adv < 0) & (objective < ratio_cap * adv)
        objective = torch.where(dual, ratio_cap * adv, objective)
        bounded = bounded | dual
    per_token = -objective * mask
    loss = masked_mean(per_token, mask, aggregate, denominator)
    with torch.no_grad():
        n = max(mask.sum().item(), 1.0)
        stats = {
            "ratio_mean": (ratio * mask).sum().item() / n,
            "clip_frac": (bounded.float() * mask).sum().item() / n,
            "approx_kl": ((ratio - 1.0 - log_ratio) * mask).sum().item() / n,
            "tokens": mask.sum().item(),
        }
        if entropy is not None:
            stats["entropy"] = (entropy * mask).sum().item() / n
    return loss, stats


def merge_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Token-weighted average of per-micro-batch stats (tokens summed)."""
    total = sum(p["tokens"] for p in parts)
    out: dict[str, float] = {"tokens": total}
    for key in parts[0] if parts else ():
        if key != "tokens":
            out[key] = sum(p[key] * p["tokens"] for p in parts) / total if total else math.nan
    return out
