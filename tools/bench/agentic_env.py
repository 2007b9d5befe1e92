"""Benches ``env_async`` and ``redundant`` of tools/bench/agentic.py: environment-level
asynchrony (ROLL Flash §5.2.1, RollArt R2) and redundant environment rollouts (ROLL Flash
§5.2.2, RollArt §6.3), on the simulated fleet, each beside its baseline in the same daemons.

The workload (``examples/agentic-sim.toml``): multi-turn episodes whose environment steps
take N(mu, sigma) model seconds (time-scaled), short generations on sim rollouts, the sim
trainer. Both variants of a setting run the same spec but for the keys compared, one after
the other; the figure is trained trajectories/s over the steady window (the end of the
first training step to the last), from the run's metrics.jsonl.

- ``env_async``: ``[env_host] env_mode = "batch"`` (a barrier per turn over the prompts
  claimed together: the baseline) vs ``"async"``, at mu = 10 and sigma in {0, 2.5, 5, 10}.
- ``redundant``: batch mode with failures (``failure_rate``) and latency (mu 10, sigma 5),
  failures 2 % per step, no redundancy (``G x P``) vs more groups (``redundant_prompts``), bigger groups
  (``redundant_samples``) and both — ROLL Flash's grid shape (Fig. 10).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfleet.tools.bench.longtail import MAX_LAG, judge_final_lag, run_once
from rlfleet.tools.bench.longtail import measure as measure_run
from rlfleet.tools.bench.spec_variants import write_variant

BASE = Path(__file__).resolve().parents[2] / "examples" / "agentic-sim.toml"
SIGMAS = (0.0, 2.5, 5.0, 10.0)
MU = 10.0


def _run(name: str, change: Any, duration_s: float, workdir: Path) -> dict[str, Any]:
    spec = write_variant(BASE, name, change)
    run_dir, etcd, code = run_once(spec, duration_s)
    record = measure_run(run_dir, name, 0, etcd, code)
    judge_final_lag(record, run_dir)  # the run's final lag fraction, not its start-up burst
    print(f"   {name}: {record['trained_trajectories_per_s']} trajectories/s over {record['window_s']} s, "
          f"final lag {record['final_lag']} (max {record['max_lag']}), valid {record['valid']}", flush=True)
    return record


def _setter(**env: Any) -> Any:
    """A spec change: ``task.env`` keys as ``task_<key>``, the rest into ``[env_host]``."""
    def change(spec: dict[str, Any]) -> None:
        for key, value in env.items():
            if key.startswith("task_"):
                spec["task"]["env"][key.removeprefix("task_")] = value
            elif key == "job":
                spec["job"]["name"] = value
            else:
                spec["env_host"][key] = value
    return change


def _pair(bench: str, setting: dict[str, Any], base: dict[str, Any], variant: dict[str, Any],
          duration_s: float, workdir: Path, label: str) -> dict[str, Any]:
    b = _run(f"{bench}-{label}-baseline", _setter(job=f"{bench.replace('_', '-')}-base", **base), duration_s, workdir)
    v = _run(f"{bench}-{label}-variant", _setter(job=f"{bench.replace('_', '-')}-variant", **variant), duration_s, workdir)
    speedup = (v["trained_trajectories_per_s"] / b["trained_trajectories_per_s"]
               if b["trained_trajectories_per_s"] else 0.0)
    problems = [f"{which}: {r.get('invalid_because', '')}" for which, r in (("baseline", b), ("variant", v))
                if not r["valid"]]
    record = {"bench": bench, "setting": setting, "baseline": b["trained_trajectories_per_s"],
              "variant": v["trained_trajectories_per_s"], "unit": "trained trajectories/s",
              "speedup": round(speedup, 3), "valid": not problems,
              "final_lag": max(b["final_lag"], v["final_lag"]), "max_lag": max(b["max_lag"], v["max_lag"]),
              "lag_bound": MAX_LAG,
              "runs": {"baseline": b["run_dir"], "variant": v["run_dir"]},
              "accounting_ok": [b.get("accounting_ok"), v.get("accounting_ok")]}
    if problems:
        record["invalid_because"] = "; ".join(problems)
    return record


def measure(bench: str, workdir: Path, quick: bool) -> list[dict[str, Any]]:
    duration = 50.0 if quick else 75.0
    latency = {"task_step_latency_mean_s": MU}
    records = []
    if bench == "env_async":
        for sigma in ((MU,) if quick else SIGMAS):
            env = {**latency, "task_step_latency_std_s": sigma}
            records.append(_pair(bench, {"mu": MU, "sigma": sigma}, {**env, "env_mode": "batch"},
                                 {**env, "env_mode": "async"}, duration, workdir, f"s{sigma:g}"))
    elif bench == "redundant":
        env = {**latency, "task_step_latency_std_s": 5.0, "task_failure_rate": 0.02, "env_mode": "batch"}
        grid = [("more_groups", {"redundant_prompts": 4}), ("bigger_groups", {"redundant_samples": 4}),
                ("both", {"redundant_prompts": 4, "redundant_samples": 4})]
        for label, extra in (grid[2:] if quick else grid):
            setting = {"mu": MU, "sigma": 5.0, "failure_rate": 0.02, "prompts": 16 + extra.get("redundant_prompts", 0),
                       "group": 8 + extra.get("redundant_samples", 0), "needed": "16x8", "variant": label}
            records.append(_pair(bench, setting, env, {**env, **extra, "max_concurrent": 20 * 12},
                                 duration, workdir, label))
    else:
        raise ValueError(f"agentic_env serves env_async and redundant, not {bench!r}")
    return records


def plot(bench: str, records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [str(r["setting"].get("variant", f"σ={r['setting']['sigma']:g}")) for r in records]
    x = range(len(records))
    ax.bar([i - 0.2 for i in x], [r["baseline"] for r in records], 0.4, label="baseline")
    ax.bar([i + 0.2 for i in x], [r["variant"] for r in records], 0.4, label="variant")
    for i, r in enumerate(records):
        ax.annotate(f"{r['speedup']:.2f}x" + ("" if r["valid"] else " (invalid)"),
                    (i + 0.2, r["variant"]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("trained trajectories/s")
    ax.set_title({"env_async": f"env mode batch (baseline) vs async, μ={MU:g}",
                  "redundant": "no redundancy (baseline) vs redundant env rollouts"}.get(bench, bench))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
