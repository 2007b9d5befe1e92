"""Learning benchmark: does the fleet make the tiny model better, and how fast?

Runs `rlfleet run examples/<task>.toml` for each task on this machine (private
etcd, every daemon), then reads the run's metrics: eval success before (step 0)
and after, wall-clock, trained tokens/s and trajectories/s.

    python -m rlfleet.tools.bench.learning --tasks arithmetic,frozenlake --budget-s 600 --json runs/bench/learning.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.tools.report import read_metrics, summary


def run_task(task: str, budget_s: float, examples: Path) -> dict:
    spec = examples / f"{task}.toml"
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(budget_s)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - started
    run_dir = next((line.split("run dir:", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    if proc.returncode != 0 or run_dir is None:
        raise SystemExit(f"{task}: rlfleet run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    m = read_metrics(Path(run_dir) / "metrics.jsonl")
    s = summary(m)
    train_wall = s.get("wall_s") or wall
    tokens = sum(r.get("tokens", 0) for r in m.train)
    trajectories = sum(r.get("trajectories", 0) for r in m.train)
    return {"task": task, "run_dir": run_dir, "wall_s": round(wall, 1), **s,
            "gain_points": round(100 * (s.get("eval_success_last", 0) - s.get("eval_success_first", 0)), 1),
            "trained_tokens_per_s": round(tokens / train_wall, 1) if train_wall else 0.0,
            "trajectories_per_s": round(trajectories / train_wall, 3) if train_wall else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="arithmetic,frozenlake")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock cap per task")
    ap.add_argument("--examples", type=Path, default=Path("examples"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = []
    for task in args.tasks.split(","):
        r = run_task(task.strip(), args.budget_s, args.examples)
        results.append(r)
        print(f"{r['task']:<11} eval {r.get('eval_success_first', float('nan')):.3f} -> "
              f"{r.get('eval_success_last', float('nan')):.3f} ({r['gain_points']:+.1f} points) in {r['wall_s']:.0f}s, "
              f"{r['steps']} steps, {r['trained_tokens_per_s']:.0f} trained tok/s, "
              f"{r['trajectories_per_s']:.2f} traj/s   [{r['run_dir']}]", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
