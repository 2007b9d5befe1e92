"""Drops in long runs: does the share of generated work thrown away stay low over time?

Runs the shipped examples long (`rlfleet run`, every daemon on this machine, max_steps
lifted so that only ``--minutes`` ends the run), one run after the other, and reads
each run's metrics.jsonl, accounting.json and daemon logs:

    python -m rlfleet.tools.bench.drops --minutes 30 --tasks arithmetic,frozenlake \\
        --runs 3 --out tools/bench/results
    python -m rlfleet.tools.bench.drops --minutes 30 --tasks arithmetic --runs 3 \\
        --arm base --arm unpaced:env_host.pace_for_lag=false --out tools/bench/results
    python -m rlfleet.tools.bench.drops --render    # docs/results/drops.md from the records

writes OUT/drops-<task>.json per task: ``task``, ``minutes``, ``drop_share`` (the mean of
the runs), ``drop_share_by_window`` (per window, the mean of the runs), every run. With
``--arm TAG[:SECTION.KEY=VALUE;...]`` (repeated) the settings are compared side by side:
the arms take turns within each run number (base 0, lag 0, base 1, ...), so a noisy stretch
of the shared machine hurts every arm alike, and each arm has its record
OUT/drops-<task>-<TAG>.json naming the others (``side_by_side``). An arm without settings
runs the defaults of its commit: the `base` of drops-arithmetic-base.json ran with
``env_host.pace_for_lag`` false, the default until this benchmark's runs made it true.

The figure is the **drop share**: groups dropped for ``staleness`` or ``buffer_full``
(generation that was paid for and thrown away by the bound) over the prompts claimed
(accounting.json), overall and per ``--window-min`` window. Per window the denominator
is the groups the trainer consumed in it (trained + dropped for any reason): in a steady
run that is the prompts claimed in it, and the windows of a run add up to its total.
FrozenLake's ``no_signal`` filtering is counted apart (``no_signal_share``): it is a
choice of the recipe, not waste of the bound. The validity rule, fixed before measuring:
a run counts when it ended by its duration with the accounting invariant holding (exit
0 or the duration's stop, accounting ok); a run that did not is kept in the record,
void, with its reason.

Also per window, to find a cause: steps, consumed groups, the trainer's wait for data,
the mean buffer (pending groups at each step), the staleness histogram of what was
trained and the share of it at the bound (``at_bound``: pinned there means the bound
is what decides), and per run the env-hosts' ``pacing_stall`` write-offs.

Target (issue 28), fixed before the runs that judge it: on arithmetic, every valid run
drops at most 3% (``DROP_SHARE_LIMIT``) and none is **pinned**. A run is pinned when, over
its full windows (the last, cut short by the stop, is shown but not judged), the median
share of what was trained at the bound is above one half (``PIN_SHARE``): most of the
training then sits where one more version of lag drops it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.output import provenance, write_json
from rlfleet.tools.bench.spec_variants import apply_overrides, parse_override, write_variant
from rlfleet.tools.exit_codes import RUN_ENDED

WASTE = ("staleness", "buffer_full")  # drops the bound made: paid-for generation thrown away
DROP_SHARE_LIMIT = 0.03
PIN_SHARE = 0.5        # pinned: the median full window trains more than this share at the bound
TARGET_TASK = "arithmetic"


def spec_for(examples: Path, task: str, run: int, settings: dict[str, Any] | None = None) -> Path:
    """The example with max_steps lifted (the duration ends the run), a job name of its
    own and ``settings`` ({"section.key": value}, from --set) applied."""
    def change(spec: dict[str, Any]) -> None:
        spec["job"]["name"] = f"{spec['job']['name']}-drops{run}"
        spec["trainer"]["max_steps"] = 10**7
        apply_overrides(spec, settings)
    return write_variant(examples / f"{task}.toml", f"drops{run}", change)


def windows(lines: list[dict[str, Any]], t0: float, window_s: float, alpha: int | None) -> list[dict[str, Any]]:
    """Per window of ``window_s`` from ``t0``: what the step lines ending in it say."""
    out: list[dict[str, Any]] = []
    prev_dropped: Counter[str] = Counter()
    prev_consumed = 0
    by_window: dict[int, list[dict[str, Any]]] = {}
    span = lines[-1]["time"] - t0 if lines else 0.0
    for line in lines:
        by_window.setdefault(int((line["time"] - t0) // window_s), []).append(line)
    for w in sorted(by_window):
        rows = by_window[w]
        last = rows[-1]
        dropped = Counter({k: int(v) for k, v in (last.get("dropped") or {}).items()})
        consumed = int(last.get("trained_groups", 0)) + sum(dropped.values())
        d_dropped = dropped - prev_dropped
        d_consumed = consumed - prev_consumed
        ages: Counter[int] = Counter()
        for r in rows:
            ages.update({int(k): int(v) for k, v in (r.get("staleness") or {}).items()})
        waste = sum(d_dropped[k] for k in WASTE)
        out.append({"window": w, "start_min": round(w * window_s / 60, 1), "full": (w + 1) * window_s <= span,
                    "steps": len(rows),
                    "consumed": d_consumed, "dropped": dict(d_dropped),
                    "drop_share": round(waste / d_consumed, 4) if d_consumed else None,
                    "no_signal_share": round(d_dropped["no_signal"] / d_consumed, 4) if d_consumed else None,
                    "wait_s": round(sum(r.get("wait_s", 0.0) for r in rows), 1),
                    "buffer_mean": round(statistics.fmean(r.get("pending_groups", 0) for r in rows), 2),
                    "staleness": dict(sorted(ages.items())),
                    "at_bound": round(ages[alpha] / sum(ages.values()), 3)
                    if alpha is not None and ages else None})
        prev_dropped, prev_consumed = dropped, consumed
    return out


def run_once(examples: Path, task: str, run: int, minutes: float, window_min: float,
             settings: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = spec_for(examples, task, run, settings)
    import tomllib
    alpha = tomllib.loads(spec.read_text()).get("trainer", {}).get("max_staleness")
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view", "--duration", str(minutes * 60)]
    load_before = os.getloadavg()[0]
    started = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        spec.unlink(missing_ok=True)
    run_dir = next((Path(line.split("run dir:", 1)[1].strip()) for line in proc.stdout.splitlines()
                    if line.startswith("run dir:")), None)
    record: dict[str, Any] = {"task": task, "run": run, "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                                time.localtime(started)),
                              "exit": proc.returncode, "run_dir": str(run_dir),
                              "load_1m_before": round(load_before, 2), "load_1m_after": round(os.getloadavg()[0], 2)}
    accounting = run_dir / "accounting.json" if run_dir else None
    if proc.returncode not in RUN_ENDED or accounting is None or not accounting.exists():
        record["void"] = f"rlfleet run exited {proc.returncode}: {proc.stdout[-300:]} {proc.stderr[-300:]}"
        return record
    acc = json.loads(accounting.read_text())
    if not acc.get("ok", True):
        record["void"] = f"accounting broken: {acc.get('lost')}"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "loss" in x]
    dropped = Counter(acc.get("dropped", {}))
    claimed = int(acc["claimed"])
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    record.update({
        "minutes": minutes, "alpha": alpha, "steps": steps[-1]["step"] if steps else 0, "claimed": claimed,
        "trained": acc.get("trained"), "dropped": dict(dropped),
        "drop_share": round(sum(dropped[k] for k in WASTE) / claimed, 4) if claimed else None,
        "no_signal_share": round(dropped["no_signal"] / claimed, 4) if claimed else None,
        "pacing_stalls": logs.count('"event": "pacing_stall"'),
        "windows": windows(steps, started, window_min * 60, alpha),
    })
    record["drop_share_by_window"] = [w["drop_share"] for w in record["windows"]]
    return record


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """TAG or TAG:SECTION.KEY=VALUE[;SECTION.KEY=VALUE...]: one arm of a side-by-side
    comparison; for argparse."""
    tag, _, settings = text.partition(":")
    if not tag or not all(c.isalnum() or c in "-_" for c in tag):
        raise argparse.ArgumentTypeError(f"an arm's tag is letters, digits, '-' or '_', got {tag!r} in {text!r}")
    return tag, dict(parse_override(s) for s in settings.split(";") if s.strip())


def full_windows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The windows the stop did not cut short (records before ``full`` was kept: all but the last)."""
    ws = run.get("windows") or []
    return [w for i, w in enumerate(ws) if w.get("full", i < len(ws) - 1)]


