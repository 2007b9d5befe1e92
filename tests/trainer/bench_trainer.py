"""Trainer micro-benchmarks (not collected by pytest):

    .venv/bin/python -m tests.trainer.bench_trainer

Journal append rate (one fsync per call) and replay rate; one GRPO step of
B=32 (4 groups of 8) on the tiny random Qwen2; the weight snapshot; a checkpoint.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from rlfleet.daemons.trainer.journal import Journal
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
        with Journal(path) as j:
            t = time.perf_counter()
            for i in range(0, len(trajs), batch):
                j.append_trajectories(trajs[i:i + batch])
            dt = time.perf_counter() - t
            size = j.size_bytes()
        t = time.perf_counter()
        Journal(path).close()
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
    t = time.perf_counter()
    tensors = learner.state_tensors()
    print(f"state_tensors: {(time.perf_counter() - t) * 1000:.1f} ms for "
          f"{sum(v.nbytes for v in {id(v): v for v in tensors.values()}.values())} bytes")
    t = time.perf_counter()
    learner.save_checkpoint(d / "checkpoints")
    print(f"save_checkpoint: {(time.perf_counter() - t) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
