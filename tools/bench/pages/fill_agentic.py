"""Fillers of docs/results/agentic.md: the agentic scheduling benches beside their baselines
(tools/bench/results/agentic_env.json, agentic_filter.json, agentic_routing.json) and the
learning runs of queue filtering and tool use (learning_filter_queue.json, learning_tool_use.json)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfleet.tools.bench.pages import Records, filler, span

ENV, FILTER, ROUTING = "agentic_env.json", "agentic_filter.json", "agentic_routing.json"
FILTER_LEARNING, TOOL_USE = "learning_filter_queue.json", "learning_tool_use.json"
WORDS = {0: "No", 1: "One", 2: "Two", 3: "Three", 4: "Four", 5: "Five"}


@dataclass(frozen=True)
class Row:
    """One setting of the table: which record, how the page names it, and what it is held to."""

    bench: str
    key: Any  # the setting that picks the record (see ``setting_key``)
    setting: str
    paper: str = ""
    target: float | None = None


GROUPS = {  # bench -> (its first cell, the format of its figures, the format of its speedup)
    "env_async": ("env_async (`batch` → `async`), trained traj/s", ".1f", ".2f"),
    "redundant": ("redundant (batch mode, σ = 5, 2 % env failures per step), trained traj/s", ".1f", ".2f"),
    "queue_filter": ("queue_filter (`after_batch` → `queue`), s/step", ".3g", ".1f"),
    "replication": ("replication (`group_sticky` → `least_loaded` + queue), s/step", ".3g", ".2f"),
    "affinity": ("affinity (best single-kind fleet → mixed fleet routed by tag), trained traj/s, "
                 "equal cost (23 H20s)", ".1f", ".2f"),
}
ROWS = [
    Row("env_async", 0.0, "μ = 10, σ = 0", "ROLL Flash (10, 1): 1.16×"),
    Row("env_async", 2.5, "σ = 2.5"),
    Row("env_async", 5.0, "σ = 5", "RollArt R2: 1.23–2.27×"),
    Row("env_async", 10.0, "σ = 10", "ROLL Flash (10, 10): 2.46×", 2.4),
    Row("redundant", "more_groups", "more groups: 20 prompts × 8 for 16", "ROLL Flash 36×9: 3.10×"),
    Row("redundant", "bigger_groups", "bigger groups: 16 × 12 for 16 × 8", "RollArt: up to 1.62×", 1.6),
    Row("redundant", "both", "both: 20 × 12", "ROLL Flash 36×12: 5.45×"),
    Row("queue_filter", 8, "8 × 8, 16 extra prompts", "ROLL Flash 8×8: 125 → 37 s, 3.4×"),
    Row("queue_filter", 32, "32 × 8", target=3.0),
    Row("replication", 16, "64 × 16, 16 rollouts × 4 slots", "ROLL Flash 64×16: 1.84×", 1.8),
    Row("replication", 32, "64 × 16, 32 rollouts × 4 slots"),
    Row("affinity", None, "8 H800 / 23 H20 / 6 H800 + 6 H20, {runs} runs each", "RollArt: 1.12–1.37×", 1.12),
]


def setting_key(record: dict[str, Any]) -> Any:
    """What tells a bench's records apart (the ``key`` of a Row)."""
    setting = record["setting"]
    return {"env_async": lambda: setting["sigma"], "redundant": lambda: setting["variant"],
            "queue_filter": lambda: setting["prompts"], "replication": lambda: setting["rollouts"],
            "affinity": lambda: None}[record["bench"]]()


def bench_records(record: Records) -> dict[tuple[str, Any], dict[str, Any]]:
    """Every agentic bench record, by (bench, setting key)."""
    found = record(ENV) + record(FILTER) + record(ROUTING)
    return {(r["bench"], setting_key(r)): r for r in found}


def met(row: Row, rec: dict[str, Any]) -> bool:
    return row.target is not None and rec["speedup"] >= row.target


def invalid_note(rec: dict[str, Any]) -> str:
    """Why a record is not valid, as the table says it ("" when it is)."""
    if rec["valid"]:
        return ""
    runs = rec.get("runs", {})
    bad = [f"{name} run invalid: lag {run['max_lag']:.3f}" for name, run in runs.items()
           if isinstance(run, dict) and not run.get("valid", True)]
    return ", ".join(bad) or rec.get("invalid_because", "invalid")


