"""The long tail at scale: rollout coordination modes side by side on the simulated fleet.

    python -m rlfleet.tools.bench.longtail --rollouts 16,64 \\
        --modes sync,one_step_off,partial,trajectory,trajectory_repack \\
        --json runs/bench/longtail.json --plot runs/bench/longtail.png

For every (rollouts, mode) it runs the real daemons (`rlfleet run`) on
examples/longtail-sim.toml — sim rollout engines (one process hosting all the
simulated rollouts), the sim trainer backend, the real relay chain, env-host,
reward-host, repack-manager and etcd — with only these changed: ``[rollout] mode``,
the repack planner (``laminar`` for trajectory_repack, else ``none``), the number of
simulated rollouts, and the batch (``--prompts-per-rollout`` prompts per rollout and
step, so every mode gets one full wave of work per step). Runs alternate modes in
order, so a busy machine hurts them alike; the simulated rollouts' own lag says when
it did (``valid``).

Figures over the steady window, from the end of the first training step to the last:
trained trajectories/s (metrics.jsonl), generated tokens/s, rollout idle fraction and
mean KV utilisation (the sim rollouts' time series in sim/*.jsonl), the staleness
histogram, mixed-version trajectories, repack events and overheads, etcd writes/s
(raft proposals, scraped from the run's etcd) and CPU seconds per daemon.

``--runs N`` repeats the whole sweep N times (default 3), the settings taking turns
within each repetition; the record keeps every run. A ratio between two modes is taken
within one repetition (side by side, minutes apart), and the record gives each
repetition's ratio and their median; ``summary`` gives each setting's median and range
over its valid runs. The validity rule, fixed before measuring: a run counts when its
simulated rollouts lagged their timing model by at most 5% (``MAX_LAG``) over the run
(each rollout's lag fraction at the end, ``judge_final_lag``, as the agentic benches judge),
it made at least three training steps and no daemon restarted; a run that did not is kept,
void, with its reason. The series' largest sample stays in the record (``max_lag``): it
judged these runs until a first sweep at ``--duration-s 100`` (longtail-100s.json) voided
64-rollout one_step_off and partial on a start-up sample (lag 0.32 and 0.41 four seconds in,
when 512 requests arrive at once and a few late results weigh against a handful delivered;
0.001 and 0.004 at the end).

``--rollouts 1000 --modes trajectory_repack --slots 2 --time-scale 10 --duration-s 240`` is the
control-plane check (etcd writes/s, CPU per daemon, repack plan time at 1,000 rollouts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.etcd_requests import run_dir_of, run_scraped
from rlfleet.tools.bench.output import finish, median_range, provenance, write_json
from rlfleet.tools.bench.spec_variants import to_toml

MODES = ("sync", "one_step_off", "partial", "trajectory", "trajectory_repack")
MAX_LAG = 0.05  # a run whose sim engines ran this far behind their timing model is invalid


# -- the spec of one run ---------------------------------------------------------------------
def spec_for(base: Path, mode: str, rollouts: int, prompts_per_rollout: int,
             slots: int | None, inflight: float = 1.25, time_scale: float | None = None,
             batch: int | None = None) -> Path:
    """A copy of the base spec beside it, with the mode, planner, fleet size and batch set."""
    spec = tomllib.loads(base.read_text())
    spec["rollout"]["mode"] = "trajectory" if mode == "trajectory_repack" else mode
    engine = spec["rollout"]["engine"]
    engine["rollouts"] = rollouts
    if slots is not None:
        engine["max_batch"] = engine["roofline_batch"] = slots
    group = spec["task"]["group_size"]
    spec["trainer"]["batch_size"] = batch or rollouts * prompts_per_rollout * group
    if time_scale is not None:  # one clock for the whole simulated job
        engine["time_scale"] = spec["trainer"]["backend"]["time_scale"] = time_scale
        planner_s = spec.get("repack_manager", {}).get("planner", {}).get("interval_s")
        if planner_s is not None:
            spec["repack_manager"]["planner"]["interval_s"] = round(5.0 * time_scale, 3)
    # In flight: every slot of the fleet busy, plus a queue (--inflight x the fleet's slots).
    slots_each = engine.get("max_batch", 8)
    spec["env_host"]["max_concurrent"] = max(group, int(inflight * rollouts * slots_each))
    planner = spec.setdefault("repack_manager", {}).setdefault("planner", {})
    if mode == "trajectory_repack":
        planner["kind"] = "laminar"
    else:
        planner.clear()
        planner["kind"] = "none"
    spec["job"]["name"] = f"longtail-{mode.replace('_', '-')}-{rollouts}"
    out = base.with_name(f".{base.stem}-{mode}-{rollouts}.toml")
    out.write_text(to_toml(spec))
    return out


# -- one run ---------------------------------------------------------------------------------
def run_once(spec: Path, duration_s: float) -> tuple[Path, dict[str, Any], int]:
    """Run the job for duration_s; (run dir, etcd figures, exit code)."""
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
           "--duration", str(duration_s)]
    code, lines, etcd = run_scraped(cmd)
    run_dir = run_dir_of(lines)
    if run_dir is None:
        raise SystemExit(f"{spec}: rlfleet run printed no run dir (exit {code}):\n{''.join(lines[-40:])}")
    etcd = etcd or {}
    if etcd:
        etcd["writes_per_s"] = round(etcd["raft_proposals"] / max(etcd["seconds"], 1e-9), 1)
    # From the run's end summary: a restarted daemon voids a figure.
    etcd["restarts"] = next((line.strip().removeprefix("restarts").strip() for line in lines
                             if line.strip().startswith("restarts ")), "unknown")
    return run_dir, etcd, code


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by the stop
    return out


def _at(series: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The series' line nearest to unix time t."""
    return min(series, key=lambda line: abs(line["time"] - t)) if series else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def measure(run_dir: Path, mode: str, rollouts: int, etcd: dict[str, Any], code: int) -> dict[str, Any]:
    steps = [m for m in _jsonl(run_dir / "metrics.jsonl") if "step" in m and "trajectories" in m]
    record: dict[str, Any] = {"mode": mode, "rollouts": rollouts, "run_dir": str(run_dir), "exit": code,
                              "steps": len(steps)}
    window = steps[1:]
    if len(window) >= 2:
        t0, t1 = steps[0]["time"], steps[-1]["time"]
        record["window_s"] = round(t1 - t0, 2)
        record["trained_trajectories_per_s"] = round(sum(m["trajectories"] for m in window) / (t1 - t0), 2)
    else:  # fewer than three steps: no steady window; the figure would be a guess
        t0, t1 = (steps[0]["time"] if steps else 0.0), (steps[-1]["time"] if steps else 0.0)
        record["window_s"] = 0.0
        record["trained_trajectories_per_s"] = 0.0
    hist: dict[str, int] = {}
    overheads: list[float] = []
    mixed = continued = 0
    for m in steps:
        for k, v in m.get("staleness", {}).items():
            hist[k] = hist.get(k, 0) + v
        overheads += m.get("repack_overhead_s", [])
        mixed += m.get("mixed_version", 0)
        continued += m.get("continuations", 0)
    record["staleness_hist"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    total = sum(hist.values())
    record["staleness_le3_share"] = round(sum(v for k, v in hist.items() if int(k) <= 3) / total, 4) if total else None
    record["mixed_version_trajectories"] = mixed
    record["continuations"] = continued
    series: list[dict[str, Any]] = []
    lags: list[float] = []
    for path in sorted((run_dir / "sim").glob("*.jsonl")):
        series += _jsonl(path)
    for path in sorted((run_dir / "sim").glob("*.json")):
        try:
            lags += [r["lag"] for r in json.loads(path.read_text())["rollouts"].values()]
        except (OSError, ValueError, KeyError):
            pass
    a, b = _at(series, t0), _at(series, t1)
    if a is not None and b is not None and b["elapsed_s"] > a["elapsed_s"]:
        dt = b["elapsed_s"] - a["elapsed_s"]
        n = max(1, b["rollouts"])
        record["generated_tokens_per_s"] = round((b["generated_tokens"] - a["generated_tokens"]) / dt, 1)
        record["rollout_idle_fraction"] = round((b["idle_s"] - a["idle_s"]) / (dt * n), 4)
        record["kv_utilization_mean"] = round((b["kv_util_s"] - a["kv_util_s"]) / (dt * n), 4)
    else:
        record.update(generated_tokens_per_s=None, rollout_idle_fraction=None, kv_utilization_mean=None)
    plans = [p for p in _jsonl(run_dir / "repack_plans.jsonl") if p.get("moves")]
    record["repack_events"] = sum(len(p["moves"]) for p in plans)
    record["repack_plans"] = len(plans)
    record["repack_plan_ms_p50"] = _pct([p.get("plan_ms", 0.0) for p in plans], 0.5)
    record["repack_plan_ms_max"] = max((p.get("plan_ms", 0.0) for p in plans), default=None)
    record["repack_overhead_s_p50"] = _pct(overheads, 0.5)
    record["repack_overhead_s_p99"] = _pct(overheads, 0.99)
    record["max_lag"] = round(max(lags + [s.get("max_lag", 0.0) for s in series], default=0.0), 5)
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        record["cpu_s"] = s.get("cpu_s")
        record["accounting_ok"] = s.get("accounting_ok", s.get("accounting", {}).get("ok")
                                        if isinstance(s.get("accounting"), dict) else None)
    record["etcd"] = etcd
    record["etcd_writes_per_s"] = etcd.get("writes_per_s")
    record["restarts"] = etcd.pop("restarts", "unknown")
    problems = ([f"sim lag {record['max_lag']:.3f} > {MAX_LAG}"] if record["max_lag"] > MAX_LAG else []) + (
        ["fewer than 3 training steps"] if len(window) < 2 else []) + (
        [f"daemons restarted: {record['restarts']}"] if record["restarts"] != "none" else [])
    record["valid"] = not problems
    if problems:
        record["invalid_because"] = "; ".join(problems)
    return record


def judge_final_lag(r: dict[str, Any], run_dir: Path) -> None:
    """The lag rule of this bench (``main``) and of the agentic ones: ``measure`` voids a run whose lag went above 5 % at any sample, the start-up
    included (a whole batch added at once: a few early results late against a handful
    delivered). Here the run's lag is each simulated rollout's own lag fraction at the end
    (all lateness over all modelled latency, docs/design/sim.md), the largest of them; the
    series' maximum stays in the record (max_lag)."""
    final = []
    for path in sorted((run_dir / "sim").glob("*.json")):
        try:
            final += [x["lag"] for x in json.loads(path.read_text())["rollouts"].values()]
        except (OSError, ValueError, KeyError):
            pass
    r["final_lag"] = round(max(final, default=0.0), 5)
    problems = [p for p in r.get("invalid_because", "").split("; ") if p and not p.startswith("sim lag")]
    if r["final_lag"] > MAX_LAG:
        problems.append(f"sim lag {r['final_lag']:.3f} > {MAX_LAG}")
    r["valid"] = not problems
    r.pop("invalid_because", None)
    if problems:
        r["invalid_because"] = "; ".join(problems)


# -- the table and the plot ----------------------------------------------------------------------
def table(records: list[dict[str, Any]]) -> str:
    head = ("run", "rollouts", "mode", "traj/s", "tok/s", "idle", "KV util", "stale<=3", "mixed", "repacks",
            "overhead p50/p99 s", "lag (max)", "valid")
    rows = [head]
    for r in records:
        rows.append((str(r.get("run", 0)), str(r["rollouts"]), r["mode"], f"{r['trained_trajectories_per_s']:.1f}",
                     f"{r['generated_tokens_per_s'] or 0:.0f}", f"{r['rollout_idle_fraction'] or 0:.2f}",
                     f"{r['kv_utilization_mean'] or 0:.2f}",
                     "-" if r["staleness_le3_share"] is None else f"{r['staleness_le3_share']:.2f}",
                     str(r["mixed_version_trajectories"]), str(r["repack_events"]),
                     f"{r['repack_overhead_s_p50']}/{r['repack_overhead_s_p99']}",
                     f"{r['final_lag']:.3f} ({r['max_lag']:.3f})",
                     "yes" if r["valid"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def ratios(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """trajectory_repack's trained trajectories/s over each other mode, per fleet size, from
    the valid runs of one repetition (``records`` of one run number)."""
    out: dict[str, dict[str, float | None]] = {}
    for n in sorted({r["rollouts"] for r in records}):
        by_mode = {r["mode"]: r for r in records if r["rollouts"] == n and r["valid"]}
        best = by_mode.get("trajectory_repack")
        if best is None:
            continue
        out[str(n)] = {}
        for mode, r in by_mode.items():
            if mode != "trajectory_repack" and r["trained_trajectories_per_s"]:
                out[str(n)][f"over_{mode}"] = round(best["trained_trajectories_per_s"]
                                                    / r["trained_trajectories_per_s"], 2)
        plain = by_mode.get("trajectory")
        if plain and plain.get("generated_tokens_per_s") and best.get("generated_tokens_per_s"):
            out[str(n)]["tokens_over_trajectory"] = round(best["generated_tokens_per_s"]
                                                          / plain["generated_tokens_per_s"], 3)
    return out


def ratios_by_run(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each repetition's ratios (``by_run``, keyed by run number) and, per fleet size and
    ratio, the median over the repetitions that have it (``median``)."""
    by_run = {str(i): ratios([r for r in records if r.get("run", 0) == i])
              for i in sorted({r.get("run", 0) for r in records})}
    collected: dict[str, dict[str, list[float]]] = {}
    for per_size in by_run.values():
        for n, named in per_size.items():
            for name, value in named.items():
                if value is not None:
                    collected.setdefault(n, {}).setdefault(name, []).append(value)
    return {"by_run": by_run, "median": {n: {name: round(statistics.median(v), 3) for name, v in named.items()}
                                         for n, named in collected.items()}}


SUMMARIZED = ("trained_trajectories_per_s", "generated_tokens_per_s", "rollout_idle_fraction",
              "staleness_le3_share", "mixed_version_trajectories", "repack_events",
              "repack_overhead_s_p50", "repack_overhead_s_p99", "etcd_writes_per_s", "repack_plan_ms_p50")


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rollouts, mode): how many runs, how many void, and for each figure of SUMMARIZED
    the median, min and max over the valid runs (None where no valid run has it)."""
    out = []
    for n, mode in sorted({(r["rollouts"], r["mode"]) for r in records},
                          key=lambda k: (k[0], MODES.index(k[1]) if k[1] in MODES else len(MODES))):
        runs = [r for r in records if r["rollouts"] == n and r["mode"] == mode]
        valid = [r for r in runs if r["valid"]]
        row: dict[str, Any] = {"rollouts": n, "mode": mode, "runs": len(runs), "void": len(runs) - len(valid)}
        for key in SUMMARIZED:
            row[key] = median_range([r[key] for r in valid if r.get(key) is not None])
        out.append(row)
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = summarize(records)
    for mode in MODES:  # each mode's median over its valid runs, the bars their range
        rs = [r for r in rows if r["mode"] == mode and r["trained_trajectories_per_s"] is not None]
        if not rs:
            continue
        xs = [r["rollouts"] for r in rs]
        for ax, key in ((ax1, "trained_trajectories_per_s"), (ax2, "rollout_idle_fraction")):
            figs = [r[key] or {"median": 0.0, "min": 0.0, "max": 0.0} for r in rs]
            mid = [f["median"] for f in figs]
            ax.errorbar(xs, mid, yerr=[[m - f["min"] for m, f in zip(mid, figs)],
                                       [f["max"] - m for m, f in zip(mid, figs)]],
                        fmt="o-", capsize=3, label=mode)
    ax1.set(xlabel="simulated rollouts", ylabel="trained trajectories / s", title="throughput")
    ax2.set(xlabel="simulated rollouts", ylabel="share of rollout time idle", title="rollout idle fraction",
            ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=Path("examples/longtail-sim.toml"))
    ap.add_argument("--rollouts", default="16,64", help="comma-separated fleet sizes")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--duration-s", type=float, default=150.0, help="wall seconds per run")
    ap.add_argument("--prompts-per-rollout", type=int, default=1,
                    help="prompts per rollout in each training batch (x group_size trajectories)")
    ap.add_argument("--slots", type=int, default=None,
                    help="override the engine's max_batch and roofline batch (e.g. 2 at 1,000 rollouts)")
    ap.add_argument("--inflight", type=float, default=1.25,
                    help="trajectories in flight per rollout slot (env_host.max_concurrent)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="wall seconds per model second for the engines and the trainer (slower "
                         "for the 1,000-rollout control-plane check)")
    ap.add_argument("--batch", type=int, default=None, help="trajectories per training step")
    ap.add_argument("--runs", type=int, default=3, help="repetitions of the whole sweep (settings take turns)")
    ap.add_argument("--json", type=Path, default=Path("runs/bench/longtail.json"))
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    sizes = [int(x) for x in args.rollouts.split(",") if x.strip()]
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: at least one")
    records: list[dict[str, Any]] = []
    made_by = provenance("rlfleet.tools.bench.longtail", argv)  # before the runs: the code they start from
    for run in range(args.runs):
        for n in sizes:
            for mode in modes:
                spec = spec_for(args.spec, mode, n, args.prompts_per_rollout, args.slots, args.inflight,
                                args.time_scale, args.batch)
                started = time.monotonic()
                try:
                    run_dir, etcd, code = run_once(spec, args.duration_s)
                finally:
                    spec.unlink(missing_ok=True)
                r = {**measure(run_dir, mode, n, etcd, code), "run": run}
                judge_final_lag(r, run_dir)  # the run's lag, not its start-up burst's
                records.append(r)
                print(f"run {run}  {n:>5} rollouts {mode:<18} {r['trained_trajectories_per_s']:>8.1f} traj/s  "
                      f"{r['generated_tokens_per_s'] or 0:>9.0f} tok/s  idle {r['rollout_idle_fraction']}  "
                      f"steps {r['steps']}  lag {r['final_lag']:.3f} (max {r['max_lag']:.3f})"
                      f"{'' if r['valid'] else '  VOID: ' + r['invalid_because']}  "
                      f"({time.monotonic() - started:.0f} s, {run_dir})", flush=True)
                write_json(args.json, {**made_by, "spec": str(args.spec), "duration_s": args.duration_s,
                                       "runs": args.runs, "max_lag": MAX_LAG, "records": records,
                                       "summary": summarize(records), "ratios": ratios_by_run(records)})
    print()
    print(table(records))
    print(json.dumps(ratios_by_run(records)["median"], indent=2))
    return finish(records, args.json, args.plot, plot)


if __name__ == "__main__":
    sys.exit(main())
