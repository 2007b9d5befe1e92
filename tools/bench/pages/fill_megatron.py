"""Fillers of docs/results/megatron.md: the megatron backend against the torch backend on
one H100 (tools/bench/results/megatron_h100.json) and full jobs on that machine
(tools/bench/results/megatron_job_h100.json)."""

from __future__ import annotations

import re
from typing import Any

from rlfleet.tools.bench.pages import PageError, Records, filler

CHECK = "megatron_h100.json"
JOB = "megatron_job_h100.json"
MAX_STEPS = 1_000  # examples/arithmetic-megatron.toml's max_steps: a setting, not a measurement
LOGPROB_ROWS = {  # row label -> the check's per-token log-prob difference
    "per-token log-probs, megatron (GPU) vs torch (CPU), version 0": "logprob_diff_before",
    "control: megatron vs the HF model, both on the GPU": "logprob_diff_before_megatron_vs_hf_same_device",
    "control: the HF model on the GPU vs on the CPU": "logprob_diff_before_hf_device_vs_hf_cpu",
    "after one identical step": "logprob_diff_after_step_1",
    "after six steps on the same batch": "logprob_diff_after_step_6",
}
JOB_COLUMNS = {"megatron1": "megatron, run 1", "megatron2": "megatron, run 2", "torch": "torch backend (CPU)"}


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; an empty cell is one space, as "| |"."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(row) for row in rows])


def ms(seconds: float, spec: str) -> str:
    return format(seconds * 1e3, spec)


@filler
def megatron_logprob_table(record: Records) -> str:
    """Log-prob differences megatron vs torch, its controls, and the step-1 gradient difference."""
    check = record(CHECK)
    rows = [[label, f"{check[key]['max_abs']:.1e}", f"{check[key]['mean_abs']:.1e}"]
            for label, key in LOGPROB_ROWS.items()]
    rows.append(["step-1 gradients (HF names), relative to the largest",
                 f"{check['grad_diff_step_1']['relative']:.1e}", ""])
    return table(["", "max abs", "mean abs"], rows)


@filler
def megatron_gpu_step_ms(record: Records) -> str:
    """The megatron backend's median step on the GPU, in ms."""
    return ms(record(CHECK)["step_s"]["megatron_gpu_median"], ".1f")


@filler
def megatron_cpu_step_ms(record: Records) -> str:
    """The torch backend's median step on the CPU, in ms."""
    return ms(record(CHECK)["step_s"]["torch_cpu_median"], ".1f")


@filler
def megatron_first_steps_ms(record: Records) -> str:
    """The first steps, megatron (GPU) and torch (CPU), in ms."""
    steps = record(CHECK)["step_s"]
    return f"{ms(steps['megatron_gpu_first'], '.0f')} and {ms(steps['torch_cpu_first'], '.0f')}"


def job_runs(record: Records) -> dict[str, dict[str, Any]]:
    return {key: record(JOB)["runs"][key] for key in JOB_COLUMNS}


def steps_cell(run: dict[str, Any], first: bool) -> str:
    of = f" of {MAX_STEPS:,}" if first else ""
    return f"{run['steps']:,}{of} in {run['wall_s_first_to_last_metrics_line']:.1f} s"


def held_out_cell(run: dict[str, Any]) -> str:
    cell = f"{run['eval_cpu_greedy_128']['start']:.3f} → {run['eval_cpu_greedy_128']['last checkpoint']:.3f}"
    own = run.get("held_out_success_trainer")
    return cell if own is None else \
        f"{cell} (trainer's own: {own['eval_success_first']:.3f} → {own['eval_success_last']:.3f})"


def accounting_cell(run: dict[str, Any], first_reasons: list[str] | None) -> str:
    """``ok, N dropped``, the reasons where the first column does not give them already."""
    accounting = run["accounting"]
    reasons = list(accounting["dropped"])
    why = f" ({', '.join(reasons)})" if reasons != first_reasons else ""
    return f"{'ok' if accounting['ok'] else 'NOT ok'}, {accounting['dropped_total']} dropped{why}"


def job_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    first_reasons = list(runs[0]["accounting"]["dropped"])
    cells = {
        "steps (of `max_steps`)": [steps_cell(r, i == 0) for i, r in enumerate(runs)],
        "trainer step, median (first)": [f"{ms(r['step_s']['median_after_first'], '.1f')} ms "
                                         f"({ms(r['step_s']['first'], '.0f')} ms)" for r in runs],
        "tokens/s end to end (mean of steps)": [f"{r['trained_tokens_per_s_end_to_end']:,.0f} "
                                                f"({r['tokens_per_s_mean_of_steps']:,.0f})" for r in runs],
        "reward, first → last 50 steps": [f"{r['reward_mean_first_50_steps']:.2f} → "
                                          f"{r['reward_mean_last_50_steps']:.2f}" for r in runs],
        "held-out success, greedy, 128 (start → last checkpoint)": [held_out_cell(r) for r in runs],
        "versions at the relay / loaded by rollout-0": [f"{r['relay_versions_complete']:,} / "
                                                        f"{r['rollout_weight_loads']['count']:,}" for r in runs],
        "staleness 0 / 1 / 2 (trajectories)": [" / ".join(f"{n:,}" for n in r["staleness"].values()) for r in runs],
        "accounting": [accounting_cell(r, None if i == 0 else first_reasons) for i, r in enumerate(runs)],
    }
    return [[label] + row for label, row in cells.items()]


@filler
def megatron_job_table(record: Records) -> str:
    """The full jobs: two megatron runs and the torch backend's, side by side."""
    return table([""] + list(JOB_COLUMNS.values()), job_rows(list(job_runs(record).values())))


@filler
def megatron_job_version_mb(record: Records) -> str:
    """The size of one published version, in MB, as the record's relay note gives it in bytes."""
    found = re.search(r"([\d,]+) bytes", " ".join(record(JOB)["notes"]))
    if found is None:
        raise PageError(f"{JOB}: no note gives a version's size in bytes")
    return f"{int(found.group(1).replace(',', '')) / 1e6:.1f}"


@filler
def megatron_job_rollout_loads(record: Records) -> str:
    """Over all runs: the fewest and most versions the rollout moved ahead at one load, and its slowest load."""
    loads = [run["rollout_weight_loads"] for run in job_runs(record).values()]
    jumps = [int(j) for load in loads for j in load["version_jumps"]]
    slowest = max(load["load_s_max"] for load in loads)
    return f"{min(jumps)} to {max(jumps)} versions ahead of the last, in at most\n{slowest:.2f} s"


@filler
def megatron_job_rollout_cpu_s(record: Records) -> str:
    """The rollout's CPU seconds in the two megatron runs."""
    runs = job_runs(record)
    return f"{runs['megatron1']['cpu_s']['rollout-0']:.0f} vs {runs['megatron2']['cpu_s']['rollout-0']:.0f}"
