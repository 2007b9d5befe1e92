"""The log-prob mismatch between a bf16 rollout engine and the float32 trainer (issue 31
item 3): what TIS (``[trainer.loss] kind = "tis"``) corrects for.

    python -m rlfleet.tools.bench.logprob_mismatch --json tools/bench/results/logprob_mismatch.json

Per model and seed: the torch rollout engine samples completions (temperature 1, no EOS)
from random prompts and reports each token's log-prob (what a trajectory carries as its
behaviour log-prob); the megatron learner computes the same tokens' log-probs with its
forward pass (what the loss takes as the policy's). Three pairings, each on the engine's own
samples:

- ``engine bf16 vs trainer float32``: the production pairing (bf16 serving, float32 training);
- ``engine float32 vs trainer float32``: the control, where only kernels and summation
  order differ;
- ``engine bf16 vs trainer bf16``: both in bf16 (megatron's mixed precision).

For each: the per-token difference d = trainer - engine (mean, mean |d|, max |d|) and the
importance ratio exp(d) that TIS weights a token by (its 1st and 99th percentiles, the
fraction of tokens whose ratio leaves [1/2, 2], TIS's default cap being 2).

Models: the shipped tiny-qwen2 (0.42M parameters, warm-started: peaked distributions), and
the qwen2-100m shape (98M parameters, random weights: near-uniform ones); ``--dry`` runs the
tiny model alone with fewer tokens (CI). On the CPU: a GPU's bf16 kernels round differently,
so these are this machine's figures, the method the same.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "tiny-qwen2"
PAIRINGS = (("bfloat16", "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"))


def engine_samples(model: Path, dtype: str, prompts: list[list[int]], new: int, seed: int
                   ) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, the engine's log-probs) per prompt."""
    from rlfleet.common.wire.arrays import Int32Array
    from rlfleet.common.wire.messages import GenerateRequest
    from rlfleet.daemons.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(model, max_batch=len(prompts), max_len=len(prompts[0]) + new,
                                         seed=seed, dtype=dtype, device="cpu", eos_token_ids=set())
    for i, p in enumerate(prompts):
        engine.add(GenerateRequest(request_id=str(i), trajectory_id="mismatch", prompt_token_ids=Int32Array(p),
                                   max_new_tokens=new, temperature=1.0, top_p=1.0))
    done: dict[int, Any] = {}
    while engine.has_work():
        for r in engine.step():
            done[int(r.request_id)] = r
    return [(prompts[i], done[i].token_ids.tolist(), done[i].logprobs.tolist()) for i in range(len(prompts))]


def trainer_logprobs(learner: Any, samples: list[tuple[list[int], list[int], list[float]]]) -> list[list[float]]:
    """The learner's log-probs of each completion's tokens (rows of equal length: no padding)."""
    import torch

    ids = torch.tensor([p + c for p, c, _ in samples], dtype=torch.long)
    with torch.no_grad():
        logp = learner.forward_logprobs(ids)[0]
    start = len(samples[0][0]) - 1  # logp[:, j] is the log-prob of ids[:, j + 1]
    return [row[start:start + len(c)].tolist() for row, (_, c, _) in zip(logp, samples, strict=True)]


def mismatch(trainer: list[list[float]], engine: list[list[float]]) -> dict[str, Any]:
    import numpy as np

    d = np.array([t - e for tr, en in zip(trainer, engine, strict=True) for t, e in zip(tr, en, strict=True)])
    ratio = np.exp(d)
    return {"tokens": int(d.size), "mean_diff": float(d.mean()), "mean_abs_diff": float(np.abs(d).mean()),
            "max_abs_diff": float(np.abs(d).max()), "ratio_p01": float(np.percentile(ratio, 1)),
            "ratio_p99": float(np.percentile(ratio, 99)),
            "ratio_outside_half_to_2": float(((ratio < 0.5) | (ratio > 2.0)).mean())}


def measure(model: Path, seeds: list[int], prompts_n: int, prompt_len: int, new: int) -> list[dict[str, Any]]:
    import json

    from rlfleet.daemons.trainer.megatron.learner import MegatronLearner, release_parallel_state
    from rlfleet.tools.bench.rollout_engine import _prompts

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    learners = {p: MegatronLearner(model, device="cpu", precision=p) for p in ("float32", "bfloat16")}
    out = []
    for seed in seeds:
        prompts = _prompts(prompts_n, prompt_len, vocab, 1, seed=1000 + seed)
        for engine_dtype, trainer_precision in PAIRINGS:
            started = time.perf_counter()
            samples = engine_samples(model, engine_dtype, prompts, new, seed)
            stats = mismatch(trainer_logprobs(learners[trainer_precision], samples), [e for _, _, e in samples])
            out.append({"seed": seed, "engine": engine_dtype, "trainer": trainer_precision, **stats,
                        "seconds": round(time.perf_counter() - started, 2)})
            print(f"[mismatch] {model.name} seed {seed}: engine {engine_dtype} vs trainer {trainer_precision}: "
                  f"mean |d| {stats['mean_abs_diff']:.2e}, max {stats['max_abs_diff']:.2e}, "
                  f"ratio outside [1/2, 2] {stats['ratio_outside_half_to_2']:.4f}", flush=True)
    for learner in learners.values():
        learner.gpt = learner.ddp = learner.optimizer = None
    release_parallel_state()
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and pairing: the mean over seeds of each statistic, and its spread."""
    out: dict[str, Any] = {}
    for row in rows:
        key = f"{row['model']}: engine {row['engine']} vs trainer {row['trainer']}"
        out.setdefault(key, []).append(row)
    summary = {}
    for key, group in out.items():
        entry: dict[str, Any] = {"seeds": len(group)}
        for stat in ("mean_diff", "mean_abs_diff", "max_abs_diff", "ratio_p01", "ratio_p99", "ratio_outside_half_to_2"):
            values = [g[stat] for g in group]
            mean = sum(values) / len(values)
            entry[stat] = {"mean": mean, "min": min(values), "max": max(values),
                           "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))}
        summary[key] = entry
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--dry", action="store_true", help="tiny-qwen2 alone, one seed, fewer tokens (CI)")
    args = p.parse_args(argv)
    from rlfleet.tools import model_shapes
    from rlfleet.tools.bench.output import provenance, write_json

    seeds = [0] if args.dry else list(range(args.seeds))
    prompts_n, new = (4, 8) if args.dry else (args.prompts, args.new_tokens)
    record: dict[str, Any] = {**provenance("rlfleet.tools.bench.logprob_mismatch", argv), "dry": args.dry,
                              "prompts": prompts_n, "prompt_len": args.prompt_len, "new_tokens": new,
                              "temperature": 1.0, "device": "cpu", "rows": []}
    with tempfile.TemporaryDirectory(prefix="rlfleet-mismatch-") as tmp:
        models = {"tiny-qwen2": TINY}
        if not args.dry:
            shape = Path(tmp) / "qwen2-100m"
            model_shapes.write_shape("qwen2-100m", shape, dtype="float32", seed=0)
            models["qwen2-100m"] = shape
        for name, path in models.items():
            for row in measure(path, seeds, prompts_n, args.prompt_len, new):
                record["rows"].append({"model": name, **row})
    record["summary"] = summarise(record["rows"])
    write_json(args.json, record)
    print(f"[mismatch] wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
