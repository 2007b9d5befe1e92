"""The torch engine's KV slots and its sampler (kept apart so engine.py reads as the algorithm)."""

from __future__ import annotations

from typing import Any

import torch


class SlotCache:
    """The KV slots: one tensor ``kv`` [layers, 2 (K, V), rows, kv_heads, max_len, head_dim].

    One tensor, so moving a row (``move_row``) is one copy whatever the layer count.
    ``k[layer]`` / ``v[layer]`` are its per-layer views, and ``update`` makes it a Cache
    for transformers' attention layers (``forward.ModelForward``): the engine sets ``lo``,
    ``hi`` (the contiguous rows of this forward), ``index`` (each row's positions,
    expanded for scatter) and ``kv_len`` before each forward; ``update`` writes the new
    keys/values there and returns the rows' cache up to ``kv_len``, which the attention
    mask then restricts per row.
    """

    def __init__(self, layers: int, rows: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv = torch.zeros((layers, 2, rows, heads, max_len, head_dim), dtype=dtype, device=device)
        self.k = list(self.kv[:, 0])
        self.v = list(self.kv[:, 1])
        self.lo = self.hi = self.kv_len = 0
        self.index: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[layer_idx][self.lo:self.hi], self.v[layer_idx][self.lo:self.hi]
        k.scatter_(2, self.index, key_states)
        v.scatter_(2, self.index, value_states)
        return k[:, :, :self.kv_len], v[:, :, :self.kv_len]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def copy_rows(self, src: list[int], dst: int, length: int) -> None:
        """Rows dst, dst+1, ... get the first ``length`` slots of rows src (one copy)."""
        index = torch.tensor(src, device=self.kv.device)
        self.kv[:, :, dst:dst + len(src), :, :length] = self.kv[:, :, index, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some model code paths
        return self.kv_len


def sample(logits: torch.Tensor, requests: list[Any], generators: list[torch.Generator | None],
           shared: torch.Generator) -> tuple[list[int], list[float]]:
    """(token, log-prob at temperature 1) per row of logits, for the requests of those rows.

    Temperature 0 is argmax; otherwise ``sample_rows`` with one uniform per row, from the
    row's own generator if it has one (seeded requests), else from ``shared`` (one draw
    call for all rows, seeded or not, so the shared stream does not depend on seeds).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # temperature 1, full vocabulary: see engine.py
    rows = [i for i, r in enumerate(requests) if r.temperature > 0]
    if len(rows) < len(requests):
        tokens = logits.argmax(dim=-1)
    if rows:
        every = len(rows) == len(requests)
        temps = [requests[i].temperature for i in rows]
        top_p = [requests[i].top_p for i in rows]
        u = torch.rand(len(rows), generator=shared)
        seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
        if seeded:
            u[torch.tensor(seeded)] = torch.cat([torch.rand(1, generator=generators[rows[j]])
                                                 for j in seeded])
        u = u.to(logits.device)
        scaled = logits if every else logits[torch.tensor(rows, device=logits.device)]
        if any(t != 1.0 for t in temps):  # x / 1.0 == x: skip the division
            scaled = scaled / torch.tensor(temps, device=logits.device)[:, None]
        picked = sample_rows(scaled, top_p, u)
        if every:
            tokens = picked
        else:
            tokens[torch.tensor(rows, device=logits.device)] = picked
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def sample_rows(scaled: torch.Tensor, top_p: list[float], u: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(scaled) restricted to the top-p nucleus.

    Inverse CDF with the given uniforms u in [0, 1): reproducible from u alone.
    """
    probs = torch.softmax(scaled, dim=-1)
    order = None
    if any(p < 1.0 for p in top_p):
        probs, order = probs.sort(dim=-1, descending=True)
        cdf = probs.cumsum(-1)
        p = torch.tensor(top_p, device=scaled.device)[:, None]
        # Keep a token if the mass before it is < top_p: the nucleus, never empty.
        probs = torch.where(cdf - probs < p, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to total: never step past the last token that has mass.
    if bool((pick >= cdf.shape[-1]).any()):
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
        pick = torch.minimum(pick, last)
    return pick if order is None else order.gather(1, pick[:, None])[:, 0]