def at_bound_median(run: dict[str, Any]) -> float | None:
    shares = [w["at_bound"] for w in full_windows(run) if w.get("at_bound") is not None]
    return round(statistics.median(shares), 3) if shares else None


def pinned(run: dict[str, Any]) -> bool | None:
    median = at_bound_median(run)
    return None if median is None else median > PIN_SHARE


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in dict.fromkeys(r["task"] for r in records):
        valid = [r for r in records if r["task"] == task and "void" not in r]
        shares = [r["drop_share"] for r in valid]
        last_full = [full_windows(r)[-1]["drop_share"] for r in valid if full_windows(r)]
        out[task] = {"runs": len(valid), "void": sum(1 for r in records if r["task"] == task and "void" in r),
                     "drop_share_mean": round(statistics.fmean(shares), 4) if shares else None,
                     "drop_share_max": max(shares) if shares else None,
                     "last_full_window_max": max((x or 0.0 for x in last_full), default=None),
                     "pinned_runs": sum(1 for r in valid if pinned(r)),
                     "target_met": bool(valid) and max(shares) <= DROP_SHARE_LIMIT
                     and not any(pinned(r) for r in valid)}
    return out


PAGE = Path(__file__).resolve().parents[2] / "docs" / "results" / "drops.md"
RECORDS = Path(__file__).resolve().parent / "results"


