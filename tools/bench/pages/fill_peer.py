"""Fillers of docs/results/peer.md, from the TRL side-by-side record (tools/bench/trl_peer.py
--side-by-side): the comparison table (each side's median and range over the runs, the
per-run ratio) and where rlfleet's CPU went."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler, median_span


def _reached(entry: dict[str, Any], runs: int) -> str:
    if not entry["reached"]:
        return "never"
    cell = median_span(entry["time_s"], ".1f") + " s"
    return cell if entry["reached"] == runs else f"{cell}, in {entry['reached']} of {runs} runs"


@filler
def peer_table(record: Records, file: str) -> str:
    """rlfleet and TRL side by side: medians (range) over the runs, the tokens/s ratio per run."""
    summary = record(file)["summary"]
    runs = summary["runs"]
    rl, trl = summary["rlfleet"], summary["trl"]
    ratio = summary["tokens_per_s_ratio"]
    rows = ["| | rlfleet | TRL |", "|---|---|---|",
            f"| training steps | {median_span(rl['steps'], '.0f')} | {median_span(trl['steps'], '.0f')} |",
            f"| training wall time (s) | {median_span(rl['train_wall_s'], '.1f')} | {median_span(trl['train_wall_s'], '.1f')} |",
            f"| trained tokens/s | {median_span(rl['tokens_per_s'], ',.0f')} | {median_span(trl['tokens_per_s'], ',.0f')} |",
            f"| rlfleet ÷ TRL, tokens/s (each run) | **{ratio['median']:.2f}×** "
            f"({', '.join(f'{x:.2f}' for x in ratio['each'])}) | |",
            f"| held-out success at the end | {median_span(rl['eval_last'], '.3f')} | {median_span(trl['eval_last'], '.3f')} |"]
    for level, sides in summary["milestones"].items():
        rows.append(f"| time to held-out success {level} | {_reached(sides['rlfleet'], runs)} "
                    f"| {_reached(sides['trl'], runs)} |")
    return "\n".join(rows)


@filler
def peer_cpu(record: Records, file: str) -> str:
    """rlfleet's CPU seconds per daemon in each run (summary.json's cpu_s), largest first."""
    runs = [r for r in record(file)["runs"] if r["rlfleet"].get("cpu_s")]
    if not runs:
        return "(no run recorded its CPU seconds)"
    daemons: dict[str, list[float]] = {}
    for r in runs:
        for name, seconds in r["rlfleet"]["cpu_s"].items():
            daemons.setdefault(name, []).append(seconds)
    ordered = sorted(daemons, key=lambda d: -max(daemons[d]))
    head = "| run | " + " | ".join(ordered) + " | total |"
    rows = [head, "|" + "---|" * (len(ordered) + 2)]
    for r in runs:
        cpu = r["rlfleet"]["cpu_s"]
        rows.append(f"| {r['run']} | " + " | ".join(f"{cpu.get(d, 0):.1f}" for d in ordered)
                    + f" | {sum(cpu.values()):.1f} |")
    return "\n".join(rows)


@filler
def peer_highest_milestone(record: Records, file: str) -> str:
    """The highest held-out success level both sides reached in every run, and each side's median time to it."""
    summary = record(file)["summary"]
    runs = summary["runs"]
    both = [lv for lv, sides in summary["milestones"].items()
            if all(sides[side]["reached"] == runs for side in ("rlfleet", "trl"))]
    if not both:
        return "no held-out level reached by both sides in every run"
    level = max(both, key=float)
    sides = summary["milestones"][level]
    return (f"to held-out success {level} in {sides['rlfleet']['time_s']['median']:.1f} s against TRL's "
            f"{sides['trl']['time_s']['median']:.1f} s (medians)")
