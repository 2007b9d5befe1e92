"""Play a task's episodes with an HF causal LM: greedy or sampled success on a prompt set.

Shared by the trainer (held-out evaluation, daemons/trainer/evaluation.py) and the
tools (``python -m rlfleet.tools.evaluate``, the warm start, the TRL peer bench), so
every success rate in the project is measured by this one loop. Imports torch: it is
not imported by ``rlfleet.daemons.tasks`` itself, which env- and reward-hosts load.

Decoding is a plain loop over the model's forward (no KV cache: the prompts are a few
dozen characters). Prompts are batched by token length so no padding is ever needed,
which keeps greedy results identical to one-at-a-time decoding. Sampling draws from the
full softmax at temperature 1.0 with an explicit torch.Generator, so a seed fixes it.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Prompt, Task


@torch.no_grad()
def generate(model: Any, tokenizer: Any, texts: list[str], max_new_tokens: int,
             greedy: bool, generator: torch.Generator | None = None) -> list[str]:
    """One completion per text, cut at the end token (which is not included)."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts)["input_ids"]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out: list[str] = [""] * len(texts)
    # Groups in ascending length order: the sampling stream is consumed deterministically.
    for length in sorted(by_length):
        rows = by_length[length]
        ids = torch.tensor([encoded[i] for i in rows], dtype=torch.long)
        finished = torch.zeros(len(rows), dtype=torch.bool)
        new_tokens = []
        for _ in range(max_new_tokens + 1):  # +1: room for the end token
            logits = model(input_ids=ids).logits[:, -1, :].float()
            if greedy:
                nxt = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            nxt = torch.where(finished, torch.full_like(nxt, eos), nxt)
            new_tokens.append(nxt)
            finished |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if bool(finished.all()):
                break
        gen = torch.stack(new_tokens, dim=1).tolist()
        for row, toks in zip(rows, gen):
            toks = toks[:toks.index(eos)] if eos in toks else toks
            out[row] = tokenizer.decode(toks, skip_special_tokens=True)
    return out


def run_episodes(model: Any, tokenizer: Any, task: Task, prompts: list[Prompt],
                 greedy: bool, seed: int = 0) -> list[float]:
    """Play every prompt's episode to the end, all episodes batched turn by turn.

    Returns each episode's return (sum of step rewards).
    """
    generator = torch.Generator().manual_seed(seed)
    envs = [task.make_env() for _ in prompts]
    observations = [env.reset(p) for env, p in zip(envs, prompts)]
    returns = [0.0] * len(prompts)
    active = list(range(len(prompts)))
    while active:
        texts = [task.format_turn(observations[i]) for i in active]
        completions = generate(model, tokenizer, texts, task.max_new_tokens, greedy, generator)
        still = []
        for i, completion in zip(active, completions):
            observations[i], reward, done, _ = envs[i].step(completion)
            returns[i] += reward
            if not done:
                still.append(i)
        active = still
    return returns


def evaluate_model(model: Any, tokenizer: Any, task: Task, prompts: list[Prompt],
                   greedy: bool, seed: int = 0) -> float:
    """Fraction of episodes that earned reward 1.0 (both tasks pay 0 or 1)."""
    if not prompts:
        return 0.0
    returns = run_episodes(model, tokenizer, task, prompts, greedy, seed)
    return sum(r >= 1.0 for r in returns) / len(returns)
