"""Fillers of docs/results/learning.md: the two examples' runs alone (learning_alone.json), with one
core hogged (learning_hog.json) and with dynamic filtering but no entropy bonus yet
(learning_loaded_before_entropy.json)."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler, span

ALONE = "learning_alone.json"
HOG = "learning_hog.json"
BEFORE_ENTROPY = "learning_loaded_before_entropy.json"
HEADER = ["| task | seed | first | **final** | best | gain (points) | steps | run (s, with start-up) |",
          "|---|---|---|---|---|---|---|---|"]
CPU_DAEMONS = ("trainer-0", "env-host-0", "rollout-0", "reward-host-0", "etcd", "relay-0")


def _runs(record: Records, file: str, task: str) -> list[dict[str, Any]]:
    return [r for r in record(file)["records"] if r["task"] == task]


def _row(r: dict[str, Any]) -> str:
    cells = [r["task"], str(r["seed"]), f"{r['first']:.3f}", f"**{r['final']:.3f}**", f"{r['best']:.3f}",
             f"{r['gain_points']:+.1f}", str(r["steps"]), f"{r['run_wall_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"




@filler
def learning_table(record: Records, file: str) -> str:
    """Per task and seed of a learning record: first, final, best, gain, steps, run time."""
    return "\n".join(HEADER + [_row(r) for r in record(file)["records"]])


@filler
def learning_summary(record: Records, file: str) -> str:
    """Per task of a learning record, as the bench prints it: final mean ± std (min), seeds
    meeting the target, slowest run."""
    result = record(file)
    target = result["target_gain_points"]
    return "; ".join(f"{task}: final {s['final_mean']:.3f} ± {s['final_std']:.3f} (min {s['final_min']:.3f}), "
                     f"≥ +{target:.0f} points in **{s['seeds_meeting_target']}/{s['seeds']}** seeds, "
                     f"slowest run {s['wall_s_max']:.0f} s" for task, s in result["summary"].items())


@filler
def learning_alone_load_range(record: Records) -> str:
    """The 1-minute load average at the start of the runs alone (the rerun of seed 3 included)."""
    result = record(ALONE)
    runs = result["records"] + [result["rerun_of_seed3"]]
    return span([r["load_1m_before"] for r in runs], ".1f")


@filler
def learning_loaded_arithmetic_load(record: Records) -> str:
    """The 1-minute load average at the start of arithmetic's runs on the loaded machine."""
    return span([r["load_1m_before"] for r in _runs(record, BEFORE_ENTROPY, "arithmetic")], ".0f")


@filler
def learning_loaded_arithmetic_finals(record: Records) -> str:
    """Arithmetic's final held-out success per seed on the loaded machine."""
    return ", ".join(f"{r['final']:.3f}" for r in _runs(record, BEFORE_ENTROPY, "arithmetic"))


@filler
def learning_loaded_arithmetic_gain(record: Records) -> str:
    """Arithmetic's gain on the loaded machine: one figure if every seed had it, else their span."""
    gains = sorted({r["gain_points"] for r in _runs(record, BEFORE_ENTROPY, "arithmetic")})
    return f"{gains[0]:+.1f} points each" if len(gains) == 1 else f"{span(gains, '+.1f', ' … ')} points"


@filler
def learning_loaded_arithmetic_run_times(record: Records) -> str:
    """The span of arithmetic's run times (with start-up) on the loaded machine."""
    return span([r["run_wall_s"] for r in _runs(record, BEFORE_ENTROPY, "arithmetic")], ".0f")


@filler
def learning_arithmetic_best_everywhere(record: Records) -> str:
    """Arithmetic's lowest best held-out success over every seed, before the entropy bonus and after."""
    runs = _runs(record, BEFORE_ENTROPY, "arithmetic") + _runs(record, ALONE, "arithmetic")
    return f"{min(r['best'] for r in runs):.3f}"


def _filtering_only(record: Records) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """FrozenLake with dynamic filtering and no entropy bonus: the seeds meeting the target, and the rest."""
    target = record(BEFORE_ENTROPY)["target_gain_points"]
    runs = _runs(record, BEFORE_ENTROPY, "frozenlake")
    return [r for r in runs if r["gain_points"] >= target], [r for r in runs if r["gain_points"] < target]


