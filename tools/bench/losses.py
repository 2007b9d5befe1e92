"""Loss benchmark: which policy loss holds up under staleness (docs/guide/losses.md)?

Runs `rlfleet run examples/<task>.toml` (the learning bench's run_task: private etcd,
every daemon, this machine) for every loss x task x seed, twice:

- default: the example as shipped (its max_staleness, pacing on);
- stress:  trainer.max_staleness = --stress-alpha (8) and the trainer slowed by
  RLFLEET_TRAINER_STEP_DELAY_S = --stress-delay-s after every step, so the rollouts run
  ahead and the staleness of what is trained really reaches α (the histogram says
  whether it did).

The figure reported is the FINAL held-out success (the evaluation at the last step),
per seed, with the first one and the staleness histogram of what was trained.

    python -m rlfleet.tools.bench.losses --losses ppo_clip,decoupled_ppo,tis,cispo,topr \\
        --tasks arithmetic,frozenlake --seeds 3 --budget-s 600 --out runs/bench/losses \\
        [--json OUT]

Writes DIR/losses.json ({"records": [...], "summary": {...}}; each record: loss, task,
seed, stress, first, final, best, steps, staleness {age: trajectories}, dropped, run_dir,
...), DIR/losses.png (final success per loss and task, default vs stress, one dot per
seed; the staleness histograms), and with --json OUT the list of records alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlfleet.common.failpoints import TRAINER_STEP_DELAY_S as STEP_DELAY_ENV
from rlfleet.tools.bench.learning import run_task

LOSSES = ("ppo_clip", "decoupled_ppo", "tis", "cispo", "topr")
# The trainer's wait after each step under stress: long enough that the rollouts run ahead and
# what is trained sits at α (arithmetic at 0.1 s: 98 % of trajectories at staleness 7–8), short
# enough that a run keeps its step count inside the budget.
STRESS_DELAY_S = {"arithmetic": 0.1, "frozenlake": 0.5}


def stress_delay(override: float | None, task: str) -> float:
    return override if override is not None else STRESS_DELAY_S.get(task, 0.5)


@contextmanager
def step_delay(seconds: float) -> Iterator[None]:
    """The trainer of every run started inside waits ``seconds`` after each step (the
    daemons inherit the environment of `rlfleet run`)."""
    before = os.environ.get(STEP_DELAY_ENV)
    if seconds:
        os.environ[STEP_DELAY_ENV] = repr(float(seconds))
    else:
        os.environ.pop(STEP_DELAY_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STEP_DELAY_ENV, None)
        else:
            os.environ[STEP_DELAY_ENV] = before


def shipped_alpha(examples: Path, task: str) -> int | None:
    """The example's own trainer.max_staleness (the default condition's bound)."""
    import tomllib

    return tomllib.loads((examples / f"{task}.toml").read_text()).get("trainer", {}).get("max_staleness")


def overrides_for(loss: str, stress: bool, alpha: int) -> dict[str, Any]:
    """The spec changes of one run: the loss table replaced whole (only its kind: every
    other key at the kind's default), and under stress the staleness bound."""
    out: dict[str, Any] = {"trainer.loss": {"kind": loss}}
    if stress:
        out["trainer.max_staleness"] = alpha
    return out


def record_of(loss: str, stress: bool, alpha: int | None, delay_s: float, run: dict[str, Any]) -> dict[str, Any]:
    staleness = {int(k): int(v) for k, v in (run.get("staleness") or {}).items()}
    return {"loss": loss, "task": run["task"], "seed": run["seed"], "stress": stress,
            "first": run["first"], "final": run["final"], "best": run["best"],
            "gain_points": run["gain_points"], "steps": run.get("steps", 0),
            "max_staleness": alpha, "step_delay_s": delay_s if stress else 0.0,
            "staleness": dict(sorted(staleness.items())),
            "staleness_max": max(staleness, default=0),
            "staleness_mean": (round(sum(k * v for k, v in staleness.items()) / sum(staleness.values()), 2)
                               if staleness else 0.0),
            "run_dir": run["run_dir"], "run_wall_s": run["run_wall_s"]}


def load_records(path: Path) -> list[dict[str, Any]]:
    records = json.loads(path.read_text())["records"]
    for r in records:  # JSON keeps the histogram's ages as strings
        r["staleness"] = {int(k): v for k, v in r["staleness"].items()}
    return records


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (loss, task, default|stress): final mean, spread and worst seed; the staleness reached."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["loss"], r["task"], r["stress"]) for r in records):
        rs = [r for r in records if (r["loss"], r["task"], r["stress"]) == key]
        finals = [r["final"] for r in rs if not math.isnan(r["final"])]
        ages: Counter[int] = Counter()
        for r in rs:
            ages.update(r["staleness"])
        out[f"{key[0]}/{key[1]}/{'stress' if key[2] else 'default'}"] = {
            "seeds": len(rs), "finals": [r["final"] for r in rs],
            "final_mean": round(statistics.fmean(finals), 3) if finals else math.nan,
            "final_std": round(statistics.pstdev(finals), 3) if finals else math.nan,
            "final_min": min(finals, default=math.nan),
            "first_mean": round(statistics.fmean(r["first"] for r in rs), 3),
            "staleness": dict(sorted(ages.items())), "staleness_max": max(ages, default=0)}
    return out


def markdown_table(records: list[dict[str, Any]]) -> str:
    """The table of docs/results/losses.md: per loss, each task x condition as mean ± std (min, seeds) of the
    final held-out success; a stress cell adds the mean and max staleness it trained at."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    losses = [x for x in LOSSES if any(r["loss"] == x for r in records)]
    cols = [(t, c) for t in tasks for c in (False, True)]
    head = ["loss"] + [f"{t}, {'α = 8, trainer slowed' if c else 'default'}" for t, c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = summarise(records)
    for loss in losses:
        cells = [f"`{loss}`"]
        for task, stress in cols:
            s = summary.get(f"{loss}/{task}/{'stress' if stress else 'default'}")
            if s is None:
                cells.append("not yet run")
                continue
            cell = f"{s['final_mean']:.3f} ± {s['final_std']:.3f} (min {s['final_min']:.3f}, n={s['seeds']}"
            if stress:
                ages, total = s["staleness"], sum(s["staleness"].values())
                mean = sum(k * v for k, v in ages.items()) / total if total else 0.0
                cell += f"; staleness mean {mean:.1f}, max {s['staleness_max']}"
            cells.append(cell + ")")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in records))
    losses = list(dict.fromkeys(r["loss"] for r in records))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        ax = axes[0][col]
        for stress, colour, shift in ((False, "tab:blue", -0.12), (True, "tab:red", 0.12)):
            for i, loss in enumerate(losses):
                finals = [r["final"] for r in records if (r["task"], r["loss"], r["stress"]) == (task, loss, stress)]
                ax.plot([i + shift] * len(finals), finals, "o", color=colour, alpha=0.7,
                        label=("stress (α high, trainer slowed)" if stress else "default") if i == 0 else None)
                if finals:
                    ax.plot([i + shift - 0.08, i + shift + 0.08], [statistics.fmean(finals)] * 2, "-", color=colour)
        ax.set_xticks(range(len(losses)), losses)
        ax.set_xlim(-0.5, len(losses) - 0.5)
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("final held-out success")
        ax.set_title(f"{task}: final held-out success per seed")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax = axes[1][col]
        for stress, colour in ((False, "tab:blue"), (True, "tab:red")):
            ages: Counter[int] = Counter()
            for r in records:
                if r["task"] == task and r["stress"] == stress:
                    ages.update(r["staleness"])
            total = sum(ages.values()) or 1
            xs = sorted(ages)
            ax.bar([x + (0.2 if stress else -0.2) for x in xs], [ages[x] / total for x in xs], width=0.4,
                   color=colour, label="stress" if stress else "default")
        ax.set_xlabel("staleness of trained trajectories (versions)")
        ax.set_ylabel("share of trajectories")
        ax.set_title(f"{task}: staleness histogram, all losses and seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--tasks", default="arithmetic,frozenlake")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per loss and task")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock cap per run")
    ap.add_argument("--conditions", default="default,stress", help="default, stress or both")
    ap.add_argument("--stress-alpha", type=int, default=8, help="trainer.max_staleness under stress")
    ap.add_argument("--stress-delay-s", type=float, default=None,
                    help=f"{STEP_DELAY_ENV} under stress: the trainer's wait after every step "
                         f"(default per task: {STRESS_DELAY_S})")
    ap.add_argument("--examples", type=Path, default=Path("examples"))
    ap.add_argument("--out", type=Path, default=Path("runs/bench/losses"),
                    help="folder for losses.json and losses.png")
    ap.add_argument("--json", type=Path, default=None, help="also write the records (a JSON list) here")
    ap.add_argument("--resume", action="store_true",
                    help="keep the records already in OUT/losses.json and run only the missing ones")
    ap.add_argument("--table", type=Path, default=None, metavar="LOSSES_JSON",
                    help="print the docs/results/losses.md table of a finished run's losses.json and exit")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(markdown_table(load_records(args.table)))
        return 0
    from rlfleet.common.spec.seams import POLICY_LOSSES

    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    unknown = sorted(set(losses) - set(POLICY_LOSSES.names()))
    if unknown:
        ap.error(f"unknown loss {', '.join(unknown)} (registered: {', '.join(POLICY_LOSSES.names())})")
    conditions = [c.strip() for c in args.conditions.split(",")]
    if not conditions or set(conditions) - {"default", "stress"}:
        ap.error(f"--conditions: default, stress or both, got {args.conditions!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    if args.resume and (args.out / "losses.json").exists():
        records = load_records(args.out / "losses.json")
        print(f"resuming: {len(records)} runs already in {args.out / 'losses.json'}", flush=True)
    done = {(r["loss"], r["task"], r["seed"], r["stress"]) for r in records}
    # Seed-major: a bench cut short still has every loss and condition at the seeds it reached.
    for task in (t.strip() for t in args.tasks.split(",")):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for stress in (c == "stress" for c in conditions):
                delay = stress_delay(args.stress_delay_s, task) if stress else 0.0
                for loss in losses:
                    if (loss, task, seed, stress) in done:
                        continue
                    with step_delay(delay):
                        run = run_task(task, seed, args.budget_s, args.examples,
                                       overrides_for(loss, stress, args.stress_alpha))
                    alpha = args.stress_alpha if stress else shipped_alpha(args.examples, task)
                    r = record_of(loss, stress, alpha, delay, run)
                    records.append(r)
                    print(f"{loss:<13} {task:<11} seed {seed} {'stress ' if stress else 'default'}: held-out "
                          f"{r['first']:.3f} -> {r['final']:.3f} final, {r['steps']} steps, staleness "
                          f"{r['staleness']}   [{r['run_dir']}]", flush=True)
                    # Written after every run, so a long bench cut short keeps what it measured.
                    delays = args.stress_delay_s if args.stress_delay_s is not None else STRESS_DELAY_S
                    result = {"budget_s": args.budget_s, "stress_alpha": args.stress_alpha,
                              "stress_delay_s": delays, "records": records, "summary": summarise(records)}
                    (args.out / "losses.json").write_text(json.dumps(result, indent=2))
                    if args.json is not None:
                        args.json.write_text(json.dumps(records, indent=2))
    for key, s in summarise(records).items():
        print(f"{key:<40} final {s['final_mean']:.3f} ± {s['final_std']:.3f} (min {s['final_min']:.3f}) "
              f"from {s['first_mean']:.3f}; staleness up to {s['staleness_max']}")
    plot(records, args.out / "losses.png")
    print(f"wrote {args.out / 'losses.json'} and {args.out / 'losses.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
