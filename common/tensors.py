"""Weights between torch and numpy in the published dtype (`[model] dtype`): float32 or
bfloat16. numpy holds bfloat16 through ml_dtypes; torch.from_numpy does not take that
dtype, so a tensor crosses as its 16 bits, never through a float32 copy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

PUBLISH_DTYPES = ("float32", "bfloat16")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_numpy(t: torch.Tensor, dtype: str = "float32") -> np.ndarray:
    """A numpy copy of ``t`` in ``dtype`` (one of PUBLISH_DTYPES), on the CPU."""
    if dtype == "float32":
        return t.detach().to(torch.float32).cpu().numpy().copy()
    if dtype == "bfloat16":
        return t.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(BFLOAT16).copy()
    raise ValueError(f"cannot publish in {dtype!r}; published dtypes: {', '.join(PUBLISH_DTYPES)}")


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy float array (float32, float16, float64 or bfloat16)."""
    a = np.asarray(a)
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def is_float(a: np.ndarray) -> bool:
    """Whether an engine can load ``a`` as weights: a numpy float, or bfloat16 (its kind is 'V')."""
    dtype = np.asarray(a).dtype
    return dtype.kind == "f" or dtype == BFLOAT16
