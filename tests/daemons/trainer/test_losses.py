"""Every policy loss of the seam against numbers worked out by hand (docs/guide/losses.md),
their spec bounds, and the learner handing proximal log-probs to the losses that ask."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import load_spec
from rlfleet.common.spec.seams import POLICY_LOSSES
from rlfleet.daemons.trainer.losses import (
    CISPOLoss,
    DecoupledPPOLoss,
    PolicyLoss,
    PPOClipLoss,
    TISLoss,
    TOPRLoss,
)
from tests.integration.helpers import TINY_MODEL

from .conftest import scored

torch.set_num_threads(1)

# The case every test below starts from. Row 0 has advantage +1 and two generated tokens
# whose ratios r = pi_theta / mu are 1.5 and 0.5; row 1 has advantage -1 and one token
# that ran away, r = 3 (a stale sample). One padding column each. Token aggregation over
# the batch's 3 tokens, so every per-token term below is divided by 3.
R = (1.5, 0.5, 3.0)
LOGP = (-1.0 + math.log(1.5), -1.0 + math.log(0.5), -2.0 + math.log(3.0))  # -0.5945, -1.6931, -0.9014


def case():
    behaviour = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(3.0), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = (behaviour + log_ratio).requires_grad_(True)
    return logp, behaviour, torch.tensor([1.0, -1.0]), mask


def run(loss: PolicyLoss, **kw):
    """(loss value, d loss / d logp of the three real tokens, stats)."""
    logp, behaviour, adv, mask = case()
    value, stats = loss(logp, behaviour, adv, mask, aggregate="token", denominator=3.0, **kw)
    value.backward()
    g = logp.grad
    assert g[0, 2].item() == 0.0 and g[1, 1:].abs().sum().item() == 0.0  # padding: no gradient
    return value.item(), [g[0, 0].item(), g[0, 1].item(), g[1, 0].item()], stats


def proximal_of(weights):
    """Proximal log-probs whose weights pi_prox / mu are ``weights`` (padding 0)."""
    _, behaviour, _, _ = case()
    w = torch.tensor([[weights[0], weights[1], 1.0], [weights[2], 1.0, 1.0]])
    return (behaviour + torch.log(w)) * torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_ppo_clip_unchanged_and_its_ratio_cap_is_dual_clip():
    # PPO-clip, eps 0.2, per token min(r A, clip(r, 0.8, 1.2) A):
    #   r 1.5, A +1: min(1.5, 1.2) = 1.2 (clipped, no gradient)
    #   r 0.5, A +1: min(0.5, 0.8) = 0.5 (gradient r A = 0.5)
    #   r 3,   A -1: min(-3, -1.2) = -3  (gradient r A = -3: the stale token dominates)
    value, grad, stats = run(PPOClipLoss(0.2))
    assert value == pytest.approx(-(1.2 + 0.5 - 3.0) / 3)
    assert grad == pytest.approx([0.0, -0.5 / 3, 3.0 / 3])
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    # ratio_cap 2 (dual clip): for A < 0 the objective is max(-3, 2 x -1) = -2, no gradient
    value, grad, stats = run(PPOClipLoss(0.2, ratio_cap=2.0))
    assert value == pytest.approx(-(1.2 + 0.5 - 2.0) / 3)
    assert grad == pytest.approx([0.0, -0.5 / 3, 0.0])
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_mean"] == pytest.approx(sum(R) / 3)
    assert PPOClipLoss(0.2).describe() == {"kind": "ppo_clip", "clip_eps": 0.2, "entropy_coef": 0.0}


def test_decoupled_ppo_by_hand():
    # Proximal weights w = pi_prox / mu = 1.25, 0.5, 2.5, so r_p = pi_theta / pi_prox =
    # r / w = 1.2, 1.0, 1.2. eps 0.1: clip(r_p) to [0.9, 1.1]. obj = w min(r_p A, clip(r_p) A):
    #   w 1.25, r_p 1.2, A +1: 1.25 x min(1.2, 1.1) = 1.375   (clipped, no gradient)
    #   w 0.5,  r_p 1.0, A +1: 0.5 x 1.0 = 0.5                (gradient w r_p A = 0.5)
    #   w 2.5,  r_p 1.2, A -1: 2.5 x min(-1.2, -1.1) = -3.0   (gradient w r_p A = -3.0)
    prox = proximal_of((1.25, 0.5, 2.5))
    value, grad, stats = run(DecoupledPPOLoss(clip_eps=0.1, ratio_cap=None), proximal_logp=prox)
    assert value == pytest.approx(-(1.375 + 0.5 - 3.0) / 3)
    assert grad == pytest.approx([0.0, -0.5 / 3, 3.0 / 3])
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx(sum(R) / 3)  # still against the behaviour
    # The importance-ratio cap 2 truncates the third weight: 2 x -1.2 = -2.4, gradient 2 x 1.2 x -1
    value, grad, stats = run(DecoupledPPOLoss(clip_eps=0.1, ratio_cap=2.0), proximal_logp=prox)
    assert value == pytest.approx(-(1.375 + 0.5 - 2.4) / 3)
    assert grad == pytest.approx([0.0, -0.5 / 3, 2.4 / 3])
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert DecoupledPPOLoss.needs_proximal_logp


def test_decoupled_ppo_without_proximal_is_the_one_update_case():
    # A caller with the old signature: pi_prox = pi_theta, so w = r = 1.5, 0.5, 3 and r_p = 1
    # (never clipped): obj = r A = 1.5, 0.5, -3; gradient r A.
    value, grad, stats = run(DecoupledPPOLoss(clip_eps=0.2, ratio_cap=None))
    assert value == pytest.approx(-(1.5 + 0.5 - 3.0) / 3)
    assert grad == pytest.approx([-1.5 / 3, -0.5 / 3, 3.0 / 3])
    assert stats["clip_frac"] == 0.0
    # exactly what the learner passes: its own log-probs, detached
    logp, *_ = case()
    again, grad_again, _ = run(DecoupledPPOLoss(clip_eps=0.2, ratio_cap=None), proximal_logp=logp.detach())
    assert again == pytest.approx(value) and grad_again == pytest.approx(grad)


def test_truncated_is_by_hand():
    # C 2: w = min(r, 2) = 1.5, 0.5, 2 (the third truncated); obj = w A log pi_theta,
    # gradient w A; the loss value is -(sum of w A logp) / 3 with logp of LOGP.
    value, grad, stats = run(TISLoss(cap=2.0))
    assert value == pytest.approx(-(1.5 * LOGP[0] + 0.5 * LOGP[1] - 2.0 * LOGP[2]) / 3)  # -0.02147
    assert grad == pytest.approx([-1.5 / 3, -0.5 / 3, 2.0 / 3])
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    # pi_old given (the trainer's pre-step policy): w = min(pi_old / mu, 2) = 1.25, 0.5, 2
    value, grad, _ = run(TISLoss(cap=2.0), proximal_logp=proximal_of((1.25, 0.5, 2.5)))
    assert grad == pytest.approx([-1.25 / 3, -0.5 / 3, 2.0 / 3])


def test_cispo_by_hand():
    # eps_low 0.6, eps_high 0.2: w = clip(r, 0.4, 1.2) = 1.2, 0.5, 1.2 (first and third
    # clipped); unlike PPO-clip every token keeps its gradient w A.
    value, grad, stats = run(CISPOLoss(eps_low=0.6, eps_high=0.2))
    assert value == pytest.approx(-(1.2 * LOGP[0] + 0.5 * LOGP[1] - 1.2 * LOGP[2]) / 3)
    assert grad == pytest.approx([-1.2 / 3, -0.5 / 3, 1.2 / 3])
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    # eps_low 0.2: the lower bound 0.8 lifts the second weight to 0.8
    _, grad, stats = run(CISPOLoss(eps_low=0.2, eps_high=0.2))
    assert grad == pytest.approx([-1.2 / 3, -0.8 / 3, 1.2 / 3]) and stats["clip_frac"] == 1.0


def test_topr_by_hand():
    # Row 0 (A > 0, T+): weight 1 whatever r (1.5 and 0.5): gradient -1/3 each.
    # Row 1 (A < 0, T-): weight clip(3, 0, c): c 1 -> 1 (truncated), c 4 -> 3.
    value, grad, stats = run(TOPRLoss(cap=1.0))
    assert value == pytest.approx(-(LOGP[0] + LOGP[1] - LOGP[2]) / 3)
    assert grad == pytest.approx([-1 / 3, -1 / 3, 1 / 3])
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    _, grad, stats = run(TOPRLoss(cap=4.0))
    assert grad == pytest.approx([-1 / 3, -1 / 3, 3 / 3]) and stats["clip_frac"] == 0.0


@pytest.mark.parametrize("loss", [DecoupledPPOLoss(clip_eps=0.2, ratio_cap=3.0), TISLoss(cap=2.0),
                                  CISPOLoss(eps_low=0.2, eps_high=0.3), TOPRLoss(cap=1.0)],
                         ids=lambda x: x.kind)
def test_micro_batches_add_up_and_on_policy_is_reinforce(loss):
    logp, behaviour, adv, mask = case()
    whole, _ = loss(logp, behaviour, adv, mask, aggregate="token", denominator=3.0)
    parts = [loss(logp[i:i + 1], behaviour[i:i + 1], adv[i:i + 1], mask[i:i + 1], aggregate="token",
                  denominator=3.0)[0].item() for i in range(2)]
    assert sum(parts) == pytest.approx(whole.item())
    # On-policy (mu = pi_theta): every weight is 1, the gradient is plain REINFORCE's -A/3.
    on = logp.detach().clone().requires_grad_(True)
    value, stats = loss(on, on.detach(), adv, mask, aggregate="token", denominator=3.0)
    value.backward()
    assert on.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 0, 1 / 3, 0, 0])
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    with pytest.raises(ValueError, match="aggregate"):
        loss(logp, behaviour, adv, mask, aggregate="mean", denominator=3.0)


def test_sequence_aggregation_and_entropy_bonus():
    logp, behaviour, adv, mask = case()
    entropy = torch.tensor([[0.6, 0.3, 9.0], [1.2, 9.0, 9.0]], requires_grad=True)  # 9.0: padding
    loss = TOPRLoss(entropy_coef=0.1, cap=1.0)
    assert loss.needs_entropy_grad and not TOPRLoss(cap=1.0).needs_entropy_grad
    # sequence: rows averaged first, then the 2 rows: ((LOGP0 + LOGP1)/2 + (-LOGP2)) / 2,
    # minus 0.1 x the entropy aggregated the same way ((0.6 + 0.3)/2 + 1.2) / 2
    value, _ = loss(logp, behaviour, adv, mask, aggregate="sequence", denominator=2.0, entropy=entropy)
    assert value.item() == pytest.approx(-((LOGP[0] + LOGP[1]) / 2 - LOGP[2]) / 2
                                         - 0.1 * ((0.6 + 0.3) / 2 + 1.2) / 2)
    value.backward()
    assert entropy.grad[0, :2].tolist() == pytest.approx([-0.1 / 4, -0.1 / 4])


def test_the_registry_builds_every_kind_from_its_table():
    built = {name: POLICY_LOSSES.build(kind.Config()) for name, kind in POLICY_LOSSES.kinds().items()}
    assert sorted(built) == ["cispo", "decoupled_ppo", "ppo_clip", "tis", "topr"]
    assert [n for n, loss in built.items() if loss.needs_proximal_logp] == ["decoupled_ppo", "tis"]
    assert built["tis"].describe() == {"kind": "tis", "cap": 2.0, "entropy_coef": 0.0}


BASE = f"""\
[job]
name = "l"
[model]
path = "{TINY_MODEL}"
[task.env]
kind = "arithmetic"
[trainer.loss]
"""


@pytest.mark.parametrize("table, expected", [
    ('kind = "tis"\ncap = 0.5', "trainer.loss.cap: must be >= 1, got 0.5"),
    ('kind = "tis"\ncap = nan', "trainer.loss.cap: must be a finite number, got nan"),
    ('kind = "topr"\ncap = 0', "trainer.loss.cap: must be > 0, got 0"),
    ('kind = "cispo"\neps_low = 1.5', "trainer.loss.eps_low: must be <= 1, got 1.5"),
    ('kind = "cispo"\neps_high = 0', "trainer.loss.eps_high: must be > 0, got 0"),
    ('kind = "decoupled_ppo"\nclip_eps = 1', "trainer.loss.clip_eps: must be < 1, got 1"),
    ('kind = "decoupled_ppo"\nratio_cap = 0.5', "trainer.loss.ratio_cap: must be >= 1, got 0.5"),
    ('kind = "ppo_clip"\nratio_cap = 1', "trainer.loss.ratio_cap: must be > 1, got 1"),
    ('kind = "tis"\nclip_eps = 0.2', "trainer.loss.clip_eps: unknown key"),
    ('kind = "grpo"', "trainer.loss.kind: unknown kind 'grpo' (registered: 'cispo', 'decoupled_ppo', "
                      "'ppo_clip', 'tis', 'topr')"),
])
def test_bounds_are_validated(tmp_path, table, expected):
    path = tmp_path / "l.toml"
    path.write_text(BASE + table + "\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [e.removeprefix(f"{path}: ") for e in info.value.errors] == [expected]


def test_validate_command_names_a_bad_loss_and_passes_a_good_one(tmp_path):
    bad, good = tmp_path / "bad.toml", tmp_path / "good.toml"
    bad.write_text(BASE + 'kind = "cispo"\neps_low = 2\n')
    good.write_text(BASE + 'kind = "decoupled_ppo"\nratio_cap = 5\n')
    cli = [sys.executable, "-m", "rlfleet.tools.cli", "job", "validate"]
    done = subprocess.run(cli + [str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stderr.startswith(f"{bad}: trainer.loss.eps_low: must be <= 1, got 2")
    done = subprocess.run(cli + [str(good)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "loss decoupled_ppo" in done.stdout, done.stderr


class _Recording(PolicyLoss):
    """PPO-clip that records the keywords it was called with."""

    def __init__(self, needs: bool) -> None:
        self.needs_proximal_logp, self.inner, self.calls = needs, PPOClipLoss(0.2), []

    def __call__(self, logp, behaviour_logp, advantages, mask, **kw):
        self.calls.append((logp.detach().clone(), kw.get("proximal_logp", "absent")))
        kw.pop("proximal_logp", None)
        return self.inner(logp, behaviour_logp, advantages, mask, **kw)


@pytest.mark.parametrize("needs", [True, False])
def test_learner_passes_proximal_logp_only_to_a_loss_that_needs_it(tiny_model, needs):
    from rlfleet.daemons.trainer.learner import Learner

    loss = _Recording(needs)
    learner = Learner(Path(tiny_model), lr=1e-3, loss=loss)
    group = [scored(0, k, float(k % 2), tokens=(7 + k, 8)) for k in range(4)]
    learner.train_step([group])
    assert loss.calls
    for logp, proximal in loss.calls:
        if needs:  # the pre-update parameters' log-probs: those of this very forward, detached
            assert not proximal.requires_grad and torch.equal(proximal, logp)
        else:  # not even the keyword: a loss written before it existed keeps working
            assert proximal == "absent"
