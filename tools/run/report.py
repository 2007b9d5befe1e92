"""A run's results from its metrics.jsonl: a summary and PNG plots.

metrics.jsonl holds one JSON object per line, each with `time` (unix seconds)
and `step`; training lines carry `reward_mean`, `tokens_per_s`, `staleness`
({staleness: count}), evaluation lines carry `eval_success` in [0, 1].

    python -m rlfleet.tools.run.report runs/<job>/<timestamp>
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunMetrics:
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0
    carried: Counter = field(default_factory=Counter)  # staleness of training lines a MetricsTail let go

    @property
    def t0(self) -> float:
        times = [r["time"] for r in self.train + self.evals]
        return min(times) if times else 0.0

    def staleness(self) -> Counter:
        total: Counter = Counter(self.carried)
        # a step made again after a restore has two lines: the later one's batch is the one trained
        for r in {r.get("step"): r for r in self.train}.values():
            total.update({int(k): int(v) for k, v in (r.get("staleness") or {}).items()})
        return total


def _add_line(out: RunMetrics, line: str) -> None:
    try:
        rec = json.loads(line)
    except ValueError:
        out.bad_lines += 1
        return
    if not isinstance(rec, dict) or "time" not in rec or "step" not in rec:
        out.bad_lines += 1
        return
    (out.evals if "eval_success" in rec else out.train).append(rec)


def read_metrics(path: Path) -> RunMetrics:
    """Tolerant reader: a torn last line (the trainer was killed mid-write) is skipped, counted."""
    out = RunMetrics()
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        _add_line(out, line)
    return out


class MetricsTail:
    """metrics.jsonl followed while the trainer writes it: each `poll()` parses only the
    lines appended since the last one (the live view polls twice a second, and a long
    run's file is megabytes). A line without its newline yet is left for the next poll.

    The live view needs the last line whole and the staleness of every step (a step trained
    again after a restore counts once: its later line replaces the earlier). So the last
    ``keep_whole`` lines are kept whole, the ``keep_train`` before them as SLIM (step, time,
    staleness), and the staleness of older ones is carried in a counter: a run of hours held
    every line (the first soak saw `rlfleet run`'s RSS climb), and 2,000 whole lines of the
    64-rollout sim fleet still took 10 MB. The whole run is read again from the file at the
    end (``read_metrics``)."""

    SLIM = ("step", "time", "staleness")

    def __init__(self, path: Path, keep_train: int = 2000, keep_whole: int = 50) -> None:
        self.path = path
        self.metrics = RunMetrics()
        self.keep_train, self.keep_whole = keep_train, keep_whole
        self._offset = 0
        self._slim = 0  # train[:_slim] are slim already

    def poll(self) -> tuple[int, int]:
        """Read what was appended; returns (new training lines, new eval lines)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:  # not written yet
            return 0, 0
        end = chunk.rfind(b"\n")
        if end < 0:
            return 0, 0
        self._offset += end + 1
        n_train, n_evals = len(self.metrics.train), len(self.metrics.evals)
        for line in chunk[:end].decode(errors="replace").splitlines():
            _add_line(self.metrics, line)
        new = len(self.metrics.train) - n_train, len(self.metrics.evals) - n_evals
        train = self.metrics.train
        if len(train) > self.keep_train:
            let_go = train[:len(train) - self.keep_train]
            for r in {r.get("step"): r for r in let_go}.values():
                self.metrics.carried.update({int(k): int(v) for k, v in (r.get("staleness") or {}).items()})
            del train[:len(let_go)]
            self._slim = max(0, self._slim - len(let_go))
        for i in range(self._slim, max(self._slim, len(train) - self.keep_whole)):
            train[i] = {k: train[i][k] for k in self.SLIM if k in train[i]}
        self._slim = max(self._slim, len(train) - self.keep_whole)
        return new


def throughput(m: RunMetrics) -> dict[str, Any]:
    """End-to-end rates over the training span, and where the trainer's time went.

    `tokens_per_s_mean` is the learner's speed inside a step; these divide everything
    trained by the wall time from the first step to the last, so waiting counts.
    """
    span = m.train[-1]["time"] - m.train[0]["time"] if len(m.train) > 1 else 0.0
    trajectories = sum(r.get("trajectories", 0) for r in m.train[1:])
    tokens = sum(r.get("tokens", 0) for r in m.train[1:])
    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in m.train)
    spent = {"learn": round(total("step_s"), 1), "wait_for_batch": round(total("wait_s"), 1),
             "snapshot": round(total("snapshot_s"), 1)}
    spent["eval"] = round(sum(r.get("eval_s", 0.0) for r in m.evals), 1)
    out: dict[str, Any] = {"trained_trajectories": sum(r.get("trajectories", 0) for r in m.train),
                           "trained_tokens": sum(r.get("tokens", 0) for r in m.train),
                           "trainer_time_s": spent}
    if span > 0:  # the first step's batch was gathered before the span starts
        out["trajectories_per_s"] = round(trajectories / span, 2)
        out["trained_tokens_per_s"] = round(tokens / span, 1)
    return out


def summary(m: RunMetrics) -> dict[str, Any]:
    s: dict[str, Any] = {"steps": max((r["step"] for r in m.train), default=0),
                         "wall_s": round(max((r["time"] for r in m.train + m.evals), default=m.t0) - m.t0, 1)}
    if m.evals:
        s["eval_success_first"] = m.evals[0]["eval_success"]
        s["eval_success_last"] = m.evals[-1]["eval_success"]
        s["eval_success_best"] = max(r["eval_success"] for r in m.evals)
    if m.train:
        last = m.train[-5:]
        s["reward_mean_last5"] = round(sum(r.get("reward_mean", 0.0) for r in last) / len(last), 4)
        s["tokens_per_s_mean"] = round(sum(r.get("tokens_per_s", 0.0) for r in m.train) / len(m.train), 1)
        s.update(throughput(m))
    s["staleness"] = dict(sorted(m.staleness().items()))
    # A step made again after a restore (daemons/trainer/resume.py) has a second line; "steps"
    # counts each step once, these say how many were made twice and what was dropped.
    s["retrained_steps"] = sum(1 for r in m.train if r.get("replayed"))
    if m.train and isinstance(m.train[-1].get("dropped"), dict):
        s["dropped_groups"] = dict(m.train[-1]["dropped"])
    return s


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start), one per value."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """About 1/20 of the run, at least 1 and at most 50 steps: long enough to show the
    trend of a batch mean that swings between 0 and 1, short enough to follow it."""
    return max(1, min(50, n // 20))


def draw(ax: Any, m: RunMetrics, axis: str) -> None:
    """Raw per-step reward (faint), its moving average, and the held-out evaluations
    as large marked points: the trend and each measurement readable at a glance."""
    t0 = m.t0  # a scan of every line: once, not once per point (30k steps took 190 s)
    def xs(rows: list[dict[str, Any]]) -> list[float]:
        return [r["time"] - t0 if axis == "time" else r["step"] for r in rows]
    if m.train:
        rewards = [r.get("reward_mean", 0.0) for r in m.train]
        window = smoothing_window(len(rewards))
        ax.plot(xs(m.train), rewards, color="tab:blue", alpha=0.2, linewidth=0.8,
                label="train reward (batch mean, raw)")
        ax.plot(xs(m.train), moving_average(rewards, window), color="tab:blue", linewidth=2.0,
                label=f"train reward ({window}-step moving average)")
    if m.evals:
        ax.plot(xs(m.evals), [r["eval_success"] for r in m.evals], color="tab:red", linestyle="--",
                linewidth=1.0, marker="D", markersize=6, markeredgecolor="black", zorder=3,
                label="held-out eval success (each evaluation)")


def plot(m: RunMetrics, out_dir: Path, title: str = "") -> list[Path]:
    """reward and eval success against wall-clock and against step (two PNGs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for axis, xlabel, fname in (("time", "wall-clock (s)", "learning_vs_time.png"),
                                ("step", "trainer step", "learning_vs_step.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, m, axis)
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
        ax.set_title(title)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m rlfleet.tools.run.report RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    m = read_metrics(run_dir / "metrics.jsonl")
    print(json.dumps(summary(m), indent=2))
    for path in plot(m, run_dir, title=run_dir.name):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
