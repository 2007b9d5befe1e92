"""No non-finite number reaches the weights (daemons/trainer/guard.py).

The attack that killed training silently on main: a complete group with rewards
[1e300, 0] (finite in float64) became inf in the float32 batch, NaN advantages, NaN
weights, published. Here it and its relatives are refused, with the values named,
before the optimizer moves.
"""

from __future__ import annotations

import pytest
import torch

from rlfleet.daemons.trainer.batching import NON_FINITE, NonFiniteStep, reward_problem, select_groups
from rlfleet.daemons.trainer.learner import Learner

from .conftest import scored


def pair(p: int, rewards=(1.0, 0.0), **kw) -> tuple[str, list]:
    return f"p{p}", [scored(p, k, r, **kw) for k, r in enumerate(rewards)]


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("reward, why", [(1e300, "not finite in float32"), (1e39, "not finite in float32"),
                                         (-3e6, "outside ±1e+06"), (float("nan"), "not finite")])
def test_selection_drops_a_group_whose_reward_no_float32_batch_can_hold(reward, why):
    complete = [pair(0), pair(1, (reward, 0.0)), pair(2), pair(3)]
    sel = select_groups(complete, 3, trainer_version=0, max_staleness=None, max_abs_reward=1e6)
    assert sel.groups == ["p0", "p2", "p3"]  # the batch still fills
    assert [(g, r) for g, r, _ in sel.drops] == [("p1", NON_FINITE)]
    assert why in sel.drops[0][2] and "p1-g0" in sel.drops[0][2]
    assert reward_problem(scored(0, 0, 5e5), 1e6) == ""


def test_the_attack_reaches_the_learner_and_is_refused_before_the_update(tiny_model):
    """Without the selection (a backend called directly): the batch refuses it, weights untouched."""
    learner = Learner(tiny_model, lr=1e-2, seed=0)
    before = weights(learner)
    with pytest.raises(NonFiniteStep, match=r"rewards \(as float32\) not finite.*inf"):
        learner.train_step([pair(0, (1e300, 0.0))[1]])
    assert learner.version == 0 and same(before, weights(learner))
    learner.train_step([pair(0)[1]])  # and the next honest step trains
    assert learner.version == 1 and not same(before, weights(learner))


def test_a_non_finite_loss_is_refused_and_its_gradients_discarded(tiny_model):
    """Behaviour log-probs of -1e30 pass every wire check (finite, <= 0) and make the
    importance ratio inf: the loss is inf, the gradient NaN."""
    learner = Learner(tiny_model, lr=1e-2, seed=0)
    before = weights(learner)
    poison = [scored(0, 0, 1.0, logprobs=[-1e30, -1e30]), scored(0, 1, 0.0, logprobs=[-1e30, -1e30])]
    with pytest.raises(NonFiniteStep, match="not finite") as caught:
        learner.train_step([poison])
    assert not caught.value.weights_touched
    assert learner.version == 0 and same(before, weights(learner))
    assert all(p.grad is None for p in learner.model.parameters())
    # The optimizer state was not advanced either: the next step is the first Adam step.
    assert not learner.optimizer.state


def test_an_update_that_makes_the_weights_non_finite_says_so(tiny_model, monkeypatch):
    learner = Learner(tiny_model, lr=1e-2, seed=0)
    real_step = learner.optimizer.step

    def corrupting_step(*a, **kw):
        out = real_step(*a, **kw)
        with torch.no_grad():
            next(learner.model.parameters()).view(-1)[3] = float("nan")
        return out

    monkeypatch.setattr(learner.optimizer, "step", corrupting_step)
    with pytest.raises(NonFiniteStep, match="weights not finite after the update") as caught:
        learner.train_step([pair(0)[1]])
    assert caught.value.weights_touched and learner.version == 0
