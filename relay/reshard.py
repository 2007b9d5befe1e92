"""Resharding hook: tensor-parallel slices of a version, computed once at the master.

Layout k (k > 1) is a second object of the same version whose byte range holds
rank 0's slices, then rank 1's, …, so a rollout rank maps one contiguous
region. Which dimension a tensor splits along follows Megatron's convention
for Llama/Qwen-style names: column-parallel projections (q/k/v, gate/up,
embeddings, lm_head) split their output dimension (0), row-parallel ones
(o_proj, down_proj) their input dimension (1); norms, biases of row-parallel
layers and anything unrecognised or not divisible are replicated (and listed
in the manifest's `extra.replicated`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rlfleet.relay.manifest import FlatSource, Manifest, build_manifest, tensor_views

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head", "qkv_proj",
           "gate_up_proj", "wq", "wk", "wv", "w1", "w3")
_ROW = ("o_proj", "down_proj", "wo", "w2")


def split_dim(name: str, shape: tuple[int, ...], tp: int) -> int | None:
    """Dimension `name` is sliced along for `tp` ranks, or None to replicate."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else name
    leaf = parts[-1]
    dim: int | None = None
    if module in _COLUMN and leaf in ("weight", "bias"):
        dim = 0
    elif module in _ROW and leaf == "weight" and len(shape) == 2:
        dim = 1
    if dim is None or dim >= len(shape) or shape[dim] % tp:
        return None
    return dim


def shard_tensors(tensors: Mapping[str, np.ndarray], tp: int) -> tuple[list[tuple[str, np.ndarray, int]], list[str]]:
    """[(name, slice, rank)] ordered rank-major, and the names that were replicated."""
    replicated = [n for n, a in tensors.items() if split_dim(n, tuple(a.shape), tp) is None]
    out = []
    for rank in range(tp):
        for name, arr in tensors.items():
            dim = split_dim(name, tuple(arr.shape), tp)
            if dim is None:
                out.append((name, arr, rank))
            else:
                size = arr.shape[dim] // tp
                out.append((name, np.take(arr, np.arange(rank * size, (rank + 1) * size), axis=dim), rank))
    return out, replicated


def reshard(full: Manifest, buf: object, tp: int) -> tuple[Manifest, FlatSource]:
    """The layout-`tp` object of the version whose full copy is `full` (bytes in `buf`)."""
    if tp < 2:
        raise ValueError(f"a sharded layout needs tp >= 2, got {tp}")
    items, replicated = shard_tensors(tensor_views(full, buf), tp)
    manifest, src = build_manifest(full.version, items, chunk_bytes=full.chunk_bytes, layout=tp,
                                   algo=full.algo, source_checksum=full.checksum)
    manifest.extra["replicated"] = replicated
    manifest.extra["split"] = "megatron"
    return manifest, src
