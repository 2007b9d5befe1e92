"""What a soak leaves: its record (the ``--json`` file, verdicts included) and its figure.

``build_record`` reads a finished ``Soak`` and each job's accounting.json, summary.json,
output and daemon logs (``log_problems``), with the code and machine it ran on
(``provenance``); ``plot`` draws the record (the ``--png`` file). The results page is
rendered from committed records by ``page.render``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.output import provenance
from rlfleet.tools.bench.soak.faults import fault_summary
from rlfleet.tools.bench.soak.runner import Soak
from rlfleet.tools.bench.soak.sampling import slim_step_lines
from rlfleet.tools.bench.soak.verdicts import (
    DROP_SHARE_LIMIT,
    DROP_SHARE_TASK,
    GROWTH_LIMIT,
    MIN_POINTS,
    WINDOW_S,
    growth_verdict,
)

JSON_DEFAULT = Path("runs/bench/soak.json")   # where --json writes the record (the PNG beside it)

def build_record(soak: Soak) -> dict[str, Any]:
    """What the ``--json`` file holds: the verdicts, the growth verdict per series and member,
    per job its accounting, drop share and log problems, the fault log and every sample."""
    from rlfleet.tools.bench.drops import WASTE, windows
    from rlfleet.tools.exit_codes import RUN_ENDED
    window_s = min(soak.args.window_min * 60, max(soak.duration_s / 6, 60.0))
    jobs = {}
    for job in soak.jobs:
        r: dict[str, Any] = {"task": job.task, "exit": job.exit, "run_dir": str(job.run_dir),
                             "output": str(job.out)}
        acc_path = job.run_dir / "accounting.json" if job.run_dir else None
        acc = json.loads(acc_path.read_text()) if acc_path and acc_path.exists() else None
        summ_path = job.run_dir / "summary.json" if job.run_dir else None
        r["summary"] = json.loads(summ_path.read_text()) if summ_path and summ_path.exists() else None
        r["accounting"] = acc
        r["accounting_ok"] = bool(acc and acc.get("ok") and job.exit in RUN_ENDED)
        if acc and acc.get("claimed"):
            dropped = Counter(acc.get("dropped", {}))
            r["drop_share"] = round(sum(dropped[k] for k in WASTE) / int(acc["claimed"]), 4)
        if job.run_dir is not None:
            r["windows"] = windows(slim_step_lines(job.run_dir / "metrics.jsonl"), soak.t0_unix, window_s,
                                   job.alpha)
            r["drop_share_by_window"] = [w["drop_share"] for w in r["windows"]]
            out = job.out.read_text(errors="replace") if job.out.exists() else ""
            r["restarts_logged"] = out.count("restarted ")
            r["journal_lines_skipped"] = out.count("unreadable, skipped")
            r["last_lines"] = out.splitlines()[-6:]
            r["log_problems"] = log_problems(job.run_dir / "logs")
        running = [x["jobs"][job.name] for x in soak.samples if x["jobs"][job.name]["running"]
                   and x["t"] <= min(soak.duration_s, soak.stopped_at)]
        r["longest_no_step_s"] = max((x["no_step_s"] for x in running), default=None)
        jobs[job.name] = r
    names = {j.name for j in soak.jobs}
    until = min(soak.duration_s, soak.stopped_at)
    growth = (growth_verdict(soak.samples, soak.args.sample_s, names, until) if soak.samples
              else {"ok": False, "why": "no samples"})
    etcd = growth_verdict(soak.samples, soak.args.sample_s, {"etcd"}, until) if soak.samples else {}
    arith = next((r for r in jobs.values() if r["task"] == DROP_SHARE_TASK), {})
    share = arith.get("drop_share")
    verdicts = {
        "accounting_ok_both": all(r["accounting_ok"] for r in jobs.values()),
        "no_growth": growth["ok"],
        "drop_share_arithmetic": share,
        "drop_share_ok": share is not None and share <= DROP_SHARE_LIMIT,
    }
    verdicts["ok"] = (verdicts["accounting_ok_both"] and verdicts["no_growth"] and verdicts["drop_share_ok"]
                      and soak.error is None)
    return {**provenance("rlfleet.tools.bench.soak"), "hours": soak.args.hours, "ran_s": round(soak.t(), 1),
            "stopped_early": soak.stop.is_set(), "error": soak.error, "work_dir": str(soak.work),
            "window_s": window_s,
            "limits": {"growth": GROWTH_LIMIT, "growth_window_s": WINDOW_S, "min_points": MIN_POINTS,
                       "drop_share": DROP_SHARE_LIMIT, "drop_share_task": DROP_SHARE_TASK},
            "verdicts": verdicts, "growth": growth, "etcd_growth_not_judged": etcd, "jobs": jobs,
            "fault_summary": fault_summary(soak.faults), "faults": soak.faults, "samples": soak.samples}


def log_problems(log_dir: Path, top: int = 8) -> dict[str, dict[str, int]]:
    """Per daemon log: its warning and error records counted by event (or the message's
    start), the most frequent first; torn lines counted as "unparsable line"."""
    out = {}
    for path in sorted(log_dir.glob("*.log")):
        counts: Counter[str] = Counter()
        with open(path, errors="replace") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    counts["unparsable line"] += 1
                    continue
                if isinstance(rec, dict) and rec.get("level") in ("warning", "error", "critical"):
                    what = rec.get("event") or re.sub(r"\d+", "N", str(rec.get("msg", "")))[:80]  # ids alike
                    counts[f"{rec['level']}: {what}"] += 1
        if counts:
            out[path.stem] = dict(counts.most_common(top))
    return out


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    series: dict[str, list[tuple[float, float, float]]] = {}
    for s in record["samples"]:
        for p in s["procs"]:
            series.setdefault(f"{p['job']}/{p['label']}|{p['pid']}", []).append(
                (s["t"] / 60, p["rss_kb"] / 1024, p["fds"]))
    colors: dict[str, Any] = {}
    cmap = plt.get_cmap("tab20")
    for key, pts in series.items():
        member = key.split("|")[0]
        first = member not in colors
        colors.setdefault(member, cmap(len(colors) % 20))
        t, rss, fds = zip(*pts)
        axes[0].plot(t, rss, color=colors[member], lw=1, label=member if first else None)
        axes[1].plot(t, fds, color=colors[member], lw=1)
    for name, job in record["jobs"].items():
        ws = [w for w in job.get("windows", []) if w["drop_share"] is not None]
        if ws:  # each window drawn over its width
            x = [w["start_min"] for w in ws] + [ws[-1]["start_min"] + record["window_s"] / 60]
            y = [100 * w["drop_share"] for w in ws]
            axes[2].step(x, y + y[-1:], where="post", label=name)
    if w := record["growth"].get("window_s"):
        end = record["growth"]["run_end_s"]
        for ax in axes[:2]:  # the growth verdict's windows
            ax.axvspan(w / 60, 2 * w / 60, color="tab:green", alpha=0.08)
            ax.axvspan((end - w) / 60, end / 60, color="tab:green", alpha=0.08)
    style = {"kill": ("grey", ":"), "etcd_down": ("tab:orange", "--"), "etcd_up": ("tab:orange", ":"),
             "disk_fill": ("tab:red", "--"), "disk_free": ("tab:red", ":")}
    for ax in axes:
        for f in record["faults"]:
            color, ls = style.get(f["kind"], ("black", ":"))
            ax.axvline(f["t"] / 60, color=color, ls=ls, lw=0.8, alpha=0.7)
    axes[0].set_ylabel("RSS (MiB) per daemon process")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    axes[1].set_ylabel("open fds per daemon process")
    axes[2].set_ylabel("drop share per window (%)")
    axes[2].set_xlabel("minutes since start (faults: grey kill -9, orange etcd member, red disk full; "
                       "green: the growth verdict's windows)")
    axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    v = record["verdicts"]
    fig.suptitle(f"soak {record['hours']} h: accounting ok both {v['accounting_ok_both']}, no growth {v['no_growth']}, "
                 f"arithmetic drop share {v['drop_share_arithmetic']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
