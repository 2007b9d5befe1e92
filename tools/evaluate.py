"""Success rate of an HF causal LM on a task's held-out eval prompts.

    python -m rlfleet.tools.evaluate --model models/tiny-qwen2 --task arithmetic

Decoding is a plain loop over the model's forward (no KV cache: the prompts are a few
dozen characters). Prompts are batched by token length so no padding is ever needed,
which keeps greedy results identical to one-at-a-time decoding. Sampling draws from the
full softmax at temperature 1.0 with an explicit torch.Generator, so a seed fixes it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from rlfleet.daemons.tasks import Prompt, Task, get_task

WARMSTART_FILE = "warmstart.json"


def load(model_dir: str | Path) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from an HF-format folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def task_difficulty(model_dir: str | Path, task_name: str) -> dict[str, Any]:
    """The difficulty the model was warm-started on (warmstart.json), or {} if unknown."""
    path = Path(model_dir) / WARMSTART_FILE
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("tasks", {}).get(task_name, {}))


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


def evaluate(model_dir: str | Path, task_name: str, n: int = 256, greedy: bool = True,
             seed: int = 0, **difficulty: Any) -> float:
    """Success fraction in [0, 1] on n held-out eval prompts of `task_name`.

    The task difficulty defaults to the one recorded in the model's warmstart.json;
    keyword arguments override it.
    """
    model, tokenizer = load(model_dir)
    task = get_task(task_name, **{**task_difficulty(model_dir, task_name), **difficulty})
    prompts = task.make_prompts("eval", n, seed=seed)
    return evaluate_model(model, tokenizer, task, prompts, greedy, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--task", required=True, choices=["arithmetic", "frozenlake"])
    parser.add_argument("--n", type=int, default=256, help="eval prompts")
    parser.add_argument("--seed", type=int, default=0, help="prompt set and sampling seed")
    parser.add_argument("--mode", choices=["greedy", "sample", "both"], default="both")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = {"greedy": [True], "sample": [False], "both": [True, False]}[args.mode]
    for greedy in modes:
        t0 = time.perf_counter()
        score = evaluate(args.model, args.task, args.n, greedy, args.seed)
        label = "greedy" if greedy else "sample(T=1.0)"
        print(f"{args.task} {label}: success {score:.3f} on n={args.n} "
              f"eval prompts ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
