"""Routing benches of tools/bench/agentic.py: prompt replication (ROLL Flash §5.1.2) and
hardware-affinity routing (RollArt §5.2, its experiment R1), each beside its baseline
on the simulated fleet, with the real daemons (`rlfleet run` on examples/longtail-sim.toml,
through tools/bench/longtail.py's run_once and measure).

``replication`` (docs/guide/agentic.md "Prompt replication"): sync mode, so a step's time is
the batch's generation; 64 prompts x 16 samples per step on 16 sim rollouts of 4 slots,
lengths long-tailed and correlated within a group (group_correlation 0.9: one problem's
answers are alike in length). Every trajectory of the batch is in flight at once in both.
  baseline  ``[env_host.routing] kind = "group_sticky"``: the group's 16 samples on one
            rollout (one G-sample request per prompt), which queues them in its engine;
  variant   ``kind = "least_loaded", queue = true``: each sample its own request on any
            rollout, held in the env-host until a slot frees (queue scheduling).
Figure: seconds per training step (the steady window), speedup = baseline / variant.

``affinity`` (docs/guide/agentic.md "Hardware-affinity routing"): two prompt kinds (the sim
task's ``kinds``), multi-turn prefill-heavy (4 turns, 3,000-character observations, 64
new tokens a turn) and single-turn decode-heavy (up to 4,096 new tokens), half each, on
three fleets of equal cost (RollArt Table 2: an H800 costs 2.85 H20s): 8 H800s (22.8),
23 H20s (23.0), and 6 H800s + 6 H20s (23.1) with ``kind = "affinity"`` sending
prefill-heavy to the H800s and decode-heavy to the H20s. Trajectory mode (async, no
repack), trained trajectories/s over the steady window; speedup = mixed over the better
of the two single-kind fleets. Runs alternate settings, so a busy machine hurts them alike;
a run whose simulated rollouts lagged their timing model by more than 5 % is invalid.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.longtail import judge_final_lag, run_once
from rlfleet.tools.bench.longtail import measure as measure_run
from rlfleet.tools.bench.spec_variants import to_toml

BASE_SPEC = Path("examples/longtail-sim.toml")

# -- replication ------------------------------------------------------------------------------
REPLICATION = {"prompts": 64, "samples": 16, "rollouts": 16, "slots": 4, "group_correlation": 0.9}


def replication_spec(base: Path, out: Path, routing: dict[str, Any], *, prompts: int, samples: int,
                     rollouts: int, slots: int, group_correlation: float, time_scale: float) -> Path:
    spec = tomllib.loads(base.read_text())
    spec["job"]["name"] = f"bench-replication-{routing['kind'].replace('_', '-')}"
    spec["task"]["group_size"] = samples
    spec["trainer"]["batch_size"] = prompts * samples
    spec["rollout"]["mode"] = "sync"
    engine = spec["rollout"]["engine"]
    engine.update(rollouts=rollouts, max_batch=slots, roofline_batch=slots, time_scale=time_scale)
    engine["lengths"]["group_correlation"] = group_correlation
    spec["trainer"]["backend"]["time_scale"] = time_scale
    spec["repack_manager"]["planner"] = {"kind": "none"}
    # The whole batch in flight in both: the routing alone decides where it waits.
    spec["env_host"]["max_concurrent"] = prompts * samples
    spec["env_host"]["routing"] = routing
    return _write(spec, base, out)


# -- affinity ---------------------------------------------------------------------------------
PREFER = {"prefill_heavy": "h800", "decode_heavy": "h20"}
KINDS = [{"tag": "prefill_heavy", "share": 1, "turns": 4, "observation_chars": 3000, "max_new_tokens": 64},
         {"tag": "decode_heavy", "share": 1, "turns": 1, "max_new_tokens": 4096}]
FLEETS = {  # name -> (pools, routing); equal cost in H20s (H800 2.85, H20 1.00)
    "h800_only": ([{"hardware": "h800", "profile": "h800-7b", "rollouts": 8}],
                  {"kind": "least_loaded", "queue": True}),
    "h20_only": ([{"hardware": "h20", "profile": "h20-7b", "rollouts": 23}],
                 {"kind": "least_loaded", "queue": True}),
    "mixed": ([{"hardware": "h800", "profile": "h800-7b", "rollouts": 6},
               {"hardware": "h20", "profile": "h20-7b", "rollouts": 6}],
              {"kind": "affinity", "prefer": PREFER, "queue": True}),
}
# Sequences a rollout decodes at once: at 64, 3 H20s decode the decode-heavy kind in ~0.5x
# the time of one H800 (the model's roofline: H20 ridge 37, H800 295), RollArt's measured
# 0.49-0.79x (its Fig. 4b); at <= 37 the model would favour the H20 far beyond that.
AFFINITY_SLOTS = 64


def affinity_spec(base: Path, out: Path, fleet: str, *, time_scale: float, batch: int) -> Path:
    pools, routing = FLEETS[fleet]
    spec = tomllib.loads(base.read_text())
    spec["job"]["name"] = f"bench-affinity-{fleet.replace('_', '-')}"
    spec["task"]["max_turns"] = 4
    spec["task"]["env"].update(kinds=KINDS, max_new_tokens=4096)
    spec["trainer"]["batch_size"] = batch
    spec["rollout"]["mode"] = "trajectory"
    engine = spec["rollout"]["engine"]
    for key in ("rollouts", "max_batch", "roofline_batch"):
        engine.pop(key, None)  # each pool's profile decides its roofline
    engine["time_scale"] = spec["trainer"]["backend"]["time_scale"] = time_scale
    engine["pools"] = [{**p, "max_batch": AFFINITY_SLOTS} for p in pools]
    engine["lengths"].update(median=1500, p99=4000)  # long chains of thought (capped per kind)
    spec["repack_manager"]["planner"] = {"kind": "none"}
    slots = sum(p["rollouts"] for p in pools) * AFFINITY_SLOTS
    spec["env_host"]["max_concurrent"] = int(1.25 * slots)
    spec["env_host"]["routing"] = routing
    return _write(spec, base, out)


def fleet_cost(fleet: str) -> float:
    from rlfleet.daemons.rollout.sim.timing import PROFILES

    return round(sum(PROFILES[p["profile"]].cost * p["rollouts"] for p in FLEETS[fleet][0]), 2)


# -- the driver's contract ---------------------------------------------------------------------
def _write(spec: dict[str, Any], base: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = base.resolve().with_name(f".{spec['job']['name']}.toml")  # beside the base: its relative paths hold
    path.write_text(to_toml(spec))
    return path


def _run(spec: Path, duration_s: float, label: str) -> dict[str, Any]:
    try:
        run_dir, etcd, code = run_once(spec, duration_s)
    finally:
        spec.unlink(missing_ok=True)
    r = measure_run(run_dir, label, 0, etcd, code)
    judge_final_lag(r, run_dir)
    print(f"  {label:<14} {r.get('trained_trajectories_per_s')} traj/s  steps {r['steps']}  "
          f"lag {r['final_lag']:.4f} (max {r['max_lag']:.3f}){'' if r['valid'] else '  INVALID: ' + r.get('invalid_because', '')}  "
          f"({run_dir})", flush=True)
    return r


def measure(bench: str, workdir: Path, quick: bool) -> list[dict[str, Any]]:
    if bench == "replication":
        return measure_replication(workdir, quick)
    if bench == "affinity":
        return measure_affinity(workdir, quick)
    raise ValueError(f"agentic_routing has no bench {bench!r}")


def measure_replication(workdir: Path, quick: bool, base: Path = BASE_SPEC) -> list[dict[str, Any]]:
    """One record per fleet size (16 rollouts: 4 prompts each; 32: 2 prompts each)."""
    time_scale, duration = 0.1, 150.0
    sizes = (16,) if quick else (16, 32)
    routings = {"group_sticky": {"kind": "group_sticky"},
                "replication": {"kind": "least_loaded", "queue": True}}
    records = []
    for rollouts in sizes:
        setting = {**REPLICATION, "rollouts": rollouts}
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in routings}
        for label, routing in routings.items():  # alternating: baseline, variant
            spec = replication_spec(base, workdir, routing, time_scale=time_scale, **setting)
            runs[label].append(_run(spec, duration, label))
        records.append(_record("replication", setting, runs["group_sticky"], runs["replication"],
                               step_time=True))
    return records


def measure_affinity(workdir: Path, quick: bool, base: Path = BASE_SPEC) -> list[dict[str, Any]]:
    time_scale, duration, rounds = (0.1, 150.0, 1) if quick else (0.1, 240.0, 2)
    batch = 256
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FLEETS}
    for _ in range(rounds):
        for name in FLEETS:
            runs[name].append(_run(affinity_spec(base, workdir, name, time_scale=time_scale, batch=batch),
                                   duration, name))
    singles = {name: _mean(runs[name]) for name in ("h800_only", "h20_only")}
    best = max(singles, key=lambda n: singles[n] or 0.0)
    record = _record("affinity", {"fleet_cost_h20": fleet_cost("mixed"), "prefer": "prefill_heavy->h800, "
                                  "decode_heavy->h20", "baseline": best}, runs[best], runs["mixed"],
                     step_time=False)
    record["fleets"] = {name: {"trained_trajectories_per_s": _mean(rs), "cost_h20": fleet_cost(name),
                               "runs": [_brief(r) for r in rs]} for name, rs in runs.items()}
    return [record]


def _mean(records: list[dict[str, Any]]) -> float | None:
    xs = [r["trained_trajectories_per_s"] for r in records if r.get("trained_trajectories_per_s")]
    return round(sum(xs) / len(xs), 3) if xs else None


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("run_dir", "steps", "window_s", "trained_trajectories_per_s",
                                  "generated_tokens_per_s", "rollout_idle_fraction", "max_lag", "final_lag", "valid",
                                  "invalid_because")}


def _record(bench: str, setting: dict[str, Any], baseline: list[dict[str, Any]],
            variant: list[dict[str, Any]], *, step_time: bool) -> dict[str, Any]:
    """Trained trajectories/s of each side (mean of its runs); as seconds per step when
    ``step_time`` (the batch over the rate: sync mode's step)."""
    b, v = _mean(baseline), _mean(variant)
    problems = [f"{r['mode']}: {r.get('invalid_because')}" for r in baseline + variant if not r["valid"]]
    if not b or not v:
        problems.append("no steady window")
    batch = setting.get("prompts", 0) * setting.get("samples", 0)
    if step_time and b and v:
        baseline_fig, variant_fig, unit, speedup = round(batch / b, 2), round(batch / v, 2), "s/step", b and v / b
    else:
        baseline_fig, variant_fig, unit, speedup = b or 0.0, v or 0.0, "trained traj/s", (v / b if b and v else 0.0)
    record = {"bench": bench, "setting": setting, "baseline": baseline_fig, "variant": variant_fig,
              "unit": unit, "speedup": round(speedup or 0.0, 3), "valid": not problems,
              "baseline_runs": [_brief(r) for r in baseline], "variant_runs": [_brief(r) for r in variant]}
    if problems:
        record["invalid_because"] = "; ".join(problems)
    return record


def plot(bench: str, records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for r in records:
        if bench == "affinity" and "fleets" in r:
            names = list(r["fleets"])
            values = [r["fleets"][n]["trained_trajectories_per_s"] or 0 for n in names]
            ax.bar(names, values, color=["#888", "#aaa", "#2a7"][:len(names)])
            ax.set(ylabel="trained trajectories / s", title=f"hardware affinity: {r['speedup']:.2f}x "
                   f"over {r['setting']['baseline']} (equal cost)")
        else:
            ax.bar(["one rollout per prompt", "replication"], [r["baseline"], r["variant"]],
                   color=["#888", "#2a7"])
            ax.set(ylabel=r["unit"], title=f"prompt replication: {r['speedup']:.2f}x "
                   f"({r['setting'].get('prompts')}x{r['setting'].get('samples')})")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
