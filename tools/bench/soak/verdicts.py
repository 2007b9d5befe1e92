"""The soak's verdicts, fixed before measuring (the package docstring states them).

Pure functions over the samples and the metrics lines: the growth verdict per process
series (``judge_series``), per member and overall (``growth_verdict``), and the drop
counts the drop-share verdict and the progress lines read (``drop_counts``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

GROWTH_LIMIT = 0.10          # final median at most 10% above baseline
DROP_SHARE_LIMIT = 0.03
DROP_SHARE_TASK = "arithmetic"   # the job whose drop share is judged
WINDOW_S = 900.0             # the growth verdict's window (a quarter of a shorter run)
MIN_POINTS = 3               # samples a window needs to give a median
METRICS = ("rss_kb", "fds", "tree_rss_kb")


def verdict_window_s(run_s: float) -> float:
    return min(WINDOW_S, run_s / 4)


def judge_series(points: list[tuple[float, float]], run_end_s: float, w: float, slack_s: float,
                 limit: float = GROWTH_LIMIT) -> dict[str, Any]:
    """One series' growth verdict (see the package docstring). ``points``: (seconds since
    the soak's start, value), in time order; ``slack_s``: one sample interval (a series
    first sampled within it of a window's start covers that window)."""
    s, e = points[0][0], points[-1][0]
    if s <= w + slack_s and e >= run_end_s - slack_s:
        how, base_at, final_at = "run", (w, 2 * w), (run_end_s - w, run_end_s)
    elif e - s >= 3 * w:
        how, base_at, final_at = "own life", (s + w, s + 2 * w), (e - w, e)
    else:
        return {"judged": False, "why": f"short: lived {e - s:.0f} s, from {s:.0f} s to {e:.0f} s"}
    base = [v for t, v in points if base_at[0] <= t < base_at[1]]
    final = [v for t, v in points if final_at[0] <= t <= final_at[1]]
    if len(base) < MIN_POINTS or len(final) < MIN_POINTS:
        return {"judged": False, "why": f"{len(base)} baseline and {len(final)} final samples (< {MIN_POINTS})"}
    b, f = statistics.median(base), statistics.median(final)
    growth = (f - b) / b if b > 0 else (0.0 if f <= 0 else float("inf"))
    return {"judged": True, "windows": how, "baseline": b, "final": f, "growth": round(growth, 4),
            "ok": growth <= limit}


def growth_verdict(samples: list[dict[str, Any]], sample_s: float, jobs: set[str] | None = None,
                   until_s: float | None = None) -> dict[str, Any]:
    """Verdict 2 over the samples' process rows (of ``jobs``; None: all) up to ``until_s``
    (the runs' duration: not the daemons stopping): per series and metric, per member, overall."""
    samples = [x for x in samples if until_s is None or x["t"] <= until_s]
    series: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        for p in sample["procs"]:
            if jobs is None or p["job"] in jobs:
                series.setdefault(f"{p['job']}/{p['label']}/{p['pid']}", []).append({**p, "t": sample["t"]})
    if not series:
        return {"ok": False, "why": "no process was sampled"}
    run_end = samples[-1]["t"]
    w = verdict_window_s(run_end)
    per_series, per_member = {}, {}
    for key, rows in series.items():
        judged = {m: judge_series([(r["t"], r[m]) for r in rows if r.get(m) is not None], run_end, w, sample_s)
                  for m in METRICS if any(r.get(m) is not None for r in rows)}
        per_series[key] = judged
        member = per_member.setdefault(key.rsplit("/", 1)[0], {"series": 0, "judged": 0, "ok": True})
        member["series"] += 1
        if any(j["judged"] for j in judged.values()):
            member["judged"] += 1
        member["ok"] = member["ok"] and all(j.get("ok", True) for j in judged.values())
    failed = sorted(f"{k} {m} +{j['growth']:.1%}" for k, js in per_series.items()
                    for m, j in js.items() if j.get("ok") is False)
    return {"ok": not failed, "window_s": w, "run_end_s": run_end, "failed": failed,
            "members_not_judged": sorted(k for k, v in per_member.items() if not v["judged"]),
            "per_member": per_member, "per_series": per_series}


def drop_counts(line: dict[str, Any]) -> tuple[int, int]:
    """(waste, consumed) so far from a training line of metrics.jsonl (tools/bench/drops.py)."""
    from rlfleet.tools.bench.drops import WASTE
    dropped = Counter({k: int(v) for k, v in (line.get("dropped") or {}).items()})
    return sum(dropped[k] for k in WASTE), int(line.get("trained_groups", 0)) + sum(dropped.values())
