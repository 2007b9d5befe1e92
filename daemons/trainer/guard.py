"""No non-finite number reaches the weights (docs/design/dataflow.md, "Non-finite steps").

A reward of 1e300 is finite in float64, so every wire check passes; in the
trainer's float32 tensor it is ``inf``, its group's advantages ``inf - inf = NaN``,
and one optimizer step turns every weight NaN for good. Three lines of defence,
each naming the numbers that were wrong:

1. ``batching.reward_problem`` (the training loop's selection, per group): a reward that is
   not finite in float32 or lies outside ``trainer.max_abs_reward`` drops its group
   as ``non_finite`` before it is batched, so the rest of the batch still trains.
2. ``require_finite`` on the advantages, each micro-batch's loss and the gradient
   norm (``apply_update``): a step that meets a non-finite value raises
   ``NonFiniteStep`` *before* ``optimizer.step()``, the gradients are discarded, the
   weights and the optimizer state are untouched.
3. ``apply_update`` checks the parameters after the update (one fused norm per
   version, cheap next to the step): if they are not finite the step raises with
   ``weights_touched``, and the training loop restores the last good checkpoint
   before anything is published.

Pure functions over tensors; the learners call them, the loop (training.py) accounts
the skipped steps. ``NonFiniteStep`` and the reward checks are torch-free, in
batching.py, so the training loop imports no torch (the sim backend has none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batching import NonFiniteStep


def require_finite(what: str, value: torch.Tensor) -> None:
    """Raise NonFiniteStep naming ``what`` and its first bad values if any is not finite."""
    finite = torch.isfinite(value)
    if bool(finite.all()):
        return
    bad = value.detach()[~finite].flatten()[:4].tolist()
    raise NonFiniteStep(f"{what} not finite: {int((~finite).sum())} of {value.numel()} values, e.g. {bad}")


def weights_finite(params: Sequence[torch.Tensor]) -> bool:
    """True if every parameter is finite. One fused norm per tensor (a NaN or inf
    anywhere makes its tensor's norm non-finite); finite weights so large that their
    norm overflows float32 are reported too, and are no model worth publishing."""
    if not params:
        return True
    norms = torch._foreach_norm([p.detach() for p in params])
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def apply_update(optimizer: torch.optim.Optimizer, losses: Sequence[torch.Tensor],
                 max_grad_norm: float, lr: float) -> tuple[float, float]:
    """The end of every learner's step, guarded: (loss, grad_norm) after one optimizer
    update, or NonFiniteStep with the gradients discarded and the weights untouched
    (or, ``weights_touched``, the update made them non-finite)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = torch.stack([x.detach().float() for x in losses]).sum()
    try:
        require_finite("loss", total)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        require_finite("gradient norm", grad_norm)
    except NonFiniteStep:
        optimizer.zero_grad(set_to_none=True)
        raise
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    if not weights_finite(params):
        raise NonFiniteStep(f"weights not finite after the update (loss {float(total)!r}, "
                            f"gradient norm {float(grad_norm)!r})", weights_touched=True)
    return float(total), float(grad_norm)
