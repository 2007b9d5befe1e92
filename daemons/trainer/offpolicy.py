"""Off-policy objectives as pure functions over token tensors (docs/guide/losses.md).

Each returns the per-token objective to MAXIMISE (with gradient, 0 on padding) and
its statistics; the loss classes in losses.py aggregate it (grpo.masked_mean) and
negate it. No model, no optimizer: the unit tests check these against numbers worked
out by hand (tests/daemons/trainer/test_losses.py).

Names, for a generated token a of a row with advantage A (all log-probs of a):
  logp          log pi_theta(a): the current parameters, WITH gradient
  behaviour     log mu(a): what the rollout sampled from (Turn.logprobs)
  proximal      log pi_prox(a): the trainer's parameters before this step's first
                update, no gradient (the learner supplies it, see Learner.train_step)
  r = pi_theta / mu, the importance ratio against the behaviour policy.

The papers write these over whole trajectories (pi(tau), ROLL Flash §2); here, like
the PPO-clip loss of grpo.clipped_loss, every ratio is per token.

``sg`` (stop-gradient) below is ``.detach()``: a weight that multiplies
A * grad log pi_theta without being differentiated itself.
"""

from __future__ import annotations

import torch


def _shared_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor,
                  clipped: torch.Tensor, entropy: torch.Tensor | None) -> dict[str, float]:
    """The statistics every loss reports, with the meaning of grpo.clipped_loss's: ratio_mean
    (pi_theta / mu), approx_kl (k3 estimate of KL(mu || pi_theta)), clip_frac (the share of
    tokens whose ratio or weight the loss clipped or truncated), entropy."""
    with torch.no_grad():
        n = max(mask.sum().item(), 1.0)
        stats = {
            "ratio_mean": (ratio * mask).sum().item() / n,
            "clip_frac": (clipped.float() * mask).sum().item() / n,
            "approx_kl": ((ratio - 1.0 - log_ratio) * mask).sum().item() / n,
            "tokens": mask.sum().item(),
        }
        if entropy is not None:
            stats["entropy"] = (entropy * mask).sum().item() / n
    return stats


def _behaviour_ratio(logp: torch.Tensor, behaviour: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log r, r) without gradient; 0 and 1 on padding, so nothing overflows there."""
    log_ratio = (logp.detach() - behaviour) * mask
    return log_ratio, torch.exp(log_ratio)


def decoupled_ppo(logp: torch.Tensor, behaviour: torch.Tensor, proximal: torch.Tensor,
                  advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                  weight_cap: float | None = None,
                  entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (Hilton et al. 2022): the trust region is around pi_prox, and mu only
    weights the sample.

        w   = sg(pi_prox / mu), truncated to min(w, weight_cap) when a cap is given
        r_p = pi_theta / pi_prox
        obj = w * min(r_p * A, clip(r_p, 1 - eps, 1 + eps) * A)

    which equals ROLL Flash's min(r A, (pi_prox/mu) clip(pi_theta/pi_prox) A) since w > 0.
    clip_frac counts tokens where the clip bound is the smaller term or w was truncated.
    """
    adv = advantages[:, None].expand_as(logp)
    proximal = proximal.detach()
    weight = torch.exp((proximal - behaviour) * mask)
    capped = torch.zeros_like(mask, dtype=torch.bool)
    if weight_cap is not None:
        capped = weight > weight_cap
        weight = torch.clamp(weight, max=weight_cap)
    ratio_p = torch.exp((logp - proximal) * mask)
    unclipped = ratio_p * adv
    clipped = torch.clamp(ratio_p, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    obj = weight * torch.minimum(unclipped, clipped) * mask
    log_ratio, ratio = _behaviour_ratio(logp, behaviour, mask)
    return obj, _shared_stats(log_ratio, ratio, mask, (clipped < unclipped) | capped, entropy)


def truncated_is(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, cap: float, proximal: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Munos et al. 2016; Espeholt et al. 2018; for the
    trainer/inference mismatch, Yao et al. 2025 as ROLL Flash A.1 eq. 12 applies it):

        w   = min(sg(pi_old / mu), C)       pi_old: the trainer's policy before this step
        obj = w * A * log pi_theta

    ``proximal`` is pi_old; without it the current parameters are (logp detached), which is
    the same number while a step makes one optimizer update. ROLL Flash writes the weight
    as sg(pi_theta / mu) clipped to [0, C]: at the step's first update pi_theta = pi_old.
    clip_frac counts tokens whose weight was truncated at C.
    """
    adv = advantages[:, None].expand_as(logp)
    old = (proximal if proximal is not None else logp).detach()
    raw = torch.exp((old - behaviour) * mask)
    weight = torch.clamp(raw, max=cap)
    obj = weight * adv * logp * mask
    log_ratio, ratio = _behaviour_ratio(logp, behaviour, mask)
    return obj, _shared_stats(log_ratio, ratio, mask, raw > cap, entropy)


def cispo(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, eps_low: float, eps_high: float,
          entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): clip the importance-sampling WEIGHT, not the
    update, so every token keeps a gradient (PPO-clip zeroes the clipped ones):

        w   = sg(clip(r, 1 - eps_low, 1 + eps_high))
        obj = w * A * log pi_theta

    clip_frac counts tokens whose weight was clipped (either side).
    """
    adv = advantages[:, None].expand_as(logp)
    log_ratio, ratio = _behaviour_ratio(logp, behaviour, mask)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    obj = weight * adv * logp * mask
    clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
    return obj, _shared_stats(log_ratio, ratio, mask, clipped, entropy)


def topr(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cap: float,
         entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025): positive samples are
    reinforced without importance weight, negative ones with a truncated weight:

        w   = 1                       if A > 0    (T+: better than its group)
              sg(clip(r, 0, c))       otherwise   (T-)
        obj = w * A * log pi_theta

    The sets T+ / T- are split by the sign of the GRPO advantage (reward above or below
    the group mean). clip_frac counts T- tokens whose weight was truncated at c.
    """
    adv = advantages[:, None].expand_as(logp)
    log_ratio, ratio = _behaviour_ratio(logp, behaviour, mask)
    positive = adv > 0
    weight = torch.where(positive, torch.ones_like(ratio), torch.clamp(ratio, max=cap))
    obj = weight * adv * logp * mask
    return obj, _shared_stats(log_ratio, ratio, mask, ~positive & (ratio > cap), entropy)
