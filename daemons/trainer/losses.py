"""The policy-loss seam: ``[trainer.loss]``, one kind per loss (ARCHITECTURE §5).

A loss turns the current policy's token log-probs, the behaviour log-probs the
rollout reported, the per-row advantages and the loss mask into a scalar to
minimise plus statistics; the learner calls it once per micro-batch and sums.
Registered in pyproject.toml (``rlfleet.policy_losses``). Importing this module
does not import torch (the spec imports it to validate); ``build`` does.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from rlfleet.common.registry import Kind, KindConfig

if TYPE_CHECKING:
    import torch


class PolicyLoss(abc.ABC):
    """One loss, configured once; called per micro-batch by the learner."""

    # True: ``entropy`` must carry gradient (the loss uses it, not only reports it).
    needs_entropy_grad: bool = False

    @abc.abstractmethod
    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to minimise, stats with at least ``tokens``) for rows [N, T] of one micro-batch.

        ``denominator`` normalises over the whole batch, so micro-batch losses add up."""

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records about the loss."""
        return {}


class PPOClipConfig(KindConfig):
    kind: Literal["ppo_clip"] = "ppo_clip"
    # The ratio is clipped to [1 - clip_eps, 1 + clip_eps]; at 1 or more the lower
    # bound is gone and the clip no longer limits a step.
    clip_eps: float = Field(default=0.2, strict=True, gt=0, lt=1, allow_inf_nan=False)
    # An entropy bonus, - entropy_coef x the mean next-token entropy of the generated tokens
    # (aggregated like the surrogate): it keeps a policy from sharpening into one that samples
    # the same answer for every prompt, after which no group carries signal. 0: off.
    entropy_coef: float = Field(default=0.0, strict=False, ge=0, le=1, allow_inf_nan=False)


class PPOClipLoss(PolicyLoss):
    """PPO's clipped surrogate (grpo.clipped_loss), ratio against the behaviour log-probs."""

    def __init__(self, clip_eps: float = 0.2, entropy_coef: float = 0.0) -> None:
        from . import grpo  # torch

        self._grpo = grpo
        self.clip_eps, self.entropy_coef = clip_eps, entropy_coef
        self.needs_entropy_grad = entropy_coef > 0

    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = self._grpo.clipped_loss(logp, behaviour_logp, advantages, mask, self.clip_eps,
                                              aggregate,  # type: ignore[arg-type]
                                              denominator=denominator, entropy=entropy)
        if self.entropy_coef and entropy is not None:
            bonus = self._grpo.masked_mean(entropy, mask, aggregate, denominator)  # type: ignore[arg-type]
            loss = loss - self.entropy_coef * bonus
        return loss, stats

    def describe(self) -> dict[str, Any]:
        return {"kind": "ppo_clip", "clip_eps": self.clip_eps, "entropy_coef": self.entropy_coef}


class PPOClip(Kind):
    Config = PPOClipConfig

    @classmethod
    def build(cls, config: PPOClipConfig, /, **_: Any) -> PPOClipLoss:
        return PPOClipLoss(config.clip_eps, config.entropy_coef)