def render(records: list[dict[str, Any]]) -> str:
    """docs/results/drops.md from the committed drops-*.json records (never typed by hand:
    tests/tools/bench/test_drops.py checks the page is this function's output)."""
    out = ["# Drops in long runs (issue 28, part 3)", "",
           "Generated by `python -m rlfleet.tools.bench.drops --render` from "
           "`tools/bench/results/drops-*.json`; the method is the docstring of `tools/bench/drops.py`.",
           "The drop share is the groups dropped for `staleness` or `buffer_full` over the prompts "
           f"claimed. Target: on {TARGET_TASK}, every run at most {DROP_SHARE_LIMIT:.0%} over 30 minutes and "
           f"none pinned (a run is pinned when the median of its full windows trains more than "
           f"{PIN_SHARE:.0%} of its trajectories at the bound; the last window, cut short by the stop, "
           "is shown in brackets and not judged).", ""]
    for rec in records:
        out += [f"## {rec['task']}, {rec['minutes']:g} minutes per run", "",
                f"`{rec['command']}` at `{rec['commit'][:10]}` on {rec['machine']}, {rec['date']}."
                + (f" Uncommitted changes in: {', '.join(rec['uncommitted_changes'])}."
                   if rec.get("uncommitted_changes") else "")
                + (f" Spec settings: {', '.join(f'`{k} = {v}`' for k, v in rec['settings'].items())}."
                   if rec.get("settings") else "")
                + (f" Note: {rec['note']}" if rec.get("note") else "")
                + (f" Side by side with {', '.join(f'`{t}`' for t in rec['side_by_side'])} (the arms took "
                   "turns in each run number)." if rec.get("side_by_side") else "")
                + "".join(f" Runs added by `{c['command']}` at `{c['commit'][:10]}`, {c['date']}."
                          for c in rec.get("later_commands", []))
                + (f" Incomplete: the bench stopped after {len(rec['runs'])} run(s) of those its command asked for."
                   if rec.get("complete") is False else ""), "",
                "| run | steps | claimed | drop share | by window | at the bound (median of full windows) | "
                "pinned | pacing stalls | load before / after | |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rec["runs"]:
            if "void" in r:
                out.append(f"| {r['run']} | | | | | | | | | void: {r['void'][:120]} |")
                continue
            full = {w["window"] for w in full_windows(r)}
            windows = ", ".join(("–" if w["drop_share"] is None else f"{w['drop_share']:.1%}")
                                if w["window"] in full else f"[{w['drop_share'] or 0:.1%}]" for w in r["windows"])
            median, pin = at_bound_median(r), pinned(r)
            at = r.get("commit", rec["commit"])
            out.append(f"| {r['run']} | {r['steps']:,} | {r['claimed']:,} | **{r['drop_share']:.2%}** | "
                       f"{windows} | {'–' if median is None else f'{median:.1%}'} | "
                       f"{'–' if pin is None else 'yes' if pin else 'no'} | {r['pacing_stalls']} | "
                       f"{r['load_1m_before']} / {r['load_1m_after']} |"
                       f"{' ' if at == rec['commit'] else f' at `{at[:10]}` '}|")
        no_signal = [r.get("no_signal_share") or 0 for r in rec["runs"] if "void" not in r]
        if any(no_signal):
            out += ["", "Counted apart, not as drops: groups filtered for no signal (every reward of the "
                        "group equal, so no advantage to learn from), per run: "
                        + ", ".join(f"{x:.1%}" for x in no_signal) + " of the prompts claimed."]
        s = summarise(rec["runs"])[rec["task"]]  # judged by today's rule, whatever the record kept
        if s["runs"]:
            verdict = "meets" if s["target_met"] else "misses"
            out += ["", f"Mean drop share {s['drop_share_mean']:.2%} over {s['runs']} valid run(s) "
                        f"({s['void']} void), worst {s['drop_share_max']:.2%}, {s['pinned_runs']} pinned: "
                        f"{verdict} the target" + ("" if rec["task"] == TARGET_TASK else
                                                   f" (judged on {TARGET_TASK} only)") + ".", ""]
        else:
            out += ["", f"No valid run ({s['void']} void).", ""]
    out += side_by_side(records)
    return "\n".join(out)


def side_by_side(records: list[dict[str, Any]]) -> list[str]:
    """Per comparison (records of one task whose arms name each other) and run number, each
    arm's steps, drop share and share at the bound, and each arm's steps over the first
    arm's in that run number (the arms took turns, so a noisy stretch hurts both alike)."""
    groups: dict[tuple[str, frozenset[str]], dict[str, dict[str, Any]]] = {}
    for rec in records:
        if rec.get("tag") and rec.get("side_by_side"):
            arms = frozenset([rec["tag"], *rec["side_by_side"]])
            groups.setdefault((rec["task"], arms), {})[rec["tag"]] = rec
    out: list[str] = []
    for (task, arms), by_tag in sorted(groups.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
        if set(by_tag) != set(arms):
            continue  # an arm's record is not committed: no comparison yet
        tags = sorted(arms, key=lambda t: (t != "base", t))  # the base arm first
        runs = {t: {r["run"]: r for r in by_tag[t]["runs"] if "void" not in r} for t in tags}
        numbers = sorted(set.intersection(*(set(r) for r in runs.values())))
        out += [f"## Side by side on {task}: {', '.join(f'`{t}`' for t in tags)}", "",
                "Each run number ran every arm, one after the other; a run void in any arm leaves its "
                "number out. Steps relative to `" + tags[0] + "` in the same run number.", "",
                "| run | " + " | ".join(f"`{t}` steps, drop share, at the bound" for t in tags)
                + "".join(f" | `{t}` steps ÷ `{tags[0]}`" for t in tags[1:]) + " |",
                "|---|" + "---|" * (2 * len(tags) - 1)]
        ratios: dict[str, list[float]] = {t: [] for t in tags[1:]}
        for n in numbers:
            cells = []
            for t in tags:
                r = runs[t][n]
                median = at_bound_median(r)
                cells.append(f"{r['steps']:,}, {r['drop_share']:.2%}, {'–' if median is None else f'{median:.1%}'}")
            for t in tags[1:]:
                ratio = runs[t][n]["steps"] / runs[tags[0]][n]["steps"]
                ratios[t].append(ratio)
                cells.append(f"{ratio:.2f}×")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        if numbers:
            out += ["", "; ".join(f"`{t}` made {statistics.median(v):.2f}× the steps of `{tags[0]}` "
                                  f"(median of {len(v)} run number(s))" for t, v in ratios.items()) + ".", ""]
        else:
            out += ["", "No run number has a valid run in every arm yet.", ""]
    return out


def committed_records() -> list[dict[str, Any]]:
    """The drops-*.json records in tools/bench/results, in name order. An arm's record made
    before records named their own arm gets its tag from its file name."""
    records = []
    for path in sorted(RECORDS.glob("drops-*.json")):
        rec = json.loads(path.read_text())
        if rec.get("side_by_side") and "tag" not in rec:
            rec["tag"] = path.stem.removeprefix(f"drops-{rec['task']}-")
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--render"]:
        records = committed_records()
        PAGE.write_text(render(records))
        print(f"wrote {PAGE} from {len(records)} record(s)")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--tasks", default="arithmetic,frozenlake")
    ap.add_argument("--runs", type=int, default=3, help="runs per task")
    ap.add_argument("--window-min", type=float, default=5.0)
    ap.add_argument("--examples", type=Path, default=Path(__file__).resolve().parents[2] / "examples")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/drops"), help="folder for drops-<task>.json")
    ap.add_argument("--tag", default="", help="drops-<task>-<tag>.json instead of drops-<task>.json")
    ap.add_argument("--append", action="store_true",
                    help="add the runs to OUT's record of the same task and tag (made with the same minutes, "
                         "window and settings), e.g. the third run of a setting in a later session; each run "
                         "keeps the commit it ran at")
    ap.add_argument("--set", dest="settings", action="append", type=parse_override, default=[],
                    metavar="SECTION.KEY=VALUE", help="a spec setting for every run (repeatable), e.g. "
                    "env_host.pace_for_lag=true; recorded as `settings`")
    ap.add_argument("--arm", dest="arms", action="append", type=parse_arm, default=[],
                    metavar="TAG[:SECTION.KEY=VALUE;...]", help="one setting of a side-by-side comparison "
                    "(repeat for each; replaces --tag and --set): the arms take turns in each run number")
    args = ap.parse_args(argv)
    if args.arms and (args.tag or args.settings):
        ap.error("--arm replaces --tag and --set: give each arm its tag and settings")
    arms = dict(args.arms) if args.arms else {args.tag: dict(args.settings)}
    if len(arms) != max(1, len(args.arms)):
        ap.error(f"two arms with one tag: {[t for t, _ in args.arms]}")
    # The code the runs start from, read before they start.
    head = {**provenance("rlfleet.tools.bench.drops", argv), "minutes": args.minutes, "window_min": args.window_min}
    commit, dirty = head["commit"], head["uncommitted_changes"]
    heads = {tag: {**head, "settings": settings, **({"tag": tag, "side_by_side": [t for t in arms if t != tag]}
                                                     if len(arms) > 1 else {})} for tag, settings in arms.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict[str, Any]]] = {tag: [] for tag in arms}
    if args.append:
        for tag in arms:
            records[tag], heads[tag] = earlier_runs(args.out, args.tasks.split(","), tag, heads[tag])
    first = 1 + max((r["run"] for rs in records.values() for r in rs), default=-1)
    for run in range(first, first + args.runs):
        for task in args.tasks.split(","):  # tasks alternate: a noisy hour hurts both alike
            for tag, settings in arms.items():  # and so do the arms
                r = run_once(args.examples, task, run, args.minutes, args.window_min, settings)
                r["commit"], r["uncommitted_changes"] = commit, dirty
                records[tag].append(r)
                print(f"{task}{' ' + tag if tag else ''} run {run}: " + (f"VOID ({r['void']})" if "void" in r else
                      f"{r['steps']} steps, drop share {r['drop_share']:.2%} of {r['claimed']} claimed, by window "
                      f"{[f'{s:.1%}' if s is not None else '-' for s in r['drop_share_by_window']]}, "
                      f"{r['pacing_stalls']} pacing stalls"), flush=True)
                # After every run, so a stopped bench keeps what it measured.
                for path in write_records(args.out, tag, heads[tag], records[tag],
                                          complete=run == first + args.runs - 1):
                    print(f"wrote {path}", flush=True)
    return 0


def record_path(out: Path, task: str, tag: str) -> Path:
    return out / f"drops-{task}{'-' + tag if tag else ''}.json"


def earlier_runs(out: Path, tasks: list[str], tag: str,
                 head: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The runs already in OUT's record of this one task (--append), and the head to keep:
    the first invocation's, with every later command listed. Refused unless the runs
    measure the same thing (minutes, window, settings)."""
    if len(tasks) != 1:
        raise SystemExit("--append: one task at a time (each task has its own record)")
    path = record_path(out, tasks[0], tag)
    if not path.exists():
        raise SystemExit(f"--append: no record {path} to add to")
    old = json.loads(path.read_text())
    for key in ("minutes", "window_min", "settings"):
        if old.get(key, {} if key == "settings" else None) != head[key]:
            raise SystemExit(f"--append: {path} was made with {key} = {old.get(key)!r}, "
                             f"this command has {head[key]!r}")
    runs = [{"commit": old["commit"], **r} for r in old["runs"]]  # runs from before kept no commit of their own
    kept = {k: old[k] for k in head if k in old}
    kept["later_commands"] = [*old.get("later_commands", []),
                              {"command": head["command"], "commit": head["commit"], "date": head["date"]}]
    return runs, kept


def write_records(out: Path, tag: str, head: dict[str, Any], records: list[dict[str, Any]],
                  complete: bool) -> list[Path]:
    """OUT/drops-<task>[-<tag>].json for every task measured so far (``complete``: whether
    the bench made every run its command asked for), each replaced whole (a temporary file
    renamed), so a bench stopped while writing leaves the previous record."""
    written = []
    for task, summary in summarise(records).items():
        runs = [r for r in records if r["task"] == task]
        valid = [r["drop_share_by_window"] for r in runs if "void" not in r]
        by_window = [round(statistics.fmean(v[i] for v in valid if len(v) > i and v[i] is not None), 4)
                     for i in range(max(map(len, valid), default=0))
                     if any(len(v) > i and v[i] is not None for v in valid)]
        path = record_path(out, task, tag)
        write_json(path, {**head, "task": task, "drop_share": summary["drop_share_mean"],
                          "drop_share_by_window": by_window, "summary": summary, "complete": complete, "runs": runs})
        written.append(path)
    return written


if __name__ == "__main__":
    sys.exit(main())
