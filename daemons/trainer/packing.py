"""Shared-prompt packing: the rows of a GRPO batch that share a prompt, as one sequence.

The G trajectories of a group answer the same prompt, so a TokenBatch computes that
prompt G times. A packed row holds it once, followed by every completion:

    prompt | completion 1 | completion 2 | ... | completion G | padding

with position ids that restart after the prompt for each completion (p, p+1, ...) and
a block attention mask: a completion token sees the prompt and the earlier tokens of
its own completion, nothing else. Each token therefore sees exactly the context it has
in its own TokenBatch row, so the log-prob of every target is the same as unpacked (up
to float summation order), and the loss, its gradient and the stats are too.

``PackedRows.position`` maps each TokenBatch target column back to the packed position
whose logits predict it, so the policy loss still receives [rows, T-1] tensors aligned
with the TokenBatch (the loss seam does not know about packing). Padding columns of a
TokenBatch row point at position 0 of its packed row: finite numbers, masked out.

Packing is used only when the packed layout costs less than the plain one. The cost
of a padded layout of R rows of width W is R*W tokens, each costing its projections
(~12 h^2 multiply-adds per layer for hidden size h) plus its attention over the row
(~2 h W): R*W*(1 + W/(6h)). One wide row per group can lose, e.g. with short prompts,
long completions and one short row padded to the widest. A packed row is never wider
than ``MAX_WIDTH`` (the mask and the attention scores grow with W^2). Padding
positions attend only to themselves, so no softmax row is empty (no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grpo import TokenBatch

MAX_WIDTH = 4096  # a group whose packed row would be wider stays unpacked


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, W] long
    position_ids: torch.Tensor  # [R, W] long
    attention: torch.Tensor  # [R, 1, W, W] bool, True = may attend
    widths: list[int]  # used positions of each packed row
    source: list[list[int]]  # packed row -> the TokenBatch rows it carries
    row: torch.Tensor  # [N] long: TokenBatch row -> its packed row
    position: torch.Tensor  # [N, T-1] long: TokenBatch target column -> packed position
    lengths: list[int]  # TokenBatch row -> its length (prompt + completion)


def pack(batch: TokenBatch, prompt_lengths: Sequence[int], pad_id: int = 0, *,
         hidden_size: int = 1 << 30, max_width: int = MAX_WIDTH) -> PackedRows:
    """Lay out ``batch`` with shared prompts once (or one row per row when that costs
    less); ``prompt_lengths[n]``: prompt tokens of TokenBatch row n; ``hidden_size``:
    the model's, for the cost of attention against projections (module docstring)."""
    ids = batch.input_ids.tolist()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for n, p in enumerate(prompt_lengths):
        by_prompt.setdefault(tuple(ids[n][:p]), []).append(n)
    plan: list[tuple[int, list[int]]] = []  # (prompt length or 0 for a plain row, rows)
    for prompt, rows in by_prompt.items():
        width = len(prompt) + sum(lengths[n] - len(prompt) for n in rows)
        if len(rows) > 1 and width <= max_width:
            plan.append((len(prompt), rows))
        else:
            plan.extend((0, [n]) for n in rows)
    widths = [p + sum(lengths[n] - p for n in rows) if p else lengths[rows[0]] for p, rows in plan]
    def cost(rows: int, width: int) -> float:
        return rows * width * (1.0 + width / (6.0 * hidden_size))

    if cost(len(plan), max(widths)) >= cost(len(ids), max(lengths)):
        plan = [(0, [n]) for n in range(len(ids))]  # packing would not shrink the batch
        widths = list(lengths)
    return _layout(ids, lengths, plan, widths, batch.input_ids.shape[1], pad_id)


def _layout(ids: list[list[int]], lengths: list[int], plan: list[tuple[int, list[int]]],
            widths: list[int], t: int, pad_id: int) -> PackedRows:
    r, w = len(plan), max(widths)
    input_ids = [[pad_id] * w for _ in range(r)]
    positions = [[0] * w for _ in range(r)]
    attention = torch.zeros((r, w, w), dtype=torch.bool)
    row = [0] * len(ids)
    where = [[0] * (t - 1) for _ in ids]  # TokenBatch (row, column) -> packed position
    for k, (p, rows) in enumerate(plan):
        out, pos = input_ids[k], positions[k]
        if not p:  # a plain row: as in the TokenBatch
            n = rows[0]
            ln = lengths[n]
            out[:ln] = ids[n][:ln]
            pos[:ln] = range(ln)
            attention[k, :ln, :ln] = True
            row[n] = k
            where[n][:ln - 1] = range(ln - 1)
            continue
        out[:p] = ids[rows[0]][:p]
        pos[:p] = range(p)
        attention[k, :p, :p] = True
        start = p
        for n in rows:
            gen = lengths[n] - p
            end = start + gen
            out[start:end] = ids[n][p:lengths[n]]
            pos[start:end] = range(p, p + gen)
            attention[k, start:end, :p] = True
            attention[k, start:end, start:end] = True
            row[n] = k
            # Column j predicts token j+1: prompt targets come from the prompt positions,
            # the first generated token from the prompt's last position, the others from
            # the previous generated token's position in this completion.
            where[n][:p] = range(p)
            where[n][p:p + gen - 1] = range(start, end - 1)
            start = end
    attention = torch.tril(attention)  # causal within the blocks
    # Padding: each position sees only itself (an empty softmax row would be NaN).
    pad = torch.ones(w, dtype=torch.bool)
    for k, used in enumerate(widths):
        pad[:] = True
        pad[:used] = False
        attention[k].diagonal().logical_or_(pad)
    return PackedRows(torch.tensor(input_ids, dtype=torch.long),
                      torch.tensor(positions, dtype=torch.long), attention[:, None],
                      widths, [rows for _, rows in plan], torch.tensor(row, dtype=torch.long),
                      torch.tensor(where, dtype=torch.long), lengths)


def token_logprobs(logits: torch.Tensor, packed: PackedRows, prows: Sequence[int],
                   rows: Sequence[int], targets: torch.Tensor,
                   temperature: float = 1.0, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.token_logprobs for TokenBatch ``rows`` from the logits of packed rows ``prows``
    (``entropy_grad``: the entropies carry gradient, for a loss with an entropy bonus).

    ``logits`` [len(prows), W, V]; ``targets`` [len(rows), T'] = input_ids[rows, 1:T'+1].
    Returns log-probs and entropies [len(rows), T'], aligned with the TokenBatch."""
    local = torch.full((len(packed.widths),), -1, dtype=torch.long)
    local[list(prows)] = torch.arange(len(prows))
    index = torch.tensor(list(rows), dtype=torch.long)
    prow = local[packed.row[index]][:, None].to(logits.device)  # the layout is built on the CPU
    pos = packed.position[index, :targets.shape[1]].to(logits.device)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all[prow, pos].gather(-1, targets[..., None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)[prow, pos]
    return logp, entropy
