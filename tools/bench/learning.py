"""Learning benchmark: does the fleet make the tiny model better, and how fast?

Runs `rlfleet run examples/<task>.toml` for each task on this machine (private
etcd, every daemon), one after the other, then reads each run's summary: eval
success before (step 0), at the end and at best, wall-clock, trained tokens/s and
trajectories/s end to end, where the trainer's time went, and the CPU seconds of
every daemon. Writes the figures as JSON and one plot of eval success against
wall-clock for all tasks.

    python -m rlfleet.tools.bench.learning --tasks arithmetic,frozenlake --budget-s 600 --out runs/bench/learning
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.tools.exit_codes import RUN_ENDED
from rlfleet.tools.report import read_metrics


def run_task(task: str, budget_s: float, examples: Path) -> dict[str, Any]:
    spec = examples / f"{task}.toml"
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(budget_s)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    run_dir = next((line.split("run dir:", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    summary_path = Path(run_dir) / "summary.json" if run_dir else None
    if proc.returncode not in RUN_ENDED or summary_path is None or not summary_path.exists():
        raise SystemExit(f"{task}: rlfleet run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    s = json.loads(summary_path.read_text())
    cpu = s.get("cpu_s", {})
    total_cpu = sum(cpu.values()) or 1.0
    return {"task": task, "run_dir": run_dir, "run_wall_s": round(wall, 1), **s,
            "gain_points": round(100 * (s.get("eval_success_last", 0) - s.get("eval_success_first", 0)), 1),
            "best_gain_points": round(100 * (s.get("eval_success_best", 0) - s.get("eval_success_first", 0)), 1),
            "cpu_share": {k: round(v / total_cpu, 3) for k, v in cpu.items()}}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        m = read_metrics(Path(r["run_dir"]) / "metrics.jsonl")
        ax.plot([e["time"] - m.t0 for e in m.evals], [e["eval_success"] for e in m.evals], "o-",
                label=f"{r['task']} (held-out, greedy)")
    ax.set_xlabel("wall-clock since the first step (s)")
    ax.set_ylabel("eval success")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("rlfleet on 2 CPU cores: every daemon, the tiny model")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="arithmetic,frozenlake")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock cap per task")
    ap.add_argument("--examples", type=Path, default=Path("examples"))
    ap.add_argument("--out", type=Path, default=Path("runs/bench/learning"),
                    help="folder for learning.json and learning.png")
    args = ap.parse_args(argv)
    results = []
    for task in args.tasks.split(","):
        r = run_task(task.strip(), args.budget_s, args.examples)
        results.append(r)
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(r["cpu_share"].items())[:4])
        print(f"{r['task']:<11} eval {r.get('eval_success_first', float('nan')):.3f} -> "
              f"{r.get('eval_success_last', float('nan')):.3f} ({r['gain_points']:+.1f} points; best "
              f"{r.get('eval_success_best', float('nan')):.3f}) in {r['wall_s']:.0f}s of training "
              f"({r['run_wall_s']:.0f}s with start-up), {r['steps']} steps, "
              f"{r.get('trained_tokens_per_s', 0):.0f} trained tok/s, "
              f"{r.get('trajectories_per_s', 0):.2f} traj/s; trainer time {r.get('trainer_time_s')}; "
              f"CPU {top}   [{r['run_dir']}]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "learning.png")
    print(f"wrote {args.out / 'learning.json'} and {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
