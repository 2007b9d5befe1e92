"""The torch learner on a tiny random Qwen2: it learns, and checkpoints resume exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.daemons.trainer import grpo
from rlfleet.daemons.trainer.checkpointing import STATE_FILE, CheckpointError, checkpoints
from rlfleet.daemons.trainer.learner import Learner
from rlfleet.daemons.trainer.losses import PPOClipLoss
from rlfleet.daemons.trainer.step import scheduled_lr

from .conftest import scored

PROMPT = (1, 5, 6, 7)
COMPLETIONS = [(10, 11, 2), (12, 13, 2), (14, 2), (15, 16, 17, 2)]  # index 0 is the right answer


def on_policy_logprobs(learner: Learner, prompt, tokens) -> list[float]:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp, _ = grpo.token_logprobs(learner.model(input_ids=ids).logits, ids)
    return logp[0, len(prompt) - 1:].tolist()


def group(learner: Learner, prompt_id: int = 0) -> list:
    """One GRPO group sampled 'by' the current policy: behaviour log-probs are its own."""
    return [scored(prompt_id, k, 1.0 if k == 0 else 0.0, prompt=PROMPT, tokens=c,
                   logprobs=on_policy_logprobs(learner, PROMPT, c), version=learner.version)
            for k, c in enumerate(COMPLETIONS)]


def test_rewarded_completion_becomes_more_likely(tiny_model):
    learner = Learner(tiny_model, lr=3e-3, loss=PPOClipLoss(0.2), seed=0, threads=1)
    before = [learner.sequence_logprob(PROMPT, c) for c in COMPLETIONS]
    for step in range(1, 6):
        stats = learner.train_step([group(learner)])
        assert stats["version"] == learner.version == step
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy data
        assert stats["tokens"] == sum(len(c) for c in COMPLETIONS)
        assert stats["reward_mean"] == 0.25
    after = [learner.sequence_logprob(PROMPT, c) for c in COMPLETIONS]
    assert after[0] - before[0] > 1.0, (before, after)  # the rewarded answer: much likelier
    for b, a in zip(before[1:], after[1:]):
        assert a < b, (before, after)  # every unrewarded one: less likely


def test_off_policy_data_is_clipped(tiny_model):
    learner = Learner(tiny_model, lr=1e-3, seed=0)
    g = group(learner)
    # Pretend the behaviour policy gave each token 3 nats less: ratio e^3 > 1 + eps everywhere.
    stale = [scored(0, k, st.reward, prompt=PROMPT, tokens=COMPLETIONS[k],
                    logprobs=[x - 3.0 for x in st.trajectory.turns[0].logprobs.tolist()])
             for k, st in enumerate(g)]
    stats = learner.train_step([stale])
    assert stats["ratio_mean"] == pytest.approx(np.exp(3.0), rel=1e-3)
    assert stats["clip_frac"] == pytest.approx(3 / 12)  # only A>0 tokens (the rewarded answer) clip


def test_micro_batches_give_the_same_gradient(tiny_model):
    groups = None
    runs = []
    for budget in (100_000, 8):  # one forward pass vs one row per pass
        learner = Learner(tiny_model, lr=1e-2, seed=0, micro_batch_tokens=budget)
        groups = groups or [group(learner, 0), group(learner, 1)]
        stats = learner.train_step(groups)
        # (Adam's first step is ~lr * sign(grad): compare the gradients themselves.)
        runs.append((stats, {n: p.grad.clone() for n, p in learner.model.named_parameters()}))
    assert runs[0][0]["loss"] == pytest.approx(runs[1][0]["loss"], abs=1e-6)
    assert runs[0][0]["tokens"] == runs[1][0]["tokens"] == 2 * 12
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(grad, runs[1][1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_checkpoint_resume_gives_identical_next_step(tiny_model, tmp_path):
    a = Learner(tiny_model, lr=1e-2, seed=0)
    batches = [[group(a, p)] for p in range(4)]  # fixed data for both runs
    a.train_step(batches[0])
    a.save_checkpoint(tmp_path / "ck")
    a.train_step(batches[1])
    path = a.save_checkpoint(tmp_path / "ck")
    assert path.name == "step-00000002" and (path / STATE_FILE).is_file()
    expected = a.train_step(batches[2])
    expected_next = a.train_step(batches[3])

    b = Learner(tiny_model, lr=1e-2, seed=0)
    assert b.load_checkpoint(checkpoints(tmp_path / "ck")[0]) == 2
    got = b.train_step(batches[2])
    assert got["loss"] == expected["loss"] and got["version"] == 3
    # The step after depends on the restored AdamW moments too.
    assert b.train_step(batches[3])["loss"] == expected_next["loss"]
    for name, value in a.state_tensors().items():
        np.testing.assert_array_equal(value, b.state_tensors()[name], err_msg=name)


def test_checkpoints_keep_the_last_two_and_leave_no_temporaries(tiny_model, tmp_path):
    learner = Learner(tiny_model, lr=1e-3)
    for v in (1, 2, 3):
        learner.save_checkpoint(tmp_path, v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000003", "step-00000002"]
    # The folder is an HF model: it loads as the base model of a new learner.
    assert Learner(checkpoints(tmp_path)[0], lr=1e-3).vocab_size == learner.vocab_size


def test_state_tensors_are_float32_copies_with_hf_names(tiny_model):
    learner = Learner(tiny_model, lr=1e-2)
    tensors = learner.state_tensors()
    assert set(tensors) == set(learner.model.state_dict())
    assert all(v.dtype == np.float32 for v in tensors.values())
    snapshot = {k: v.copy() for k, v in tensors.items()}
    learner.train_step([group(learner)])  # training must not write into a published copy
    for k, v in tensors.items():
        np.testing.assert_array_equal(v, snapshot[k])


def test_bad_batches_are_refused_with_the_numbers(tiny_model):
    learner = Learner(tiny_model, lr=1e-3)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        learner.train_step([[scored(0, 0, 1.0, tokens=(9999,))]])
    with pytest.raises(ValueError, match=r"groups of different sizes \[1, 2\]"):
        learner.train_step([[scored(0, 0, 1.0)], [scored(1, 0, 1.0), scored(1, 1, 0.0)]])
    assert learner.version == 0


def test_unreadable_checkpoint_leaves_the_learner_as_it_was(tiny_model, tmp_path):
    learner = Learner(tiny_model, lr=1e-2)
    learner.train_step([group(learner)])
    path = learner.save_checkpoint(tmp_path)
    (path / "optimizer.pt").write_bytes(b"torn")
    fresh = Learner(tiny_model, lr=1e-2)
    before = fresh.state_tensors()
    with pytest.raises(CheckpointError, match="cannot load optimizer.pt"):
        fresh.load_checkpoint(path)
    assert fresh.version == 0
    for name, value in fresh.state_tensors().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_learning_rate_schedule_warms_up_then_decays_to_zero():
    lrs = [scheduled_lr(1.0, s, "linear", warmup_steps=2, total_steps=6) for s in range(1, 8)]
    assert lrs == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert [scheduled_lr(2.0, s) for s in (1, 100)] == [2.0, 2.0]
    with pytest.raises(ValueError, match="'constant' or 'linear', got 'cosine'"):
        scheduled_lr(1.0, 1, "cosine")
    with pytest.raises(ValueError, match="needs total_steps"):
        Learner("unused", lr_schedule="linear")


def test_the_optimizer_uses_the_scheduled_rate_and_resume_continues_it(tiny_model, tmp_path):
    learner = Learner(tiny_model, lr=1e-3, lr_schedule="linear", total_steps=4)
    rates = [learner.train_step([group(learner)])["lr"] for _ in range(2)]
    assert rates == pytest.approx([7.5e-4, 5e-4])
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    ckpt = learner.save_checkpoint(tmp_path)
    resumed = Learner(tiny_model, lr=1e-3, lr_schedule="linear", total_steps=4)
    resumed.load_checkpoint(ckpt)
    assert resumed.train_step([group(resumed)])["lr"] == pytest.approx(2.5e-4)
