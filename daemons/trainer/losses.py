"""The policy-loss seam: ``[trainer.loss]``, one kind per loss (ARCHITECTURE §5).

A loss turns the current policy's token log-probs, the behaviour log-probs the
rollout reported, the per-row advantages and the loss mask into a scalar to
minimise plus statistics; the learner calls it once per micro-batch and sums.
Registered in pyproject.toml (``rlfleet.policy_losses``). Importing this module
does not import torch (the spec imports it to validate); ``build`` does.

Kinds (formulas and papers in docs/guide/losses.md; the math in grpo.clipped_loss and
offpolicy.py): ``ppo_clip`` (default), ``decoupled_ppo``, ``tis``, ``cispo``, ``topr``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from rlfleet.common.spec.registry import Kind, KindConfig

if TYPE_CHECKING:
    import torch


class PolicyLoss(abc.ABC):
    """One loss, configured once; called per micro-batch by the learner."""

    # True: ``entropy`` must carry gradient (the loss uses it, not only reports it).
    needs_entropy_grad: bool = False
    # True: the learner passes ``proximal_logp``, the log-probs of its parameters before
    # the step's first update (no gradient). A caller that does not (one optimizer update
    # per batch, where they equal ``logp`` detached) still gets the right loss.
    needs_proximal_logp: bool = False
    entropy_coef: float = 0.0

    @abc.abstractmethod
    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None,
                 proximal_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to minimise, stats with at least ``tokens``) for rows [N, T] of one micro-batch.

        ``denominator`` normalises over the whole batch, so micro-batch losses add up."""

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records about the loss."""
        return {}

    def _minimise(self, objective: torch.Tensor, mask: torch.Tensor, aggregate: str, denominator: float,
                  entropy: torch.Tensor | None) -> torch.Tensor:
        """- the aggregated per-token objective, minus the entropy bonus when one is set."""
        from . import grpo  # torch

        loss = -grpo.masked_mean(objective, mask, aggregate, denominator)  # type: ignore[arg-type]
        if self.entropy_coef and entropy is not None:
            loss = loss - self.entropy_coef * grpo.masked_mean(entropy, mask, aggregate,  # type: ignore[arg-type]
                                                               denominator)
        return loss


# Bounds shared by the kinds' keys. A ratio bound at or below 1 would cut on-policy
# tokens (ratio 1) too; an epsilon of 1 or more removes the lower bound altogether.
def _eps() -> Any:
    return Field(default=0.2, strict=False, gt=0, lt=1, allow_inf_nan=False)

# An entropy bonus, - entropy_coef x the mean next-token entropy of the generated tokens
# (aggregated like the surrogate): it keeps a policy from sharpening into one that samples
# the same answer for every prompt, after which no group carries signal. 0: off.
def _entropy() -> Any:
    return Field(default=0.0, strict=False, ge=0, le=1, allow_inf_nan=False)



class PPOClipConfig(KindConfig):
    kind: Literal["ppo_clip"] = "ppo_clip"
    # The ratio is clipped to [1 - clip_eps, 1 + clip_eps]; at 1 or more the lower
    # bound is gone and the clip no longer limits a step.
    clip_eps: float = Field(default=0.2, strict=True, gt=0, lt=1, allow_inf_nan=False)
    entropy_coef: float = _entropy()
    # The importance-ratio cap c: dual-clip PPO, the objective of a token with A < 0 is
    # at least c x A, however far its ratio ran. None: off (plain PPO-clip).
    ratio_cap: float | None = Field(default=None, strict=False, gt=1, le=100, allow_inf_nan=False)


class PPOClipLoss(PolicyLoss):
    """PPO's clipped surrogate (grpo.clipped_loss), ratio against the behaviour log-probs."""

    def __init__(self, clip_eps: float = 0.2, entropy_coef: float = 0.0,
                 ratio_cap: float | None = None) -> None:
        from . import grpo  # torch

        self._grpo = grpo
        self.clip_eps, self.entropy_coef, self.ratio_cap = clip_eps, entropy_coef, ratio_cap
        self.needs_entropy_grad = entropy_coef > 0

    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None,
                 proximal_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        loss, stats = self._grpo.clipped_loss(logp, behaviour_logp, advantages, mask, self.clip_eps,
                                              aggregate,  # type: ignore[arg-type]
                                              denominator=denominator, entropy=entropy,
                                              ratio_cap=self.ratio_cap)
        if self.entropy_coef and entropy is not None:
            bonus = self._grpo.masked_mean(entropy, mask, aggregate, denominator)  # type: ignore[arg-type]
            loss = loss - self.entropy_coef * bonus
        return loss, stats

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "ppo_clip", "clip_eps": self.clip_eps, "entropy_coef": self.entropy_coef}
        if self.ratio_cap is not None:
            out["ratio_cap"] = self.ratio_cap
        return out


class PPOClip(Kind):
    Config, Impl = PPOClipConfig, PPOClipLoss


