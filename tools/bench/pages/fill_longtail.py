"""Fillers of docs/results/longtail.md, from the long-tail bench's records
(tools/bench/longtail.py): the modes table (median and range over the valid runs of each
setting), the ratios against the targets (each repetition's ratio, side by side, and their
median), and the 1,000-rollout control-plane run."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler, median_span, span

# trajectory_repack against each mode (trained trajectories/s), and repack's generated tokens/s
# against trajectory alone: the targets of the long-tail work and the paper's figure beside them.
TARGETS = (("over_sync", "sync", 3.0, "Laminar 2.56× on average over verl"),
           ("over_one_step_off", "one_step_off", 2.0, "ROLL Flash's asynchronous baseline"),
           ("over_partial", "partial", 1.5, "AReaL-style partial rollout"),
           ("tokens_over_trajectory", "trajectory (generated tokens/s)", 1.25, "Laminar +26%"))


def _runs(row: dict[str, Any]) -> str:
    return f"{row['runs'] - row['void']}" + (f" (+{row['void']} void)" if row["void"] else "")


@filler
def longtail_table(record: Records, file: str) -> str:
    """One row per (rollouts, mode): valid runs, and each figure's median (range)."""
    head = ("| rollouts | mode | valid runs | trained traj/s | generated tok/s | rollout idle | staleness ≤ 3 "
            "| mixed-version traj. | repack moves | repack overhead p50 / p99 |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in record(file)["summary"]:
        p50, p99 = r["repack_overhead_s_p50"], r["repack_overhead_s_p99"]
        overhead = "–" if p50 is None else f"{median_span(p50, '.3f')} / {median_span(p99, '.3f')} s"
        mode = "trajectory + repack" if r["mode"] == "trajectory_repack" else r["mode"]
        rows.append(f"| {r['rollouts']} | {mode} | {_runs(r)} | {median_span(r['trained_trajectories_per_s'], '.1f')} "
                    f"| {median_span(r['generated_tokens_per_s'], ',.0f')} | {median_span(r['rollout_idle_fraction'], '.2f')} "
                    f"| {median_span(r['staleness_le3_share'], '.0f', 100, '%')} "
                    f"| {median_span(r['mixed_version_trajectories'], ',.0f')} "
                    f"| {'–' if r['mode'] != 'trajectory_repack' else median_span(r['repack_events'], ',.0f')} "
                    f"| {overhead} |")
    return "\n".join(rows)


@filler
def longtail_targets(record: Records, file: str) -> str:
    """Per target, at the largest fleet size: the median ratio, each repetition's, met or missed by how much."""
    ratios = record(file)["ratios"]
    size = max(ratios["median"], key=int)
    lines = []
    for key, against, target, paper in TARGETS:
        median = ratios["median"][size].get(key)
        if median is None:
            lines.append(f"- trajectory + repack over {against}: no repetition had both valid")
            continue
        each = ", ".join(f"{per[size][key]:.2f}" for per in ratios["by_run"].values()
                         if size in per and key in per[size])
        verdict = "met" if median >= target else f"**missed**, by {100 * (1 - median / target):.0f}%"
        lines.append(f"- trajectory + repack over {against}: **{median:.2f}×** (each repetition: {each}; "
                     f"target ≥ {target:g}×, {verdict}; {paper})")
    return f"At {size} rollouts:\n\n" + "\n".join(lines)


@filler
def control_plane(record: Records, file: str) -> str:
    """The 1,000-rollout run: valid runs, etcd writes/s, plan time, steps, CPU seconds per daemon."""
    data = record(file)
    runs = data["records"]
    valid = [r for r in runs if r["valid"]]
    void = [f"{r['invalid_because']}" for r in runs if not r["valid"]]
    if not valid:
        return f"no valid run of {len(runs)} ({'; '.join(void)})"
    cpu: dict[str, list[float]] = {}
    for r in valid:
        for daemon, seconds in (r.get("cpu_s") or {}).items():
            cpu.setdefault(daemon, []).append(seconds)
    top = sorted(cpu.items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2])[:5]

    def over_runs(key: str, spec: str = ".0f") -> str:  # – where no valid run has the figure
        values = [r[key] for r in valid if r.get(key) is not None]
        return span(values, spec) if values else "–"
    parts = [f"{len(valid)} valid runs of {len(runs)}" + (f" (void: {'; '.join(void)})" if void else ""),
             f"{over_runs('steps')} training steps in a {over_runs('window_s')} s window",
             f"etcd **{over_runs('etcd_writes_per_s')} writes/s**",
             f"Algorithm 1 planned in **{over_runs('repack_plan_ms_p50', '.1f')} ms p50** on the live fleet "
             f"(max {over_runs('repack_plan_ms_max', '.1f')} ms)",
             "CPU seconds over the run: " + ", ".join(f"{d} {span(v, '.1f')}" for d, v in top)]
    return "; ".join(parts)


@filler
def void_runs(record: Records, file: str) -> str:
    """A sweep's void runs, each with its reason: ``N of M runs void (mode at n rollouts: why; ...)``."""
    runs = record(file)["records"]
    void = [r for r in runs if not r["valid"]]
    if not void:
        return f"none of its {len(runs)} runs void"
    mode = {"trajectory_repack": "trajectory + repack"}
    return (f"{len(void)} of its {len(runs)} runs void ("
            + "; ".join(f"{mode.get(r['mode'], r['mode'])} at {r['rollouts']}: {r['invalid_because']}" for r in void)
            + ")")


@filler
def readme_longtail(record: Records, file: str) -> str:
    """The README's headline: at the largest fleet, trajectory + repack over sync and over
    partial (the median of the repetitions' ratios) against their targets."""
    ratios = record(file)["ratios"]
    size = max(ratios["median"], key=int)
    median = ratios["median"][size]
    parts = []
    for key, against, target, _ in TARGETS[::2]:  # over sync, over partial
        value = median.get(key)
        parts.append(f"{'–' if value is None else f'{value:.2f}'}× {against} (target ≥ {target:g}×)")
    return f"{size} rollouts: trajectory + repack " + ", ".join(parts)
