"""megatron-core on a machine without CUDA: the few places it names "cuda", pointed at the
CPU at the edge, so everything else is the code a GPU runs.

megatron-core 0.16.1 is written for GPUs. With gloo as the process-group backend its math
runs on CPU tensors unchanged, except where it allocates on "cuda" by name or checks a
tensor's CUDA type name:

- ``torch.cuda.current_device()`` (RoPE's frequencies, DDP's gradient buffers, the
  distributed optimizer's shards): "cpu"; ``torch.cuda.synchronize()`` (the checkpoint
  writer's): nothing to wait for;
- the tensor-parallel CUDA RNG tracker forks the CUDA generator around dropout (0 here):
  a no-op;
- ``torch.tensor/zeros/ones/empty(..., device="cuda")`` in the optimizer, gradient
  clipping and multi-tensor helpers (a one-element flag or norm): the same on the CPU,
  through a ``torch`` stand-in in those modules only;
- the optimizers' construction and gradient clipping check ``param.type() ==
  "torch.cuda.FloatTensor"``: answered with the CUDA names while ``cuda_type_names()`` runs.

``install()`` is idempotent and does nothing where CUDA is available.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

# The megatron-core modules that allocate on "cuda" by name (0.16.1).
_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
            "megatron.core.optimizer.distrib_optimizer",
            "megatron.core.distributed.param_and_grad_buffer", "megatron.core.utils")
_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})
_installed = False


class _TorchOnCpu:
    """``torch`` for one module, whose tensor factories put a "cuda" device on the CPU."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)
        return factory


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> None:
    """Point megatron-core's CUDA names at the CPU (module docstring); once per process."""
    global _installed
    if _installed or not needed():
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]  # nothing to wait for
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[method-assign]
    for name in _MODULES:
        importlib.import_module(name).torch = _TorchOnCpu()  # type: ignore[attr-defined]
    _installed = True


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """While megatron builds or steps its optimizer: CPU tensors answer ``.type()`` with
    the CUDA type name its checks expect (a float32 CPU parameter is "torch.cuda.FloatTensor")."""
    if not needed():
        yield
        return
    plain = torch.Tensor.type

    def cuda_named(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = plain(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = plain  # type: ignore[method-assign]
