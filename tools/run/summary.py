"""What `rlfleet run` says about training, as plain text: the progress line (live view
and plain event lines alike), one line per evaluation, and the summary at the end.

Pure functions of the run's records (metrics.jsonl, the accounting result, the
supervisor's restart counts), so the end summary is checked against a golden file
(tests/tools/run/test_summary.py) and reads the same in a terminal, a pipe or a log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfleet.tools.run.report import RunMetrics, summary

LABEL_WIDTH = 18


def staleness_text(hist: dict[int, int]) -> str:
    return "  ".join(f"{k}: {v:,}" for k, v in sorted(hist.items())) or "—"


def progress_line(m: RunMetrics, max_steps: int) -> str:
    if not m.train and not m.evals:
        return "training: waiting for the first step"
    last = m.train[-1] if m.train else {}
    ev = m.evals[-1]["eval_success"] if m.evals else None
    return (f"step {last.get('step', 0)}/{max_steps}   reward {last.get('reward_mean', 0.0):.3f}   "
            f"eval success {'—' if ev is None else f'{ev:.3f}'}   "
            f"{last.get('tokens_per_s', 0.0):.0f} tok/s   staleness {staleness_text(m.staleness())}")


def eval_line(m: RunMetrics, index: int = -1) -> str:
    """Evaluation `index` (default the newest), against the first and the best up to it."""
    upto = m.evals[:index + 1] if index >= 0 else m.evals[:len(m.evals) + index + 1]
    ev = upto[-1]
    first, best = upto[0]["eval_success"], max(r["eval_success"] for r in upto)
    return (f"evaluation at step {ev['step']}: held-out success {ev['eval_success']:.3f} "
            f"(first {first:.3f}, best {best:.3f})")


def _row(label: str, value: str) -> str:
    return f"  {label:<{LABEL_WIDTH}}{value}"


def accounting_text(acc: dict[str, Any] | None) -> str:
    if acc is None:
        return "not checked"
    dropped = ", ".join(f"{reason} {n:,}" for reason, n in sorted(acc.get("dropped", {}).items()))
    parts = (f"{acc['claimed']:,} prompts claimed = {acc['trained']:,} trained + "
             f"{acc['dropped_total']:,} dropped{f' ({dropped})' if dropped else ''} + "
             f"{acc['in_flight']:,} in flight")
    if acc["ok"]:
        return f"ok: {parts}"
    return (f"BROKEN: {acc['lost_total']:,} lost, {len(acc.get('conflicts', [])):,} trained and dropped; "
            f"{parts}")


def end_summary(m: RunMetrics, *, job: str, max_steps: int, headline: str, run_dir: Path,
                accounting: dict[str, Any] | None, restarts: dict[str, int],
                cpu_s: dict[str, float], plots: list[Path]) -> str:
    """The final screen: what the run did, first the learning, then the machinery."""
    s = summary(m)
    lines = [f"== {job}: {headline} =="]
    if m.train:
        lines.append(_row("steps", f"{s['steps']:,} of {max_steps:,} in {s['wall_s']:.1f} s "
                                   f"(first to last metrics line)"))
    else:
        lines.append(_row("steps", f"none of {max_steps:,} trained"))
    if m.evals:
        lines.append(_row("held-out success",
                          f"{s['eval_success_first']:.3f} → {s['eval_success_last']:.3f} "
                          f"(best {s['eval_success_best']:.3f}; {len(m.evals)} evaluations)"))
    if m.train:
        rate = s.get("trained_tokens_per_s")
        lines.append(_row("trained", f"{s['trained_trajectories']:,} trajectories, "
                                     f"{s['trained_tokens']:,} tokens"
                                     + (f", {rate:,.1f} tokens/s end to end" if rate is not None else "")))
        lines.append(_row("staleness", f"{staleness_text(s['staleness'])}   (versions behind: trajectories)"))
    restarted = {name: n for name, n in sorted(restarts.items()) if n}
    lines.append(_row("restarts", ", ".join(f"{name} {n}" for name, n in restarted.items()) or "none"))
    lines.append(_row("accounting", accounting_text(accounting)))
    if cpu_s:
        lines.append(_row("CPU seconds", "  ".join(f"{name} {v:.1f}" for name, v in cpu_s.items())))
    lines.append(_row("results", f"{run_dir}/ (metrics.jsonl, summary.json, accounting.json)"))
    if plots:
        lines.append(_row("plots", ", ".join(str(p) for p in plots)))
    lines.append(_row("logs", f"{run_dir / 'logs'}/ (one JSON log per daemon)"))
    return "\n".join(lines)
