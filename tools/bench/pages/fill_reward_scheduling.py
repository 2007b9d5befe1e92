"""Fillers of docs/results/reward-scheduling.md: the reward-scheduling policies replayed in the
discrete-event simulator (tools/bench/results/reward.json, one record per policy, the targets
and the Fig. 14 sweep in the records of ``ebf_timeout`` and ``fcfs``)."""

from __future__ import annotations

import statistics
from typing import Any

from rlfleet.tools.bench.pages import Records, filler
from rlfleet.tools.bench.reward import PAPER

REWARD = "reward.json"
GPU_STAGE, CPU_STAGE = "run", "compile"
POLICIES = {  # policy -> (its cell, DistRS's figure, whether its figures are bold)
    "dedicated": ("`dedicated` (ZQ per tenant)", "ZQ-Dedicated", False),
    "fcfs": ("`fcfs` (FCFS + timeout-aware scaling)", "—", False),
    "history": ("`history` (EBF, history-only scaling)", "History-Based: 14.3 s", False),
    "ebf_timeout": ("**`ebf_timeout`** (DistRS)", "3.79× GPU, 1.98× CPU, 0.62 s (colocated); Fig. 13: 2.1 s", True),
}


def by_policy(record: Records) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in record(REWARD)}


def targets(record: Records) -> dict[str, dict[str, Any]]:
    return by_policy(record)["ebf_timeout"]["targets"]


def outcome(record: Records, target: str) -> str:
    return "met" if targets(record)[target]["met"] else "missed"


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def worker_seconds_cell(rec: dict[str, Any]) -> str:
    spread = rec["worker_seconds_spread"]
    return f"{spread['mean'] / 1e6:.2f} M ± {spread['std'] / 1e6:.2f} M"


def vs_dedicated_cell(rec: dict[str, Any]) -> str:
    """Cost-weighted against dedicated, then the GPU and CPU stages apart."""
    if rec["policy"] == "dedicated":
        return f"{rec['vs_dedicated']:g}×"
    return (f"{rec['vs_dedicated']:.2f}× ({rec[f'{GPU_STAGE}_vs_dedicated']:.2f}× / "
            f"{rec[f'{CPU_STAGE}_vs_dedicated']:.2f}×)")


def delay_cell(rec: dict[str, Any]) -> str:
    """Mean extra delay ± std over seeds, to three figures."""
    spread = rec["extra_delay_mean_s_spread"]
    if spread["mean"] == spread["std"] == 0:
        return "0 s"
    spec = ".2f" if spread["mean"] < 10 else ".1f"
    return f"{spread['mean']:{spec}} ± {spread['std']:{spec}} s"


def p99_cell(rec: dict[str, Any]) -> str:
    return "0 s" if rec["extra_delay_p99_s"] == 0 else f"{rec['extra_delay_p99_s']:.1f} s"


@filler
def reward_table(record: Records) -> str:
    """Each policy's cost-weighted worker-seconds, its cost against dedicated and its extra delay."""
    lines = ["| policy | cost-weighted worker-s | vs dedicated (GPU / CPU) | extra delay mean | p99 | DistRS |",
             "|---|---|---|---|---|---|"]
    for policy, rec in by_policy(record).items():
        label, paper, strong = POLICIES[policy]
        cells = [label, bold(worker_seconds_cell(rec), strong), bold(vs_dedicated_cell(rec), strong),
                 bold(delay_cell(rec), strong), p99_cell(rec), paper]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@filler
def reward_delay_ratio_outcome(record: Records) -> str:
    """Whether the timeout-aware / history-only delay target is met."""
    return outcome(record, "timeout_aware_over_history_delay")


@filler
def reward_delay_mean_outcome(record: Records) -> str:
    """Whether the mean extra delay target is met."""
    return outcome(record, "delay_mean_s")


@filler
def reward_fig14_outcome(record: Records) -> str:
    """Whether the EBF-over-FCFS (Fig. 14) target is met."""
    return outcome(record, "ebf_over_fcfs_gpus_fig14")


@filler
def reward_delay_by_seed(record: Records) -> str:
    """DistRS's mean extra delay per seed."""
    delays = [f"{r['extra_delay_mean_s']:.2f}" for r in by_policy(record)["ebf_timeout"]["runs"]]
    return ", ".join(delays[:-1]) + " and " + delays[-1]


