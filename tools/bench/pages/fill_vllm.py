"""Fillers of docs/results/vllm.md: the vLLM engine against the torch engine
(tools/bench/results/vllm.json, a float32 and a bfloat16 run) and their learning runs
(tools/bench/results/learning_vllm.json)."""

from __future__ import annotations

from typing import Any

from rlfleet.tools.bench.pages import Records, filler, span

ENGINES = "vllm.json"
LEARNING = "learning_vllm.json"
TASKS = {"vllm": "arithmetic-vllm", "torch": "arithmetic"}  # learning_vllm.json's task per engine
BF16 = "vllm-bfloat16"  # the vLLM engine's name in the bfloat16 run


def small(x: float) -> str:
    """Two significant digits, as 0.041 down to 0.01 and as 1.3e-3 below ("9e-8", not "9.0e-08")."""
    if x == 0 or abs(x) >= 0.01:
        return f"{x:.2g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def start(seconds: float) -> str:
    return "< 1 s" if seconds < 1 else f"{seconds:.0f} s"


def capped(fraction: float) -> str:
    return "none capped" if fraction == 0 else f"{fraction:.1%} capped"


def runs(record: Records, engine: str) -> list[dict[str, Any]]:
    """The learning runs of ``engine`` ("vllm" or "torch"), one per seed."""
    return [r for r in record(LEARNING)["records"] if r["task"] == TASKS[engine]]


def mismatch(record: Records, dtype: str, engine: str) -> dict[str, float]:
    return record(ENGINES)[dtype]["logprob_mismatch"][engine]


def tokens_row(record: Records) -> list[str]:
    run = record(ENGINES)["float32"]
    label = (f"tokens/s, {' / '.join(run['tokens_per_s']['vllm'])} requests ({run['prompt_len']}-token prompts, "
             f"{run['new_tokens']} sampled tokens, best of {run['repeats']})")
    return [label] + [" / ".join(f"{v:,.0f}" for v in run["tokens_per_s"][e].values()) for e in ("vllm", "torch")]


def load_row(record: Records) -> list[str]:
    loads = record(ENGINES)["float32"]["load_version_s"]
    return ["time to load a version (full state dict, median of 5)", ms(loads["vllm"]), ms(loads["torch"])]


def logprob_row(record: Records) -> list[str]:
    f32, bf16, torch = (mismatch(record, "float32", "vllm"), mismatch(record, "bfloat16", BF16),
                        mismatch(record, "float32", "torch"))
    tokens = " and ".join(dict.fromkeys(str(m["tokens"]) for m in (f32, torch)))

    def diffs(m: dict[str, float]) -> str:
        return f"{small(m['mean_abs_logprob_diff'])} / {small(m['max_abs_logprob_diff'])}"

    return [f"log-prob vs the trainer's recomputation, mean / max abs difference ({tokens} sampled tokens)",
            f"{diffs(f32)} (bfloat16 vLLM: {diffs(bf16)})", diffs(torch)]


def ratio_row(record: Records) -> list[str]:
    f32, bf16, torch = (mismatch(record, "float32", "vllm"), mismatch(record, "bfloat16", BF16),
                        mismatch(record, "float32", "torch"))

    def deviations(m: dict[str, float]) -> str:
        return f"{small(m['ratio_abs_dev_mean'])} / {small(m['tis_abs_dev_mean'])}"

    return ["importance ratio trainer / engine: mean abs deviation from 1, without / with TIS (cap 2)",
            f"{deviations(f32)}, {capped(f32['tis_capped_fraction'])} (bfloat16: {deviations(bf16)}, "
            f"max ratio {bf16['ratio_max']:.3f}, {capped(bf16['tis_capped_fraction'])})", deviations(torch)]


def success_row(record: Records) -> list[str]:
    vllm = runs(record, "vllm")
    label = (f"arithmetic, {span([r['steps'] for r in vllm], ',d', sep='-')} steps, held-out success (greedy, 128), "
             f"{len(vllm)} seeds")

    def success(rs: list[dict[str, Any]]) -> str:
        finals = " / ".join(format(r["final"], ".3f") for r in rs)
        return f"{span([r['first'] for r in rs], '.3f', sep='-')} → {finals}"

    return [label, success(vllm), success(runs(record, "torch"))]


def wall_row(record: Records) -> list[str]:
    def walls(rs: list[dict[str, Any]]) -> str:
        return f"{span([r['run_wall_s'] for r in rs], sep='-')} s / {span([r['cpu_s']['rollout-0'] for r in rs], sep='-')} s"

    return ["wall time of those runs / rollout CPU seconds", walls(runs(record, "vllm")), walls(runs(record, "torch"))]


def start_row(record: Records) -> list[str]:
    f32, bf16 = record(ENGINES)["float32"]["start_s"], record(ENGINES)["bfloat16"]["start_s"]
    return ["engine start-up (import included)", f"{start(f32['vllm'])} (bfloat16: {start(bf16['vllm'])})",
            start(f32["torch"])]


@filler
def vllm_table(record: Records) -> str:
    """The table: vLLM against torch, engine figures then learning runs."""
    rows = [fn(record) for fn in (tokens_row, load_row, logprob_row, ratio_row, success_row, wall_row, start_row)]
    return "\n".join(["| | vLLM engine | torch engine |", "|---|---|---|"] + [f"| {' | '.join(r)} |" for r in rows])


@filler
def vllm_slowdown(record: Records) -> str:
    """How many times fewer tokens/s vLLM makes than torch, lowest-highest over the batch sizes."""
    tps = record(ENGINES)["float32"]["tokens_per_s"]
    return span([tps["torch"][b] / v for b, v in tps["vllm"].items()], ".1f", sep='-')


@filler
def vllm_rollout_cpu_ratio(record: Records) -> str:
    """The rollout's CPU seconds with vLLM over those with torch, all seeds together."""
    cpu = {e: sum(r["cpu_s"]["rollout-0"] for r in runs(record, e)) for e in TASKS}
    return f"{cpu['vllm'] / cpu['torch']:.0f}"


@filler
def vllm_float32_max_logprob_diff(record: Records) -> str:
    """The largest log-prob difference of float32 vLLM from the trainer."""
    return small(mismatch(record, "float32", "vllm")["max_abs_logprob_diff"])


@filler
def vllm_bfloat16_mean_logprob_diff(record: Records) -> str:
    """The mean log-prob difference of bfloat16 vLLM from the trainer."""
    return small(mismatch(record, "bfloat16", BF16)["mean_abs_logprob_diff"])
