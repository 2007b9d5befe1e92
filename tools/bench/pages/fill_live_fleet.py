"""Fillers of docs/results/live-fleet.md: the phases of `node add` and `node drain`, from node_add.json."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler

# (what the row measures, its value in node_add.json as a function of the record, format)
PHASE_ROWS = (
    ("`node add h6`: registered → admitted into pool `rollout`", lambda r: r["phases"]["admit_s"], "{:.1f} s"),
    ("→ placed (relay + rollout)", lambda r: r["phases"]["place_s"], "{:.1f} s"),
    ("→ both registered `running` (units started, model loaded)", lambda r: r["phases"]["start_s"], "{:.1f} s"),
    ("→ relay caught up from its predecessor, rollout on that version", lambda r: r["phases"]["weights_s"],
     "{:.1f} s"),
    ("→ first trajectory generated on h6", lambda r: r["phases"]["first_trajectory_s"], "{:.1f} s"),
    ("**total, registration → first trajectory**", lambda r: r["total_s"], "**{:.1f} s**"),
    ("provisioning h6 before that (`site.yml -l h6:prometheus`: venv from the wheelhouse, keys exchanged)",
     lambda r: r["provision_s"], "{:.0f} s"),
    ("`node drain h6` → drained (rollout finished or handed over its turns, relay out of the chain)",
     lambda r: r["drain"]["drain_s"], "{:.1f} s"),
    ("trajectories lost over the whole run, incidents included (`rlfleet accounting` over every host's journals)",
     lambda r: r["lost_trajectories"], "{:d}"),
)


def _row(what: str, value: Any, fmt: str) -> str:
    return f"| {what} | {fmt.format(value)} |"


@filler
def node_add_table(record: Records) -> str:
    """The table of `node add` phases, provisioning, drain and lost trajectories measured by the bench."""
    run = record("node_add.json")
    rows = [_row(what, value(run), fmt) for what, value, fmt in PHASE_ROWS]
    return "\n".join(["| what | bench |", "|---|---|", *rows])
