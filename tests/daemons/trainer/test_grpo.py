"""GRPO math against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.daemons.trainer import grpo

from .conftest import scored

torch.set_num_threads(1)


def test_group_advantages_by_hand():
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: no spread -> no signal
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # mean 1, std sqrt(2/3) = 0.8165 -> -1.2247, 0, 1.2247
    assert grpo.group_advantages(torch.tensor([[0.0, 1.0, 2.0]]))[0].tolist() == pytest.approx(
        [-1.224744, 0.0, 1.224744], abs=1e-5)
    assert grpo.group_advantages(torch.tensor([[3.0]])).tolist() == [[0.0]]  # G=1: 0, not NaN
    with pytest.raises(ValueError, match=r"\[groups, group_size\]"):
        grpo.group_advantages(torch.tensor([1.0, 2.0]))


def test_build_batch_aligns_generated_tokens_with_targets():
    a = scored(0, 0, 1.0, prompt=(1, 5, 6), tokens=(7, 8), logprobs=(-0.5, -0.25))
    b = scored(0, 1, 0.0, prompt=(1, 5), tokens=(9,), logprobs=(-2.0,), turns=2)
    batch = grpo.build_batch([a, b], [1.0, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 5, 9, 0, 0], [1, 5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    # column j predicts token j+1: 7 and 8 sit at columns 2 and 3; 9 at column 1
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0], [0, 1, 0, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.25], [0, -2.0, 0, 0], [0, -2.0, 0, 0]]
    assert batch.advantages.tolist() == [1.0, -1.0, -1.0]  # every turn gets its trajectory's
    assert batch.row_trajectory == [0, 1, 1] and batch.n_tokens == 4


def test_build_batch_rejects_mismatched_logprobs():
    bad = scored(0, 0, 1.0, tokens=(7, 8), logprobs=(-1.0,))
    with pytest.raises(ValueError, match="p0-g0 turn 0: 2 tokens but 1 log-probs"):
        grpo.build_batch([bad], [0.0])


def test_token_logprobs_and_entropy():
    # vocab 2, uniform logits -> log(1/2) everywhere and entropy log 2
    logits = torch.zeros(1, 3, 2)
    logp, ent = grpo.token_logprobs(logits, torch.tensor([[0, 1, 0]]))
    assert logp[0].tolist() == pytest.approx([-math.log(2)] * 2)
    assert ent[0].tolist() == pytest.approx([math.log(2)] * 2)
    # temperature 2 halves the logits: [2, 0] -> [1, 0]; p(0) = e/(e+1)
    logp, _ = grpo.token_logprobs(torch.tensor([[[2.0, 0.0], [0.0, 0.0]]]), torch.tensor([[0, 0]]), 2.0)
    assert logp.item() == pytest.approx(math.log(math.e / (math.e + 1)))


def _case():
    # Row 0 (A=+1): ratios 1.5 and 0.5; row 1 (A=-1): ratio 0.5; one padding column each.
    behaviour = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp = (behaviour + log_ratio).requires_grad_(True)
    return logp, behaviour, torch.tensor([1.0, -1.0]), mask


def test_clipped_loss_token_mean_by_hand():
    logp, behaviour, adv, mask = _case()
    loss, stats = grpo.clipped_loss(logp, behaviour, adv, mask, clip_eps=0.2)
    # per token -min(r A, clip(r) A): 1.5 -> -min(1.5, 1.2) = -1.2 (clipped);
    # 0.5 -> -min(0.5, 0.8) = -0.5; A=-1, 0.5 -> -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5) / 3)
    kl = (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))
    assert stats["approx_kl"] == pytest.approx(kl / 3)
    assert stats["tokens"] == 3
    loss.backward()
    # only the unclipped token carries gradient: d/dlogp of -r*A/3 = -r*A/3 = -0.5/3
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 3, 0.0, 0.0, 0.0, 0.0])


def test_entropy_bonus_by_hand():
    from rlfleet.daemons.trainer.losses import PPOClipLoss

    logp, behaviour, adv, mask = _case()
    entropy = torch.tensor([[0.6, 0.3, 9.0], [1.2, 9.0, 9.0]], requires_grad=True)  # 9.0: padding
    loss, _ = PPOClipLoss(0.2, entropy_coef=0.1)(logp, behaviour, adv, mask, aggregate="token",
                                                 denominator=3.0, entropy=entropy)
    # the surrogate of test_clipped_loss_token_mean_by_hand, minus 0.1 x the masked mean entropy
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3 - 0.1 * (0.6 + 0.3 + 1.2) / 3)
    loss.backward()
    assert entropy.grad.flatten().tolist() == pytest.approx([-0.1 / 3, -0.1 / 3, 0.0, -0.1 / 3, 0.0, 0.0])
    # off by default: the loss ignores entropy, which the learner then computes without gradient
    plain = PPOClipLoss(0.2)
    assert not plain.needs_entropy_grad and PPOClipLoss(0.2, 0.01).needs_entropy_grad
    loss0, _ = plain(logp, behaviour, adv, mask, aggregate="token", denominator=3.0, entropy=entropy)
    assert loss0.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3)


def test_clipped_loss_sequence_mean_and_denominator():
    logp, behaviour, adv, mask = _case()
    loss, _ = grpo.clipped_loss(logp, behaviour, adv, mask, 0.2, aggregate="sequence")
    assert loss.item() == pytest.approx(((-1.2 - 0.5) / 2 + 0.8) / 2)
    # Micro-batches: each row alone with the full batch's normaliser adds up to the whole.
    parts = [grpo.clipped_loss(logp[i:i + 1], behaviour[i:i + 1], adv[i:i + 1], mask[i:i + 1], 0.2,
                               denominator=3.0)[0].item() for i in range(2)]
    assert sum(parts) == pytest.approx((-1.2 - 0.5 + 0.8) / 3)
    with pytest.raises(ValueError, match="aggregate"):
        grpo.clipped_loss(logp, behaviour, adv, mask, 0.2, aggregate="mean")  # type: ignore[arg-type]


def test_on_policy_ratio_is_one_and_nothing_is_clipped():
    logp = torch.tensor([[-0.3, -1.7]], requires_grad=True)
    loss, stats = grpo.clipped_loss(logp, logp.detach().clone(), torch.tensor([2.0]),
                                    torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx(-2.0)  # -(1 * A) averaged
    assert stats == pytest.approx({"ratio_mean": 1.0, "clip_frac": 0.0, "approx_kl": 0.0, "tokens": 2})


def test_merge_stats_weights_by_tokens():
    merged = grpo.merge_stats([{"tokens": 1, "clip_frac": 1.0}, {"tokens": 3, "clip_frac": 0.0}])
    assert merged == {"tokens": 4, "clip_frac": 0.25}
