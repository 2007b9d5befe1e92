"""One optimizer step on whole GRPO groups, shared by the torch learners (the HF model's,
learner.py, and megatron-core's, megatron/learner.py): the batch, its micro-batches, the
loss with its masking and denominator, the accumulation into ONE update, the update's
guard (guard.py), the learning rate of the step and the step's stats.

A learner brings only its model: ``forward_micro_batches(batch)`` yields, per
micro-batch, its rows, their padded width and the rows' token log-probs (and entropy)
under the current parameters; the step runs the loss and ``backward`` before asking for
the next one, so one micro-batch's activations are alive at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rlfleet.common.tensors import to_numpy
from rlfleet.common.wire.messages import ScoredTrajectory

from . import grpo
from .guard import apply_update
from .losses import PPOClipLoss

# (rows of the batch, their padded width, log-probs [rows, width - 1], entropy or None)
MicroBatch = tuple[list[int], int, torch.Tensor, "torch.Tensor | None"]


def scheduled_lr(base: float, step: int, schedule: str = "constant", warmup_steps: int = 0,
                 total_steps: int | None = None) -> float:
    """The learning rate of optimizer step `step` (1-based).

    A function of the step alone, so a resumed trainer continues the schedule from its
    checkpoint's version with no scheduler state to save.
    """
    if schedule not in ("constant", "linear"):
        raise ValueError(f"lr schedule: must be 'constant' or 'linear', got {schedule!r}")
    factor = 1.0
    if warmup_steps and step <= warmup_steps:
        factor = step / warmup_steps
    elif schedule == "linear":
        if not total_steps:
            raise ValueError("a linear lr schedule needs total_steps")
        span = max(total_steps - warmup_steps, 1)
        factor = max(0.0, (total_steps - step) / span)
    return base * factor


def micro_batches(widths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive items whose padded size (count x widest) stays under ``max_tokens``."""
    out: list[list[int]] = [[]]
    width = 0
    for r, n in enumerate(widths):
        w = max(width, n)
        if out[-1] and w * (len(out[-1]) + 1) > max_tokens:
            out.append([])
            w = n
        out[-1].append(r)
        width = w
    return out


class GroupStep:
    """``train_step`` for a learner that has ``optimizer``, ``loss``, ``aggregate``, ``lr``,
    ``lr_schedule``, ``warmup_steps``, ``total_steps``, ``max_grad_norm``, ``version``,
    ``pad_id``, ``vocab_size`` and ``forward_micro_batches``."""

    optimizer: torch.optim.Optimizer
    loss: Any
    aggregate: grpo.Aggregate
    lr: float
    lr_schedule: str
    warmup_steps: int
    total_steps: int | None
    max_grad_norm: float
    version: int
    pad_id: int
    vocab_size: int | None

    def set_step_options(self, *, lr: float, loss: Any, seed: int, temperature: float, aggregate: grpo.Aggregate,
                         max_grad_norm: float, weight_decay: float, micro_batch_tokens: int, lr_schedule: str,
                         warmup_steps: int, total_steps: int | None) -> None:
        """What every torch learner is configured with; a bad lr schedule is refused now."""
        scheduled_lr(lr, 1, lr_schedule, warmup_steps, total_steps)
        self.lr_schedule, self.warmup_steps, self.total_steps = lr_schedule, warmup_steps, total_steps
        self.lr, self.seed = lr, seed
        # [trainer.loss], built by the registry (losses.py); PPO-clip at 0.2 when not given.
        self.loss = loss if loss is not None else PPOClipLoss()
        self.temperature, self.aggregate = temperature, aggregate
        self.max_grad_norm, self.weight_decay = max_grad_norm, weight_decay
        self.micro_batch_tokens = micro_batch_tokens  # padded tokens per forward pass

    def forward_micro_batches(self, batch: grpo.TokenBatch) -> Iterator[MicroBatch]:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the device (step_s is the step's time, not its launch's)."""

    # The parts a learner of several ranks replaces (megatron/learner.py): one rank's are
    # the whole step's.
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def apply_update(self, losses: list[torch.Tensor], lr: float) -> tuple[float, float]:
        """The guarded update (guard.apply_update): (loss, grad_norm) or NonFiniteStep."""
        return apply_update(self.optimizer, losses, self.max_grad_norm, lr)

    def gather_stats(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        """Every micro-batch's stats of the step (here: this process's)."""
        return parts

    def hf_state(self) -> Mapping[str, torch.Tensor]:
        """The weights under the HF model's state_dict names (views, not copies)."""
        raise NotImplementedError

    def state_tensors(self, dtype: str = "float32") -> dict[str, np.ndarray]:
        """HF names -> numpy copies in ``dtype``, the published one (`[model] dtype`; training
        may go on meanwhile): what the relay and every rollout engine load. A tensor under
        two names (a tied lm_head.weight is the embedding) is copied once and shared; views
        of one tensor with their own shape (megatron's gate and up halves of fc1) are copied
        apart."""
        out: dict[str, np.ndarray] = {}
        copies: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        for name, t in self.hf_state().items():
            key = (t.data_ptr(), tuple(t.shape))
            if key not in copies:
                copies[key] = to_numpy(t, dtype)
            out[name] = copies[key]
        return out

    def train_step(self, groups: Sequence[Sequence[ScoredTrajectory]]) -> dict[str, float]:
        """One optimizer step on whole GRPO groups; returns stats, version advanced by one."""
        started = time.perf_counter()
        batch = grpo.batch_of_groups(groups, self.pad_id, self.vocab_size)
        self.zero_grad()
        denominator = batch.n_tokens if self.aggregate == "token" else float(len(batch.row_trajectory))
        parts, losses = [], []
        for rows, width, logp, entropy in self.forward_micro_batches(batch):
            dev = logp.device
            # A decoupled loss compares against the parameters before this step's first
            # update: the step accumulates every micro-batch into ONE optimizer update, so
            # they are the parameters of this very forward pass, detached (no second pass).
            # Passed only when asked for: a loss written before the keyword existed still works.
            proximal = {"proximal_logp": logp.detach()} if self.loss.needs_proximal_logp else {}
            loss, stats = self.loss(
                logp, batch.behaviour_logprobs[rows, :width - 1].to(dev), batch.advantages[rows].to(dev),
                batch.loss_mask[rows, :width - 1].to(dev), aggregate=self.aggregate,
                denominator=denominator, entropy=entropy, **proximal)
            loss.backward()
            losses.append(loss.detach())
            parts.append(stats)
        lr = scheduled_lr(self.lr, self.version + 1, self.lr_schedule, self.warmup_steps, self.total_steps)
        # Refuses a non-finite loss or gradient before the update, and non-finite weights
        # after it (guard.py): a NaN never reaches a published version.
        loss_total, grad_norm = self.apply_update(losses, lr)
        self.synchronize()
        self.version += 1
        return {
            **grpo.merge_stats(self.gather_stats(parts)),
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": lr,
            **grpo.group_stats(groups),
            "rows": len(batch.row_trajectory),
            "step_s": time.perf_counter() - started,
            "version": self.version,
        }
