"""Fillers of docs/results/faults.md: the etcd-outage row of the trust table, from failsafe.json."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler


def _runs(record: Records) -> list[dict[str, Any]]:
    return record("failsafe.json")["runs"]


def _for_all(runs: list[dict[str, Any]]) -> str:
    return "for both" if len(runs) == 2 else f"in all {len(runs)} runs"


def _retrained(runs: list[dict[str, Any]]) -> str:
    steps = max(r["steps_retrained"] for r in runs)
    groups = max(r["groups_retrained"] for r in runs)
    same = all((r["steps_retrained"], r["groups_retrained"]) == (steps, groups) for r in runs)
    bound = "" if same else "at most "
    return f"**{bound}{steps} steps and {groups} groups retrained** {_for_all(runs)}"


def _terms(runs: list[dict[str, Any]]) -> str:
    most = max(len(r["publishing_terms"]) for r in runs)
    return "one publishing term" if most == 1 else f"up to {most} publishing terms in one run"


def _failing(runs: list[dict[str, Any]], key: str) -> int:
    return sum(1 for r in runs if not r[key])


def _latest(runs: list[dict[str, Any]]) -> str:
    bad = _failing(runs, "latest_never_backwards")
    return "`weights/latest` never backwards" if not bad else f"`weights/latest` went backwards in {bad} runs"


def _summary_steps(runs: list[dict[str, Any]]) -> str:
    bad = _failing(runs, "summary_steps_consistent")
    relation = "=" if not bad else f"≠ (in {bad} runs)"
    return f"`summary.json` steps {relation} distinct steps"


@filler
def failsafe_outcome(record: Records) -> str:
    """What an etcd outage does to training now: retrained steps, publishing terms, monotonic latest, summary."""
    runs = _runs(record)
    return "; ".join([_retrained(runs), _terms(runs), _latest(runs), _summary_steps(runs)])
