"""Fillers of the README's results table (tools/bench/pages/readme/results.md): headline figures
that no page filler gives in the words a table cell needs, each computed as its page computes it."""

from __future__ import annotations

from rlfleet.tools.bench.pages import Records, filler
from rlfleet.tools.bench.pages.fill_faults import failsafe_outcome
from rlfleet.tools.bench.pages.fill_vllm import success_row

LEARNING_RECORDS = {"learning_alone.json": "", "learning_hog.json": ", one core hogged"}


@filler
def readme_learning_target(record: Records) -> str:
    """Seeds meeting the learning target over both examples, alone and hogged (as learning.md's summaries)."""
    met = [(s["seeds_meeting_target"], s["seeds"], f"{task}{note}", record(file)["target_gain_points"])
           for file, note in LEARNING_RECORDS.items() for task, s in record(file)["summary"].items()]
    targets = sorted({target for *_, target in met})
    gain = " / ".join(f"+{t:.0f}" for t in targets)
    if len({(m, n) for m, n, *_ in met}) == 1 and met[0][0] == met[0][1]:
        return f"≥ {gain} points in {met[0][0]}/{met[0][1]} seeds"
    return f"≥ {gain} points in " + ", ".join(f"{m}/{n} ({what})" for m, n, what, _ in met) + " seeds"


@filler
def readme_failsafe_retrained(record: Records) -> str:
    """The steps and groups retrained after the etcd outages: the first clause of faults.md's outcome."""
    return failsafe_outcome(record).split("; ")[0].replace("**", "")


@filler
def readme_losses_frozenlake_span(record: Records) -> str:
    """The span of every FrozenLake run's final success and their count (as losses.md's losses_frozenlake_runs)."""
    finals = [r["final"] for r in record("losses.json")["records"] if r["task"] == "frozenlake"]
    return f"{min(finals):.3f}–{max(finals):.3f} in all {len(finals)} runs"


@filler
def readme_vllm_success(record: Records) -> str:
    """The vLLM engine's held-out success, first → final per seed: its cell in vllm.md's table."""
    return success_row(record)[1]
