"""Success rate of an HF causal LM on a task's held-out eval prompts.

    python -m rlfleet.tools.evaluate --model models/tiny-qwen2 --task arithmetic

The episodes are played by ``rlfleet.daemons.tasks.episodes`` (the same loop the
trainer's held-out evaluation uses); this module loads a model folder and prints.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from rlfleet.daemons.tasks import get_task
from rlfleet.daemons.tasks.episodes import evaluate_model

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
