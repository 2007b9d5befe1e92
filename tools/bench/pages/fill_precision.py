"""Fillers of docs/results/precision.md: the log-prob mismatch between the rollout engine and
the trainer by precision (tools/bench/results/logprob_mismatch.json, written by
tools/bench/logprob_mismatch.py)."""

from __future__ import annotations

from rlfleet.tools.bench.pages import Records, filler

RECORD = "logprob_mismatch.json"


@filler
def mismatch_table(record: Records, name: str = RECORD) -> str:
    """Per model and pairing: the statistics as mean over seeds (min to max)."""
    rows = ["| model: engine vs trainer | seeds | mean d | mean abs d | max abs d | ratio p1 | ratio p99 | "
            "ratio outside [1/2, 2] |", "|---|---|---|---|---|---|---|---|"]

    def cell(stat: dict, spec: str) -> str:
        return f"{stat['mean']:{spec}} ({stat['min']:{spec}} to {stat['max']:{spec}})"

    for key, s in record(name)["summary"].items():
        rows.append(f"| {key} | {s['seeds']} | {cell(s['mean_diff'], '.1e')} | {cell(s['mean_abs_diff'], '.1e')} | "
                    f"{cell(s['max_abs_diff'], '.1e')} | {s['ratio_p01']['mean']:.3f} | {s['ratio_p99']['mean']:.3f} | "
                    f"{cell(s['ratio_outside_half_to_2'], '.2%')} |")
    return "\n".join(rows)