def speedup_cell(row: Row, rec: dict[str, Any], spec: str) -> str:
    figure = f"{rec['speedup']:{spec}}×"
    notes = [invalid_note(rec)] if not rec["valid"] else []
    if row.target is not None:
        notes.append(f"target ≥ {row.target:g}×" + ("" if met(row, rec) else ": missed"))
        figure = f"**{figure}**" if met(row, rec) else figure
    return figure + "".join(f" ({n})" for n in notes)


def baseline_cell(rec: dict[str, Any], spec: str) -> str:
    """The baseline; for affinity, which fleet it is and what the other single-kind fleet did."""
    if rec["bench"] != "affinity":
        return f"{rec['baseline']:{spec}}"
    h800 = rec["fleets"]["h800_only"]["trained_trajectories_per_s"]
    return f"{rec['baseline']:{spec}} (H20 only; H800 only {h800:{spec}})"


def table_row(row: Row, rec: dict[str, Any], first: bool) -> str:
    label, spec, speedup_spec = GROUPS[row.bench]
    setting = row.setting.format(runs=len(rec.get("baseline_runs", [])))
    setting = f"**{setting}**" if met(row, rec) else setting
    cells = [label if first else "", setting, baseline_cell(rec, spec), f"{rec['variant']:{spec}}",
             speedup_cell(row, rec, speedup_spec), row.paper]
    return markdown_row(cells)


def markdown_row(cells: list[str]) -> str:
    """A table row, an empty cell as ``| |`` as the hand-written tables had it."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


@filler
def agentic_table(record: Records) -> str:
    """Each bench's baseline, variant and speedup per setting, beside the paper's figure."""
    recs = bench_records(record)
    lines = ["| bench | setting | baseline | variant | speedup | paper |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(ROWS):
        lines.append(table_row(row, recs[(row.bench, row.key)], i == 0 or ROWS[i - 1].bench != row.bench))
    return "\n".join(lines)


def redundant_baselines(record: Records) -> list[float]:
    return [r["baseline"] for r in record(ENV) if r["bench"] == "redundant"]


@filler
def agentic_redundant_baseline_range(record: Records) -> str:
    """The lowest and highest baseline of the redundant pairs, in traj/s."""
    return span(redundant_baselines(record), ".1f")


@filler
def agentic_redundant_pairs(record: Records) -> str:
    """How many redundant pairs ran, in words."""
    return WORDS[len(redundant_baselines(record))].lower()


@filler
def agentic_redundant_baseline_spread(record: Records) -> str:
    """Half the redundant baselines' range over its midpoint, in percent."""
    low, high = min(redundant_baselines(record)), max(redundant_baselines(record))
    return f"±{100 * (high - low) / (high + low):.0f}"


@filler
def agentic_filter_seeds_at_best(record: Records) -> str:
    """How many queue-filtering seeds ended at the best final success."""
    rec = record(FILTER_LEARNING)
    best = max(r["final"] for r in rec["records"])
    return str(sum(r["final"] == best for r in rec["records"]))


@filler
def agentic_missed_targets(record: Records) -> str:
    """How many of the table's targets are missed, in words."""
    recs = bench_records(record)
    return WORDS[sum(row.target is not None and not met(row, recs[(row.bench, row.key)]) for row in ROWS)]


@filler
def agentic_replication_range(record: Records) -> str:
    """The lowest and highest replication speedup."""
    return span([r["speedup"] for r in record(ROUTING) if r["bench"] == "replication"], ".2f")


@filler
def agentic_tool_use_table(record: Records) -> str:
    """Each tool-use seed's first, final and best held-out success, gain, steps and run time."""
    lines = ["| task | seed | first | **final** | best | gain (points) | steps | run (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in record(TOOL_USE)["records"]:
        lines.append(f"| {r['task']} | {r['seed']} | {r['first']:.3f} | **{r['final']:.3f}** | {r['best']:.3f} "
                     f"| {r['gain_points']:+.1f} | {r['steps']} | {r['run_wall_s']:.0f} |")
    return "\n".join(lines)


@filler
def agentic_tool_use_load(record: Records) -> str:
    """The 1-minute load average at the start of the tool-use runs, lowest to highest."""
    loads = [r["load_1m_before"] for r in record(TOOL_USE)["records"]]
    return f"{min(loads):.1f}–{max(loads):.0f}"


@filler
def agentic_tool_use_run_s(record: Records) -> str:
    """A tool-use run's wall time, the mean to the nearest 10 s."""
    walls = [r["run_wall_s"] for r in record(TOOL_USE)["records"]]
    return f"{round(sum(walls) / len(walls), -1):.0f}"
