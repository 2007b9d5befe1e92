"""Shared-prompt packing: the layout by hand, and the same loss and gradient as unpacked rows."""

from __future__ import annotations

import pytest
import torch

from rlfleet.daemons.trainer import grpo, packing
from rlfleet.daemons.trainer.learner import Learner

from .conftest import scored

torch.set_num_threads(1)


def test_a_group_shares_its_prompt_once_with_block_attention():
    a = scored(0, 0, 1.0, prompt=(1, 5, 6), tokens=(7, 8))
    b = scored(0, 1, 0.0, prompt=(1, 5, 6), tokens=(9,))
    c = scored(1, 0, 0.0, prompt=(1, 4), tokens=(3, 3, 3))
    batch = grpo.build_batch([a, b, c], [1.0, -1.0, 0.0])
    assert batch.prompt_lengths == [3, 3, 2]
    p = packing.pack(batch, batch.prompt_lengths, max_width=64)
    # [1 5 6 | 7 8 | 9] and the lone row [1 4 3 3 3], padded to 6: 2x6 < 3x5
    assert p.input_ids.tolist() == [[1, 5, 6, 7, 8, 9], [1, 4, 3, 3, 3, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]]
    assert p.source == [[0, 1], [2]] and p.widths == [6, 5]
    # 9 (position 5) sees the prompt and itself, not the other completion's 7 and 8
    assert p.attention[0, 0, 5].tolist() == [True, True, True, False, False, True]
    assert p.attention[0, 0, 4].tolist() == [True, True, True, True, True, False]
    assert p.attention[1, 0, 5].tolist() == [False] * 5 + [True]  # padding: itself only
    # row 1 = [1 5 6 9 0]: column 2 (predicts 9) reads the prompt's last position 2
    assert p.position[1].tolist() == [0, 1, 2, 0]
    assert p.position[0].tolist() == [0, 1, 2, 3]


def test_packing_is_skipped_when_it_would_not_shrink_the_batch():
    pair = [scored(0, k, 0.0, prompt=(1, 5), tokens=tuple([7] * 20)) for k in range(2)]
    singles = [scored(p, 0, 0.0, prompt=(1, 5 + p), tokens=tuple([7] * 20)) for p in range(1, 5)]
    batch = grpo.build_batch(pair + singles, [0.0] * 6)
    p = packing.pack(batch, batch.prompt_lengths)
    assert p.source == [[n] for n in range(6)]  # packed: 5 rows x 42 > 6 x 22
    assert p.input_ids.tolist() == batch.input_ids.tolist()
    # A long packed row costs attention too: with hidden size 4, 1 x 42 is dearer than 2 x 22.
    assert packing.pack(grpo.build_batch(pair, [0.0] * 2), [2, 2], hidden_size=4).source == [[0], [1]]
    assert packing.pack(grpo.build_batch(pair, [0.0] * 2), [2, 2]).source == [[0, 1]]


def _unpacked_step(learner: Learner, groups) -> tuple[float, dict[str, torch.Tensor]]:
    """The learner's step without packing (one padded row per turn), gradients kept."""
    rewards = torch.tensor([[st.reward for st in g] for g in groups])
    flat = [st for g in groups for st in g]
    batch = grpo.build_batch(flat, grpo.group_advantages(rewards).flatten().tolist())
    learner.optimizer.zero_grad(set_to_none=True)
    logits = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp, entropy = grpo.token_logprobs(logits, batch.input_ids)
    loss, _ = learner.loss(logp, batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
                           aggregate="token", denominator=batch.n_tokens, entropy=entropy)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(learner.model.parameters(), learner.max_grad_norm)
    return loss.item(), {n: p.grad.clone() for n, p in learner.model.named_parameters()}


@pytest.mark.parametrize("budget", [100_000, 12])
def test_packed_step_has_the_unpacked_loss_and_gradient(tiny_model, budget):
    groups = [[scored(p, k, float(k % 2), prompt=tuple(range(3, 6 + p)),
                      tokens=tuple(range(10, 11 + (k + p) % 4)),
                      logprobs=[-0.5 - 0.1 * k] * (1 + (k + p) % 4), turns=1 + (p == 2 and k % 2))
               for k in range(4)] for p in range(3)]
    want_loss, want_grads = _unpacked_step(Learner(tiny_model, lr=1e-3, seed=0), groups)
    learner = Learner(tiny_model, lr=1e-3, seed=0, micro_batch_tokens=budget)
    stats = learner.train_step(groups)
    assert stats["loss"] == pytest.approx(want_loss, abs=1e-6)
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-6, rtol=1e-4, msg=name)