@dataclasses.dataclass(frozen=True)
class Tokens:
    """One micro-batch's rows [N, T] as an off-policy loss sees them."""

    logp: torch.Tensor               # the current policy's (with gradient)
    behaviour: torch.Tensor          # mu: what the rollout reported
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None
    proximal: torch.Tensor | None    # pi_old: the learner's parameters before the step


class _OffPolicyLoss(PolicyLoss):
    """A loss of offpolicy.py: ``objective(tokens)`` gives the per-token objective and
    stats from ``self._math`` and ``self.params`` (the kind's keys); the rest is shared."""

    kind = ""

    def __init__(self, entropy_coef: float = 0.0, **params: float | None) -> None:
        from . import offpolicy  # torch

        self._math = offpolicy
        self.entropy_coef, self.params = entropy_coef, params
        self.needs_entropy_grad = entropy_coef > 0

    def __call__(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, aggregate: str, denominator: float,
                 entropy: torch.Tensor | None = None,
                 proximal_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        if aggregate not in ("token", "sequence"):
            raise ValueError(f"aggregate must be 'token' or 'sequence', got {aggregate!r}")
        objective, stats = self.objective(Tokens(logp, behaviour_logp, advantages, mask, entropy, proximal_logp))
        return self._minimise(objective, mask, aggregate, denominator, entropy), stats

    @abc.abstractmethod
    def objective(self, t: Tokens) -> tuple[torch.Tensor, dict[str, float]]: ...

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params, "entropy_coef": self.entropy_coef}


class DecoupledPPOConfig(KindConfig):
    kind: Literal["decoupled_ppo"] = "decoupled_ppo"
    clip_eps: float = _eps()  # the trust region around the proximal policy
    entropy_coef: float = _entropy()
    # The importance-ratio cap: the behaviour weight pi_prox / mu is truncated at it. None: off.
    ratio_cap: float | None = Field(default=None, strict=False, ge=1, le=100, allow_inf_nan=False)


class DecoupledPPOLoss(_OffPolicyLoss):
    kind = "decoupled_ppo"
    needs_proximal_logp = True

    def objective(self, t: Tokens) -> tuple[torch.Tensor, dict[str, float]]:
        # Without proximal log-probs the caller makes one update per batch: pi_prox = pi_theta.
        prox = t.proximal if t.proximal is not None else t.logp.detach()
        return self._math.decoupled_ppo(t.logp, t.behaviour, prox, t.advantages, t.mask,
                                        self.params["clip_eps"],  # type: ignore[arg-type]
                                        self.params["ratio_cap"], t.entropy)


class DecoupledPPO(Kind):
    Config, Impl = DecoupledPPOConfig, DecoupledPPOLoss


class TISConfig(KindConfig):
    kind: Literal["tis"] = "tis"
    # C in min(pi_old / mu, C): the importance-ratio cap. Below 1 it would shrink
    # on-policy tokens too (a smaller learning rate, not a correction).
    cap: float = Field(default=2.0, strict=False, ge=1, le=100, allow_inf_nan=False)
    entropy_coef: float = _entropy()


class TISLoss(_OffPolicyLoss):
    kind = "tis"
    needs_proximal_logp = True  # pi_old of the weight is the trainer's pre-step policy

    def objective(self, t: Tokens) -> tuple[torch.Tensor, dict[str, float]]:
        return self._math.truncated_is(t.logp, t.behaviour, t.advantages, t.mask,
                                       self.params["cap"], t.proximal, t.entropy)  # type: ignore[arg-type]


class TIS(Kind):
    Config, Impl = TISConfig, TISLoss


class CISPOConfig(KindConfig):
    kind: Literal["cispo"] = "cispo"
    # The weight is clipped to [1 - eps_low, 1 + eps_high]; eps_low = 1: no lower bound.
    eps_low: float = Field(default=0.2, strict=False, gt=0, le=1, allow_inf_nan=False)
    eps_high: float = Field(default=0.2, strict=False, gt=0, le=100, allow_inf_nan=False)
    entropy_coef: float = _entropy()


class CISPOLoss(_OffPolicyLoss):
    kind = "cispo"

    def objective(self, t: Tokens) -> tuple[torch.Tensor, dict[str, float]]:
        return self._math.cispo(t.logp, t.behaviour, t.advantages, t.mask, self.params["eps_low"],  # type: ignore[arg-type]
                                self.params["eps_high"], t.entropy)  # type: ignore[arg-type]


class CISPO(Kind):
    Config, Impl = CISPOConfig, CISPOLoss


class TOPRConfig(KindConfig):
    kind: Literal["topr"] = "topr"
    # c in clip(r, 0, c) for the negative samples; 1: never above the on-policy weight.
    cap: float = Field(default=1.0, strict=False, gt=0, le=100, allow_inf_nan=False)
    entropy_coef: float = _entropy()


class TOPRLoss(_OffPolicyLoss):
    kind = "topr"

    def objective(self, t: Tokens) -> tuple[torch.Tensor, dict[str, float]]:
        return self._math.topr(t.logp, t.behaviour, t.advantages, t.mask,
                               self.params["cap"], t.entropy)  # type: ignore[arg-type]


class TOPR(Kind):
    Config, Impl = TOPRConfig, TOPRLoss
