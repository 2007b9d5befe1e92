"""Claim pacing on and off, side by side: wasted rollout work and time to learn.

Runs the same example with `env_host.pace_claims` true and false, alternating
(on, off, on, off, ...) so that a noisy shared machine hurts both alike, and
reads each run's accounting.json and summary.json: prompts claimed per prompt
trained, groups dropped for staleness, training wall time, trajectories/s,
time to an eval level, and CPU seconds per daemon.

    python -m rlfleet.tools.bench.pacing --spec examples/arithmetic.toml --pairs 2 --out runs/bench/pacing
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.trl_peer import time_to_level
from rlfleet.tools.exit_codes import RUN_ENDED
from rlfleet.tools.run.report import read_metrics


def spec_with(spec_path: Path, pace: bool) -> Path:
    """A copy of the spec beside it (relative paths keep working) with
    env_host.pace_claims set; the caller deletes it."""
    lines = [line for line in spec_path.read_text().splitlines()
             if not re.match(r"\s*pace_claims\s*=", line)]
    if "[env_host]" not in (line.strip() for line in lines):
        lines.append("[env_host]")
    at = next(i for i, line in enumerate(lines) if line.strip() == "[env_host]")
    lines.insert(at + 1, f"pace_claims = {'true' if pace else 'false'}")
    out = spec_path.with_name(f".{spec_path.stem}-pace-{'on' if pace else 'off'}.toml")
    out.write_text("\n".join(lines) + "\n")
    return out


def run_once(spec: Path, budget_s: float, level: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(budget_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    run_dir = next((line.split("run dir:", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    if proc.returncode not in RUN_ENDED or run_dir is None or not (Path(run_dir) / "summary.json").exists():
        raise SystemExit(f"{spec}: rlfleet run failed ({proc.returncode}):\n{proc.stdout[-2000:]}")
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    acc = json.loads((Path(run_dir) / "accounting.json").read_text())
    reached = time_to_level(read_metrics(Path(run_dir) / "metrics.jsonl"), level)
    return {"run_dir": run_dir, "steps": s["steps"], "wall_s": s["wall_s"],
            "trajectories_per_s": s.get("trajectories_per_s"), "claimed": acc["claimed"],
            "trained": acc["trained"], "dropped_staleness": acc["dropped"].get("staleness", 0),
            "claimed_per_trained": round(acc["claimed"] / max(1, acc["trained"]), 3),
            "time_to_level_s": reached and reached["time_s"], "eval_last": s.get("eval_success_last"),
            "cpu_s_total": round(sum(s.get("cpu_s", {}).values()), 1), "cpu_s": s.get("cpu_s", {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=Path("examples/arithmetic.toml"))
    ap.add_argument("--pairs", type=int, default=2, help="on/off pairs to run")
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--level", type=float, default=0.9, help="eval success to time")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/pacing"))
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for i in range(args.pairs):
        for pace in (True, False):
            spec = spec_with(args.spec, pace)
            try:
                r = run_once(spec, args.budget_s, args.level)
            finally:
                spec.unlink()
            runs["on" if pace else "off"].append(r)
            print(f"pair {i + 1} pacing {'on ' if pace else 'off'}: {r['steps']} steps in {r['wall_s']:.0f}s, "
                  f"claimed/trained {r['claimed_per_trained']:.2f} ({r['dropped_staleness']} groups "
                  f"dropped stale), {r['trajectories_per_s']} traj/s, to {args.level}: "
                  f"{r['time_to_level_s']} s, CPU {r['cpu_s_total']} s   [{r['run_dir']}]", flush=True)
    keys = ("wall_s", "claimed_per_trained", "dropped_staleness", "trajectories_per_s", "time_to_level_s",
            "cpu_s_total")
    def median(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rs if r[key] is not None]
        return round(statistics.median(values), 3) if values else None
    medians = {mode: {k: median(rs, k) for k in keys} for mode, rs in runs.items()}
    for mode, m in medians.items():
        print(f"median, pacing {mode:<3}: " + ", ".join(f"{k} {v}" for k, v in m.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pacing.json").write_text(json.dumps({"spec": str(args.spec), "level": args.level,
                                                      "runs": runs, "medians": medians}, indent=2))
    print(f"wrote {args.out / 'pacing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
