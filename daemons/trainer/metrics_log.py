"""metrics.jsonl: one JSON object per line, appended by the training thread.

A step line (``step_line``) has: time, step (= version: step n makes version n),
reward_mean/std, loss, trajectories, groups, tokens (generated tokens trained on),
tokens_per_s (over the step's compute), step_s, snapshot_s (the copy handed to the
publisher), wait_s (waiting for data), published_version / push_s (the last push
that finished), staleness {versions behind: trajectories in this step}, dropped
{reason: groups, job total}, trained_groups / pending_groups (job totals),
ratio_mean, clip_frac, approx_kl, entropy, grad_norm, lr, checkpoint (path or null),
mixed_version (trajectories in this step with a turn made by more than one weight
version: only the `partial` mode makes them), continuations (interrupted generations
continued, this step), repack_overhead_s (each repacked generation's wait, this step).
The sim trainer backend (sim_learner.py) has no ratio/KL/entropy/grad_norm/lr; it adds
model_step_s (the modeled step, in model seconds), batch_tokens (the prompt + completion
tokens it was modeled on) and sim_lag_s (wall seconds the step ran over its model).
Eval lines (daemons/trainer/evaluation.py) share the file: time, step, eval_success.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

_LEARNER_KEYS = ("ratio_mean", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr",
                 "model_step_s", "batch_tokens", "sim_lag_s")


def batch_versions(batch: list[Any]) -> dict[str, Any]:
    """What the step's trajectories say about their versions: how many mix versions
    within a turn, how many generations were continued, and each repack's overhead."""
    mixed = continued = 0
    overheads: list[float] = []
    for group in batch:
        for st in group:
            t = st.trajectory
            mixed += any(len({seg.version for seg in turn.segments}) > 1 for turn in t.turns)
            continued += _count(t.info.get("continuations", ""))
            overheads += _seconds(t.info.get("repack_overhead_s", ""))
    return {"mixed_version": mixed, "continuations": continued, "repack_overhead_s": overheads}


def _count(raw: str) -> int:
    # info is the env-host's free text: a malformed figure is no figure, never an error
    return int(raw) if raw.isdigit() else 0


def _seconds(raw: str) -> list[float]:
    out = []
    for x in raw.split(","):
        try:
            v = float(x)
        except ValueError:
            continue
        if 0 <= v < 1e6:
            out.append(v)
    return out


def step_line(*, version: int, stats: dict[str, Any], ages: Counter[int], wait_s: float,
              snapshot_s: float, publisher: Any, summary: dict[str, Any],
              checkpoint: Path | None, versions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics line of one training step (``stats``: what the learner's train_step returned;
    ``summary``: the journal's job totals)."""
    return {
        "time": round(time.time(), 3), "step": version, "version": version,
        "reward_mean": stats["reward_mean"], "reward_std": stats["reward_std"],
        "loss": stats["loss"], "trajectories": stats["trajectories"], "groups": stats["groups"],
        "tokens": int(stats["tokens"]),
        "tokens_per_s": round(stats["tokens"] / max(stats["step_s"], 1e-9), 1),
        "step_s": round(stats["step_s"], 4), "snapshot_s": round(snapshot_s, 4),
        "wait_s": round(wait_s, 4),
        # the push runs behind training: these describe the last push that finished
        "published_version": getattr(publisher, "published_version", None),
        "push_s": round(getattr(publisher, "last_publish_s", 0.0), 4),
        "staleness": {str(k): v for k, v in sorted(ages.items())},
        **summary,  # dropped {reason: groups}, trained_groups, pending_groups: job totals
        **{k: stats[k] for k in _LEARNER_KEYS if k in stats},
        "checkpoint": str(checkpoint) if checkpoint else None,
        **(versions or {}),
    }


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, line: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