@filler
def learning_filtering_only_lifted(record: Records) -> str:
    """How many FrozenLake seeds dynamic filtering alone lifted past the target, and by how much."""
    lifted, rest = _filtering_only(record)
    gains = [r["gain_points"] for r in lifted]
    return f"{len(lifted)} of the {len(lifted) + len(rest)} seeds run to {span(gains, '+.0f', ' … ')} points"


@filler
def learning_filtering_only_stuck_seeds(record: Records) -> str:
    """The FrozenLake seeds that dynamic filtering alone did not lift past the target."""
    _, rest = _filtering_only(record)
    seeds = ", ".join(str(r["seed"]) for r in rest)
    return f"remaining one (seed {seeds})" if len(rest) == 1 else f"remaining ones (seeds {seeds})"


@filler
def learning_filtering_only_stuck_at(record: Records) -> str:
    """The final held-out success of the FrozenLake seeds that dynamic filtering alone did not lift."""
    _, rest = _filtering_only(record)
    return ", ".join(f"{r['final']:.2f}" for r in rest)


@filler
def learning_entropy_seed(record: Records) -> str:
    """The final, alone and with the entropy bonus, of the seed that dynamic filtering alone left stuck."""
    _, rest = _filtering_only(record)
    stuck = {r["seed"] for r in rest}
    return ", ".join(f"{r['final']:.3f}" for r in _runs(record, ALONE, "frozenlake") if r["seed"] in stuck)


# The examples' settings (not measured): the held-out set, the learning rate, the turns.
RECIPE = {"arithmetic": ("128 problems", "1e-4 constant", ""),
          "frozenlake": ("256 maps", "3e-4 linear decay", " (up to 12 turns each)")}


def _success(r: dict[str, Any]) -> str:
    held_out = RECIPE[r["task"]][0]
    return f"{r['first']:.3f} → **{r['final']:.3f}** ({r['best']:.3f}), {held_out}"


def _steps(r: dict[str, Any]) -> str:
    _, rate, turns = RECIPE[r["task"]]
    return f"{r['steps']} × {r['trained_trajectories'] // r['steps']}{turns}, {rate}"


def _cpu(r: dict[str, Any]) -> str:
    return " / ".join(f"{100 * r['cpu_share'].get(d, 0.0):.0f}" for d in CPU_DAEMONS) + " %"


def _ages(r: dict[str, Any]) -> str:
    return " / ".join(f"{n:,}" for _, n in sorted(r["staleness"].items(), key=lambda kv: int(kv[0])))


def _trainer_time(r: dict[str, Any]) -> str:
    t = r["trainer_time_s"]
    return f"{t['learn']:.0f} / {t['wait_for_batch']:.0f} / {t['eval']:.0f} s"


THROUGHPUT_ROWS = (
    ("held-out greedy success, step 0 → end (best)", _success),
    ("gain", lambda r: f"**{r['gain_points']:+.0f} points**"),
    ("steps × trajectories, learning rate", _steps),
    ("training wall time (with start-up)", lambda r: f"{r['wall_s']:.0f} s ({r['run_wall_s']:.0f} s)"),
    ("trained trajectories/s, tokens/s (end to end)",
     lambda r: f"{r['trajectories_per_s']:,.0f}, {r['trained_tokens_per_s']:,.0f}"),
    ("learner tokens/s inside a step", lambda r: f"{r['tokens_per_s_mean']:,.0f}"),
    ("trainer time: learn / wait for batch / eval", _trainer_time),
    ("CPU share: trainer / env-host / rollout / reward-host / etcd / relay", _cpu),
    ("staleness of trained trajectories (0 / 1 / 2 versions)", _ages),
)


@filler
def learning_throughput_table(record: Records) -> str:
    """Seed 0 of each task alone: success, rates, the trainer's time, the CPU per daemon and the staleness."""
    runs = [next(r for r in _runs(record, ALONE, task) if r["seed"] == 0) for task in ("arithmetic", "frozenlake")]
    lines = ["| | arithmetic | FrozenLake |", "|---|---|---|"]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in runs) + " |" for label, cell in THROUGHPUT_ROWS]
    return "\n".join(lines)
