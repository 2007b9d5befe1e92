"""Queue scheduling with dynamic filtering against filter-after-batch (ROLL Flash §5.1.1),
bench ``queue_filter`` of tools/bench/agentic.py:

    python -m rlfleet.tools.bench.agentic --benches queue_filter --json runs/bench/agentic.json \\
        --plot-dir docs/img [--quick]

Both variants run the real daemons (`rlfleet run`) on examples/longtail-sim.toml
(tools/bench/longtail.py: sim rollouts with a long tail of output lengths, the sim trainer,
the real env-host, reward-host, relay chain and etcd) in the ``trajectory`` mode, with the
sim task's ``zero_variance_share`` of prompts whose groups carry no signal (one reward for
all samples, as many DAPO-math groups are for a base model), and only the filtering
schedule changed (docs/guide/agentic.md, "Queue scheduling and dynamic filtering"):

- baseline ``after_batch``: rounds of one batch of prompts, each generated to completion,
  then filtered; a short batch waits for another round;
- variant ``queue``: a group without signal is dropped once complete and a new prompt
  claimed at once, at most ``max_extra_prompts`` (16, the paper's) beyond the batch.

The unit is ROLL Flash's: seconds per training step, over the steps after the first.
Settings: the paper's 8 prompts x 8 samples, and 32 x 8; the runs of a setting alternate
(baseline, variant), so a busy machine hurts both alike, and the simulated rollouts' own
lag says when it hurt too much (``valid``, longtail.MAX_LAG).
"""

from __future__ import annotations

import shutil
import time
import tomllib
from pathlib import Path
from typing import Any

from rlfleet.tools.bench import longtail
from rlfleet.tools.bench.spec_variants import to_toml

BASE = Path("examples/longtail-sim.toml")
GROUP = 8
ROLLOUTS = 32            # simulated rollouts x 8 slots: the same fleet for every setting
EXTRA_PROMPTS = 16       # ROLL Flash's max_additional_running_prompts
ZERO_VARIANCE = 0.5      # share of prompts whose groups carry no signal
TIME_SCALE = 0.55        # longtail-sim's clock
TARGET = 3.0             # issue 15: queue >= 3x after_batch in time per step
VARIANTS = ("after_batch", "queue")


def spec_for(workdir: Path, schedule: str, prompts: int) -> Path:
    """longtail-sim in the trajectory mode with ``prompts`` x 8 per step and the filtering
    ``schedule``; written beside the example (its relative model path holds)."""
    path = longtail.spec_for(BASE, "trajectory", ROLLOUTS, 1, None, time_scale=TIME_SCALE,
                             batch=prompts * GROUP)
    spec = tomllib.loads(path.read_text())
    path.unlink()
    spec["job"]["name"] = f"filter-{schedule.replace('_', '-')}-{prompts}"
    spec["job"]["runs_dir"] = str(workdir.resolve() / "runs")
    spec["task"]["group_size"] = GROUP
    spec["task"]["env"]["zero_variance_share"] = ZERO_VARIANCE
    trainer = spec["trainer"]
    trainer["no_signal_drops_per_batch"] = 8.0  # the budget never ends filtering within a step
    trainer["filter_schedule"] = schedule
    trainer.pop("max_staleness", None)
    if schedule == "queue":
        trainer["max_extra_prompts"] = EXTRA_PROMPTS
    env = spec["env_host"]
    env["pace_claims"] = True  # the pacer enforces max_extra_prompts, and the rounds
    # Room for twice what the pacer allows: the runner claims once half its room is free, so
    # the pacer, not the runner's room, decides when a prompt is claimed.
    env["max_concurrent"] = 2 * (prompts + EXTRA_PROMPTS) * GROUP
    out = BASE.with_name(f".{BASE.stem}-filter-{schedule}-{prompts}.toml")
    out.write_text(f"# {BASE.name}, filtering {schedule}, written by tools/bench/agentic_filter.py\n"
                   + to_toml(spec))
    return out


def step_times(run_dir: Path) -> dict[str, Any]:
    """Seconds per step over the steps after the first (its wait includes the start-up),
    and the groups dropped without signal per step."""
    steps = [m for m in longtail._jsonl(run_dir / "metrics.jsonl") if "step" in m and "trajectories" in m]
    out: dict[str, Any] = {"steps": len(steps), "s_per_step": None, "no_signal_per_step": None}
    if len(steps) >= 3:
        out["s_per_step"] = round((steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1), 3)
        dropped = [(m.get("dropped") or {}).get("no_signal", 0) for m in steps]
        out["no_signal_per_step"] = round((dropped[-1] - dropped[0]) / (len(steps) - 1), 2)
    return out