def cost_shortfall(record: Records) -> float:
    cost = targets(record)["cost_vs_dedicated"]
    return cost["target"] - cost["value"]


@filler
def reward_cost_outcome(record: Records) -> str:
    """Whether the cost target is met, and by how much it is missed."""
    cost = targets(record)["cost_vs_dedicated"]
    if cost["met"]:
        return "met"
    return f"**missed by {cost_shortfall(record):.2f}×** ({100 * cost_shortfall(record) / cost['target']:.0f} %)"


@filler
def reward_cost_shortfall(record: Records) -> str:
    """How far the cost against dedicated is short of its target."""
    return f"{cost_shortfall(record):.2f}×"


def gpu_cost_share(record: Records) -> float:
    """The share of dedicated's cost-weighted worker-seconds spent on GPUs."""
    dedicated = by_policy(record)["dedicated"]
    gpu_cost = next(s["cost"] for s in dedicated["config"]["stages"] if s["name"] == GPU_STAGE)
    return gpu_cost * dedicated[f"{GPU_STAGE}_worker_seconds"] / dedicated["worker_seconds"]


@filler
def reward_gpu_cost_share(record: Records) -> str:
    """The percentage of dedicated's cost spent on GPUs."""
    return f"{100 * gpu_cost_share(record):.0f}"


@filler
def reward_paper_weighted(record: Records) -> str:
    """The paper's GPU and CPU savings weighted by our cost mix."""
    share = gpu_cost_share(record)
    weighted = 1 / (share / PAPER["dedicated_over_distrs_gpu"] + (1 - share) / PAPER["dedicated_over_distrs_cpu"])
    return f"{weighted:.2f}"


def sweep(record: Records, policy: str) -> dict[str, Any]:
    return by_policy(record)[policy]["fig14_sweep"]


@filler
def reward_fig14_ebf_gpus(record: Records) -> str:
    """The fewest GPUs with which EBF keeps the delay bound, per seed."""
    return "/".join(map(str, sweep(record, "ebf_timeout")["min_gpus"]))


@filler
def reward_fig14_fcfs_gpus(record: Records) -> str:
    """The fewest GPUs with which FCFS keeps the delay bound, per seed."""
    return "/".join(map(str, sweep(record, "fcfs")["min_gpus"]))


@filler
def reward_fig14_floor_gpus(record: Records) -> str:
    """The fewest GPUs with which any order could keep the delay bound, per seed."""
    return "/".join(map(str, sweep(record, "ebf_timeout")["any_order_floor_gpus"]))


@filler
def reward_fig14_ebf_above_floor(record: Records) -> str:
    """How far EBF's GPU count is above the any-order floor."""
    ebf = sweep(record, "ebf_timeout")
    above = max(e - f for e, f in zip(ebf["min_gpus"], ebf["any_order_floor_gpus"]))
    if above == 0:
        return "at that floor"
    return f"at that floor or {'one GPU' if above == 1 else f'{above} GPUs'} above it"


@filler
def reward_fig14_fcfs_over_floor(record: Records) -> str:
    """FCFS's GPU count over the any-order floor, the mean over seeds."""
    fcfs = sweep(record, "fcfs")
    return f"{statistics.fmean(g / f for g, f in zip(fcfs['min_gpus'], fcfs['any_order_floor_gpus'])):.2f}"


@filler
def reward_fcfs_delay_ratio(record: Records) -> str:
    """FCFS's mean extra delay over DistRS's."""
    policies = by_policy(record)
    return f"{policies['fcfs']['extra_delay_mean_s'] / policies['ebf_timeout']['extra_delay_mean_s']:.1f}"


@filler
def reward_plan_max_s(record: Records) -> str:
    """DistRS's longest plan, in seconds."""
    return f"{by_policy(record)['ebf_timeout']['plan_ms_max'] / 1000:.1f}"


@filler
def reward_plans_ratio(record: Records) -> str:
    """All plans over those on batch arrivals and completions only, the mean over DistRS's runs."""
    runs = by_policy(record)["ebf_timeout"]["runs"]
    return f"{statistics.fmean(r['plans'] / (r['plans'] - r['plans_on_long_running']) for r in runs):.0f}"


@filler
def reward_plans_range(record: Records) -> str:
    """The fewest and most plans in one of DistRS's runs."""
    plans = [r["plans"] for r in by_policy(record)["ebf_timeout"]["runs"]]
    return f"{min(plans)}–{max(plans)}"
