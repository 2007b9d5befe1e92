"""Trainer micro-benchmarks (not collected by pytest):

    .venv/bin/python -m tests.daemons.trainer.bench_trainer

ExperienceJournal append rate (one fsync per call) and replay rate; one GRPO step of
B=32 (4 groups of 8) on the tiny random Qwen2; one step as the arithmetic job makes
them (models/tiny-qwen2, 7 prompt + 1..5 generated tokens), wall and CPU; the weight
snapshot; a checkpoint.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

from rlfleet.daemons.trainer.journal import ExperienceJournal
from rlfleet.daemons.trainer.learner import Learner

from .conftest import build_tiny_model, scored


def main() -> None:
    torch.set_num_threads(1)
    d = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    prompt = tuple([1] + [5 + (i % 30) for i in range(40)])  # 41 prompt tokens
    trajs = [scored(p, k, float(k % 2), prompt=prompt, tokens=tuple(range(4, 20)), logprobs=[-1.0] * 16)
             for p in range(125) for k in range(8)]  # 16 generated tokens each
    for batch in (1, 64):
        path = d / f"journal-{batch}.bin"
        with ExperienceJournal(path) as j:
            t = time.perf_counter()
            for i in range(0, len(trajs), batch):
                j.append_trajectories(trajs[i:i + batch])
            dt = time.perf_counter() - t
            size = j.size_bytes()
        t = time.perf_counter()
        ExperienceJournal(path).close()
        rt = time.perf_counter() - t
        print(f"journal, batches of {batch:2d}: {len(trajs) / dt:7.0f} appends/s, "
              f"{size / len(trajs):.0f} B/trajectory, replay {len(trajs) / rt:.0f}/s")
    learner = Learner(build_tiny_model(d / "model"), lr=1e-4)
    groups = [trajs[i * 8:(i + 1) * 8] for i in range(4)]
    learner.train_step(groups)  # warm-up
    n = 5
    t = time.perf_counter()
    for _ in range(n):
        stats = learner.train_step(groups)
    dt = (time.perf_counter() - t) / n
    print(f"train_step B=32 (41+16 tokens each): {dt * 1000:.0f} ms, {stats['tokens'] / dt:.0f} trained tokens/s")
    arithmetic_step(Path(__file__).resolve().parents[3] / "models" / "tiny-qwen2")
    t = time.perf_counter()
    tensors = learner.state_tensors()
    print(f"state_tensors: {(time.perf_counter() - t) * 1000:.1f} ms for "
          f"{sum(v.nbytes for v in {id(v): v for v in tensors.values()}.values())} bytes")
    t = time.perf_counter()
    learner.save_checkpoint(d / "checkpoints")
    print(f"save_checkpoint: {(time.perf_counter() - t) * 1000:.0f} ms")


def arithmetic_step(model: Path, n: int = 100) -> None:
    """Steps shaped like examples/arithmetic.toml's: 4 prompts x 8, short completions."""
    rng = random.Random(0)

    def groups(step: int) -> list:
        out = []
        for p in range(4):
            prompt = tuple([3] + [rng.randrange(4, 36) for _ in range(6)])
            out.append([scored(step * 4 + p, k, float(rng.random() < 0.5), prompt=prompt,
                               tokens=tuple(rng.randrange(4, 36) for _ in range(m)),
                               logprobs=[-rng.random() * 3 for _ in range(m)])
                        for k, m in ((k, rng.randrange(1, 6)) for k in range(8))])
        return out

    learner = Learner(model, lr=1e-4)
    batches = [groups(i) for i in range(n + 5)]
    for b in batches[:5]:
        learner.train_step(b)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    for b in batches[5:]:
        learner.train_step(b)
    print(f"train_step arithmetic-shaped (tiny-qwen2, 32 x 7+1..5 tokens): "
          f"{(time.perf_counter() - t) / n * 1000:.1f} ms wall, "
          f"{(time.process_time() - c) / n * 1000:.1f} ms CPU per step")


if __name__ == "__main__":
    main()