def run(workdir: Path, schedule: str, prompts: int, duration_s: float) -> dict[str, Any]:
    """One `rlfleet run` of the variant; longtail's figures (lag, validity) plus s/step."""
    spec = spec_for(workdir, schedule, prompts)
    started = time.monotonic()
    try:
        run_dir, etcd, code = longtail.run_once(spec, duration_s)
    finally:
        spec.unlink(missing_ok=True)
    r = longtail.measure(run_dir, schedule, ROLLOUTS, etcd, code)
    longtail.judge_final_lag(r, run_dir)  # the run's final lag fraction, as the other agentic benches
    r.update(step_times(run_dir))
    if r["s_per_step"] is None and r["valid"]:
        r["valid"], r["invalid_because"] = False, "fewer than 3 steps"
    if r.get("accounting_ok") is False:
        r["valid"] = False
        r["invalid_because"] = "; ".join(filter(None, [r.get("invalid_because"), "accounting failed"]))
    print(f"  {prompts}x{GROUP} {schedule:<11} {r['s_per_step']} s/step  steps {r['steps']}  "
          f"no_signal/step {r['no_signal_per_step']}  lag {r['final_lag']:.4f} (max {r['max_lag']:.3f})  "
          f"{'' if r['valid'] else 'INVALID ' + r.get('invalid_because', '')}"
          f"({time.monotonic() - started:.0f} s, {run_dir})", flush=True)
    return r


def measure(bench: str, workdir: Path, quick: bool) -> list[dict[str, Any]]:
    settings = [8] if quick else [8, 32]
    # after_batch waits for about two rounds of the long tail per step (~30 s at 8 x 8), the
    # queue for a few seconds: each runs long enough for >= 3 steps in a smoke test, and
    # for ~7 (after_batch) and ~20 (queue) in the full one.
    duration_s = {"after_batch": 100.0, "queue": 50.0} if quick else {"after_batch": 240.0, "queue": 120.0}
    workdir.mkdir(parents=True, exist_ok=True)
    records = []
    for prompts in settings:
        got = {schedule: run(workdir, schedule, prompts, duration_s[schedule]) for schedule in VARIANTS}
        base, var = got["after_batch"], got["queue"]
        ok = base["valid"] and var["valid"]
        speedup = (base["s_per_step"] / var["s_per_step"]) if base["s_per_step"] and var["s_per_step"] else 0.0
        record = {
            "bench": bench, "setting": {"prompts": prompts, "samples": GROUP, "extra_prompts": EXTRA_PROMPTS,
                                        "zero_variance_share": ZERO_VARIANCE, "rollouts": ROLLOUTS},
            "baseline": base["s_per_step"] or 0.0, "variant": var["s_per_step"] or 0.0,
            "unit": "s/step", "speedup": round(speedup, 2), "target": TARGET, "valid": ok,
            "runs": {s: {k: got[s].get(k) for k in ("run_dir", "steps", "s_per_step", "no_signal_per_step",
                                                     "max_lag", "final_lag", "accounting_ok", "restarts", "valid",
                                                     "invalid_because")} for s in VARIANTS},
        }
        if not ok:
            record["invalid_because"] = "; ".join(f"{s}: {got[s]['invalid_because']}"
                                                  for s in VARIANTS if not got[s]["valid"])
        records.append(record)
    if quick:  # a smoke test's run folders are of no further use
        shutil.rmtree(workdir / "runs", ignore_errors=True)
    return records


def plot(bench: str, records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(records))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r["baseline"] for r in records], width, label="filter after batch")
    ax.bar([x + width / 2 for x in xs], [r["variant"] for r in records], width,
           label=f"queue + filtering (+{EXTRA_PROMPTS} prompts)")
    for x, r in zip(xs, records):
        ax.annotate(f"{r['speedup']:.1f}x" + ("" if r["valid"] else " (invalid)"),
                    (x, max(r["baseline"], r["variant"])), ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{r['setting']['prompts']}x{r['setting']['samples']}" for r in records])
    ax.set(xlabel="prompts x samples per step", ylabel="seconds per step",
           title=f"dynamic filtering, {int(ZERO_VARIANCE * 100)}% groups without signal (sim fleet)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
