"""The device a daemon computes on: the GPUs its placement gave it (CUDA_VISIBLE_DEVICES,
set by its host's agent or by `rlfleet run`: docs/operations/gpus.md), else the CPU."""

from __future__ import annotations

import os
from collections.abc import Mapping

GPU_ENV = "CUDA_VISIBLE_DEVICES"


def given_gpus(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The GPUs this process may use, as CUDA numbers them ("" and "-1": none)."""
    raw = environ.get(GPU_ENV, "")
    return tuple(g for g in (part.strip() for part in raw.split(",")) if g and g != "-1")


def torch_device(environ: Mapping[str, str] = os.environ) -> str:
    """'cuda' when this process was given GPUs, else 'cpu'. RuntimeError when it was given
    GPUs that torch cannot use: on the CPU instead it would run, silently, many times slower."""
    gpus = given_gpus(environ)
    if not gpus:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        reason = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise RuntimeError(f"this daemon was given GPU(s) {GPU_ENV}={','.join(gpus)}, but torch cannot use "
                           f"them: {reason} (torch {torch.__version__})")
    return "cuda"
