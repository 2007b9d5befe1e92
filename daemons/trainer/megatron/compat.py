"""megatron-core 0.16.1 in a long-running daemon with torch's AdamW (its fallback without
apex or TransformerEngine, the local layer spec's setting, on GPUs too): two fixes at the edge.

torch's AdamW keeps a per-parameter ``step`` (Adam's bias-correction t); apex's keeps it
per parameter group. megatron's parameter-state checkpoint formats carry each parameter's
master weight and moments, not ``step``, yet ``_set_main_param_and_optimizer_states``
copies every key the destination state has and fails with ``KeyError: 'step'`` on load.
``install()`` makes it copy the keys the checkpoint has; the learner saves the step count
itself and sets it after a load (every parameter steps together).

The checkpoint writer (``filesystem_async``) collects its write results through a queue
served by a ``multiprocessing`` Manager: a spawned server process that outlives a trainer
killed with -9 (three orphans of 300 MB each were found after the restart test). The
learner saves synchronously: the queue is filled and read by the saving process itself,
so an in-process ``queue.Queue`` serves, with no server process. (A multiprocessing queue
of the fork context does not: its feeder thread may not have flushed when the writer reads
it at once, "results_queue should not be empty", seen in CI.)
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Idempotent; patches DistributedOptimizer._set_main_param_and_optimizer_states and the
    checkpoint writer's results queue."""
    global _installed
    if _installed:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_present_keys(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                dst.copy_(tensors[key])

    DistributedOptimizer._set_main_param_and_optimizer_states = set_present_keys

    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = queue.Queue
    _installed = True


def adam_step(optimizer: Any) -> float:
    """The step count of a (chained) megatron optimizer over torch's AdamW; 0 before a step."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in o.optimizer.state.values():
            if "step" in state:
                return float(state["step"])
    return 0.0


def set_adam_step(optimizer: Any, step: float) -> None:
    """Set every parameter's step count (after a checkpoint's parameter state was loaded)."""
    import torch

    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in o.optimizer.state.values():
            state["step"] = torch.tensor(step)
