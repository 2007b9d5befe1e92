"""Fillers of docs/results/scale.md: the multi-rank megatron trainer on the Qwen2-0.5B shape
(tools/bench/results/scale_qwen2-0.5b_tp2.json, written by tools/bench/scale.py)."""

from __future__ import annotations

from rlfleet.tools.bench.pages import Records, filler

RECORD = "scale_qwen2-0.5b_tp2.json"


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


@filler
def scale_runs_table(record: Records, name: str = RECORD) -> str:
    """Every run: each stage's seconds (a step and a publication: the slowest rank), the
    rollout load, and each rank's peak RSS; a void run with its reason."""
    rows = []
    for run in record(name)["runs"]:
        if not run["ok"]:
            rows.append([str(run["run"] + 1), "void: " + run["error"][:160].replace("|", "/"), "", "", "", "", ""])
            continue
        ranks = sorted(run["ranks"], key=lambda r: r["rank"])
        rows.append([
            str(run["run"] + 1),
            f"{max(r['first_step_s'] for r in ranks):.1f}",
            f"{max(r['step_s'] for r in ranks):.1f}",
            f"{max(r['published']['float32']['publish_s'] for r in ranks):.2f}",
            f"{max(r['published']['bfloat16']['publish_s'] for r in ranks):.2f}",
            f"{run['rollout']['load_s']:.2f}",
            " / ".join(f"{r['peak_rss_mib']:,}" for r in ranks),
        ])
    return _table(["run", "first step s", "step s", "publish s (float32)", "publish s (bfloat16)",
                   "rollout load s", "peak RSS MiB per rank"], rows)


@filler
def scale_bytes_ratio(record: Records, name: str = RECORD) -> str:
    """bfloat16's published bytes over float32's."""
    published = record(name)["published_bytes"]
    return f"{published['bfloat16'] / published['float32']:.3f}"


@filler
def scale_peak_rss(record: Records, name: str = RECORD) -> str:
    """Each rank's peak RSS (the largest over the runs), in MiB."""
    return " / ".join(f"{m:,}" for m in record(name)["peak_rss_mib"])


@filler
def scale_model_bytes(record: Records, name: str = RECORD) -> str:
    """The model's parameters in bfloat16, in bytes."""
    return f"{record(name)['model_params'] * 2:,}"


@filler
def scale_joined_bytes(record: Records, name: str = RECORD) -> str:
    """The version the rollout loaded (the first run that completed), in bytes."""
    return f"{next(r for r in record(name)['runs'] if r['ok'])['rollout']['bytes']:,}"


@filler
def scale_commit(record: Records, name: str = RECORD) -> str:
    """The record's commit, short."""
    return record(name)["commit"][:7]
