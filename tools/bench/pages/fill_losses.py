"""Fillers of docs/results/losses.md: the five losses on both tasks, at the example's staleness bound and
under stress (losses.json), beside the learning bench's FrozenLake seeds (learning_alone.json, learning_hog.json)."""

from __future__ import annotations

import statistics
from typing import Any

from rlfleet.tools.bench.losses import LOSSES, markdown_table
from rlfleet.tools.bench.pages import Records, filler, span

LOSSES_RECORD = "losses.json"
LEARNING_RECORDS = ("learning_alone.json", "learning_hog.json")
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _runs(record: Records, task: str, stress: bool | None = None) -> list[dict[str, Any]]:
    return [r for r in record(LOSSES_RECORD)["records"]
            if r["task"] == task and (stress is None or r["stress"] == stress)]


def _cell(record: Records, loss: str, task: str, condition: str) -> dict[str, Any]:
    return record(LOSSES_RECORD)["summary"][f"{loss}/{task}/{condition}"]


def _cells(record: Records, task: str, condition: str) -> dict[str, dict[str, Any]]:
    return {loss: _cell(record, loss, task, condition) for loss in LOSSES}


@filler
def losses_table(record: Records) -> str:
    """The bench's own --table: per loss, task and condition, the final's mean ± std (min, seeds) and staleness."""
    runs = [{**r, "staleness": {int(k): n for k, n in r["staleness"].items()}}
            for r in record(LOSSES_RECORD)["records"]]
    return markdown_table(runs)


@filler
def losses_arithmetic_worst(record: Records) -> str:
    """The lowest final held-out success of any arithmetic run."""
    return f"{min(r['final'] for r in _runs(record, 'arithmetic')):.3f}"


@filler
def losses_arithmetic_share_near_alpha(record: Records) -> str:
    """The share of arithmetic's stressed trajectories trained at α or one version less."""
    alpha = record(LOSSES_RECORD)["stress_alpha"]
    ages = [(int(k), n) for r in _runs(record, "arithmetic", stress=True) for k, n in r["staleness"].items()]
    near = sum(n for age, n in ages if age >= alpha - 1)
    return f"{100 * near / sum(n for _, n in ages):.0f} %"


@filler
def losses_frozenlake_runs(record: Records) -> str:
    """How many FrozenLake runs, the span of their finals and the success they started from."""
    runs = _runs(record, "frozenlake")
    finals = [r["final"] for r in runs]
    first = statistics.fmean(r["first"] for r in runs)
    return f"All {len(runs)} runs end between {min(finals):.3f} and {max(finals):.3f} from {first:.3f}"


@filler
def losses_frozenlake_default_means(record: Records) -> str:
    """The span of the five losses' default FrozenLake means, and how far apart they are."""
    means = [c["final_mean"] for c in _cells(record, "frozenlake", "default").values()]
    return f"{span(means, '.3f')}, {max(means) - min(means):.2f} apart"


@filler
def losses_frozenlake_default_stds(record: Records) -> str:
    """The span of the seeds' std of one loss on FrozenLake by default."""
    return span([c["final_std"] for c in _cells(record, "frozenlake", "default").values()], ".2f")


def _learning_finals(record: Records) -> list[float]:
    return [r["final"] for file in LEARNING_RECORDS for r in record(file)["records"] if r["task"] == "frozenlake"]


@filler
def losses_learning_std(record: Records) -> str:
    """FrozenLake's seed-to-seed std over the learning bench's seeds (alone and hogged)."""
    return f"{statistics.pstdev(_learning_finals(record)):.2f}"


@filler
def losses_learning_seeds(record: Records) -> str:
    """How many FrozenLake seeds the learning bench ran (alone and hogged), in words."""
    count = len(_learning_finals(record))
    return NUMBER_WORDS[count] if count < len(NUMBER_WORDS) else str(count)


@filler
def losses_learning_finals(record: Records) -> str:
    """The span of the learning bench's FrozenLake finals (alone and hogged)."""
    return span(_learning_finals(record), ".2f")


@filler
def losses_frozenlake_stressed_average(record: Records) -> str:
    """The mean final of FrozenLake's stressed runs against its default ones."""
    stressed, default = _runs(record, "frozenlake", stress=True), _runs(record, "frozenlake", stress=False)
    return f"the {len(stressed)} stressed runs average {statistics.fmean(r['final'] for r in stressed):.3f} " \
           f"against {statistics.fmean(r['final'] for r in default):.3f}"


@filler
def losses_higher_under_stress(record: Records) -> str:
    """The losses whose stressed FrozenLake mean is above their default one, with mean ± std."""
    stressed, default = _cells(record, "frozenlake", "stress"), _cells(record, "frozenlake", "default")
    higher = [f"`{loss}` ({s['final_mean']:.3f} ± {s['final_std']:.3f})" for loss, s in stressed.items()
              if s["final_mean"] > default[loss]["final_mean"]]
    return ", ".join(higher[:-1]) + f" and {higher[-1]}" if len(higher) > 1 else "".join(higher)


@filler
def losses_frozenlake_stressed_staleness(record: Records) -> str:
    """The span of the stressed FrozenLake runs' mean and max staleness."""
    runs = _runs(record, "frozenlake", stress=True)
    return f"{span([r['staleness_mean'] for r in runs], '.1f')} versions on average, " \
           f"{span([r['staleness_max'] for r in runs], 'd')} at most"


@filler
def losses_frozenlake_default_staleness_max(record: Records) -> str:
    """The highest staleness any default FrozenLake run trained at."""
    return str(max(r["staleness_max"] for r in _runs(record, "frozenlake", stress=False)))


@filler
def losses_ppo_clip_worst_stressed(record: Records) -> str:
    """ppo_clip's worst stressed FrozenLake seed, against the other losses' worst seeds."""
    worst = {loss: c["final_min"] for loss, c in _cells(record, "frozenlake", "stress").items()}
    best_loss = max(worst, key=worst.get)
    own = f"its worst seed ({worst['ppo_clip']:.3f})"
    if best_loss == "ppo_clip":
        return f"{own} is the best worst seed"
    return f"{own} is behind `{best_loss}`'s ({worst[best_loss]:.3f}), the best worst seed"
