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


class PPOClipLoss(PolicyLoss):
    """PPO's clipped surrogate (grpo.clipped_loss), ratio against the behaviour log-probs."""

    def __init__(self, clip_eps: float = 0.2) -> None:
        from . import grpo  # torch

        self._clipped_loss = grpo.clipped_loss
        self.clip_eps = clip_eps

    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        return self._clipped_loss(logp, behaviour_logp, advantages, mask, self.clip_eps,
                                  aggregate,  # type: ignore[arg-type]
                                  denominator=denominator, entropy=entropy)

    def describe(self) -> dict[str, Any]:
        return {"kind": "ppo_clip", "clip_eps": self.clip_eps}


class PPOClip(Kind):
    Config = PPOClipConfig

    @classmethod
    def build(cls, config: PPOClipConfig, /, **_: Any) -> PPOClipLoss:
        return PPOClipLoss(config.clip_eps)
