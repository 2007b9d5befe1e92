"""Learning benchmark: does the fleet make the tiny model better, every time?

Runs `rlfleet run examples/<task>.toml` once per task and seed on this machine
(private etcd, every daemon), one run after the other, and reads each run's
summary. The figure that counts is the FINAL held-out success (the evaluation at
the last step), not the best one: a recipe that learns only on lucky seeds or on
an idle machine is not a result. ``--hog`` keeps one core busy with a spinning
process for the whole bench, as another job on the machine would.

    python -m rlfleet.tools.bench.learning --tasks arithmetic,frozenlake --seeds 5 \\
        --budget-s 600 --out runs/bench/learning [--hog]

Writes DIR/learning.json (one record per task and seed: task, seed, first, final,
best, gain_points, steps, wall_s, …; and a per-task summary) and DIR/learning.png
(held-out success against step, one line per seed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.spec_variants import apply_overrides, parse_override, write_variant
from rlfleet.tools.exit_codes import RUN_ENDED
from rlfleet.tools.run.report import read_metrics

TARGET_GAIN_POINTS = 25.0


def spec_for(examples: Path, task: str, seed: int, overrides: dict[str, Any] | None = None) -> Path:
    """The task's example spec with job.seed set (and a job name of its own), plus
    ``overrides`` ({"trainer.learning_rate": 1e-4}) for trying a change to a recipe."""
    def change(spec: dict[str, Any]) -> None:
        spec["job"]["seed"] = seed
        spec["job"]["name"] = f"{spec['job']['name']}-seed{seed}"
        apply_overrides(spec, overrides)
    return write_variant(examples / f"{task}.toml", f"seed{seed}", change)


def run_task(task: str, seed: int, budget_s: float, examples: Path,
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = spec_for(examples, task, seed, overrides)
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(budget_s)]
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    run_dir = next((line.split("run dir:", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    summary_path = Path(run_dir) / "summary.json" if run_dir else None
    if proc.returncode not in RUN_ENDED or summary_path is None or not summary_path.exists():
        raise SystemExit(f"{task} seed {seed}: rlfleet run failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    s = json.loads(summary_path.read_text())
    first, final, best = (s.get(k, float("nan")) for k in
                          ("eval_success_first", "eval_success_last", "eval_success_best"))
    cpu = s.get("cpu_s", {})
    total_cpu = sum(cpu.values()) or 1.0
    return {"task": task, "seed": seed, "first": first, "final": final, "best": best,
            "gain_points": round(100 * (final - first), 1),
            "best_gain_points": round(100 * (best - first), 1),
            "run_dir": run_dir, "run_wall_s": round(wall, 1),
            "load_1m_before": round(load_before, 2), "load_1m_after": round(os.getloadavg()[0], 2),
            **s, "cpu_share": {k: round(v / total_cpu, 3) for k, v in cpu.items()}}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task: the final figure's mean, spread and worst seed, and how many seeds met the target."""
    out: dict[str, Any] = {}
    for task in dict.fromkeys(r["task"] for r in records):
        rs = [r for r in records if r["task"] == task]
        finals, gains = [r["final"] for r in rs], [r["gain_points"] for r in rs]
        out[task] = {"seeds": len(rs),
                     "first_mean": round(statistics.fmean(r["first"] for r in rs), 3),
                     "final_mean": round(statistics.fmean(finals), 3),
                     "final_std": round(statistics.pstdev(finals), 3),
                     "final_min": min(finals), "final_max": max(finals),
                     "gain_mean_points": round(statistics.fmean(gains), 1), "gain_min_points": min(gains),
                     "seeds_meeting_target": sum(g >= TARGET_GAIN_POINTS for g in gains),
                     "wall_s_max": max(r["run_wall_s"] for r in rs)}
    return out


def plot(records: list[dict[str, Any]], path: Path, hog: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in records))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in records if r["task"] == task):
            m = read_metrics(Path(r["run_dir"]) / "metrics.jsonl")
            ax.plot([e["step"] for e in m.evals], [e["eval_success"] for e in m.evals], "-", lw=1.2,
                    label=f"seed {r['seed']}: {r['first']:.2f} → {r['final']:.2f}")
        ax.set_title(f"{task}: held-out success per seed" + (" (one core hogged)" if hog else ""))
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out success (greedy)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextmanager
def cpu_hog(on: bool) -> Iterator[None]:
    """A process spinning on core 0 for as long as the block runs (another job on the machine)."""
    if not on:
        yield
        return
    hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="arithmetic,frozenlake")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per task")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock cap per run")
    ap.add_argument("--hog", action="store_true", help="keep one core busy with a spinning process")
    ap.add_argument("--examples", type=Path, default=Path("examples"))
    ap.add_argument("--set", dest="overrides", type=parse_override, action="append", default=[],
                    metavar="KEY=VALUE", help="change the example specs, e.g. trainer.learning_rate=1e-4")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/learning"),
                    help="folder for learning.json and learning.png")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    with cpu_hog(args.hog):
        for task in (t.strip() for t in args.tasks.split(",")):
            for seed in seeds:
                r = run_task(task, seed, args.budget_s, args.examples, dict(args.overrides))
                records.append(r)
                print(f"{task:<11} seed {seed}: held-out {r['first']:.3f} -> {r['final']:.3f} final "
                      f"({r['gain_points']:+.1f} points; best {r['best']:.3f}), {r['steps']} steps in "
                      f"{r['run_wall_s']:.0f} s with start-up, load {r['load_1m_before']:.1f}, "
                      f"staleness {r.get('staleness')}   [{r['run_dir']}]", flush=True)
                # Written after every run, so a long bench cut short keeps what it measured.
                result = {"hog": args.hog, "budget_s": args.budget_s, "overrides": dict(args.overrides), "target_gain_points": TARGET_GAIN_POINTS,
                          "records": records, "summary": summarise(records)}
                (args.out / "learning.json").write_text(json.dumps(result, indent=2))
    for task, s in result["summary"].items():
        print(f"{task:<11} final {s['final_mean']:.3f} ± {s['final_std']:.3f} (min {s['final_min']:.3f}) "
              f"from {s['first_mean']:.3f}; gain ≥ {TARGET_GAIN_POINTS:.0f} points in "
              f"{s['seeds_meeting_target']}/{s['seeds']} seeds; slowest run {s['wall_s_max']:.0f} s")
    plot(records, args.out / "learning.png", args.hog)
    print(f"wrote {args.out / 'learning.json'} and {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
