"""The soak benchmark's pure parts: its fault schedule and its verdicts on synthetic series;
and its results page, rendered from the committed records (a figure typed by hand into
docs/results/soak.md fails here)."""

from __future__ import annotations

import json
import os

from rlfleet.tools.bench.soak import page
from rlfleet.tools.bench.soak.faults import ETCD_PHASE_S, Fault, fault_schedule
from rlfleet.tools.bench.soak.sampling import MetricsReader
from rlfleet.tools.bench.soak.verdicts import drop_counts, growth_verdict, judge_series, verdict_window_s


def test_the_default_two_hour_schedule():
    s = fault_schedule(7200, 120, 1200, 30, 3600, 60, quiet_end_s=120)
    kills = [f.at_s for f in s if f.kind == "kill"]
    assert kills == [120.0 * n for n in range(1, 60)]  # every 2 min, none in the last 2
    downs = [f for f in s if f.kind == "etcd_down"]
    ups = [f for f in s if f.kind == "etcd_up"]
    assert [f.at_s for f in downs] == [1200 * n + ETCD_PHASE_S for n in range(1, 6)]
    assert [(u.n, u.at_s - d.at_s) for d, u in zip(downs, ups)] == [(d.n, 30.0) for d in downs]
    fills = [f for f in s if f.kind.startswith("disk")]
    assert [(f.kind, f.n) for f in fills] == [("disk_fill", 1), ("disk_free", 1)]  # 120 min is the end
    assert s == sorted(s) and all(f.at_s <= 7200 - 120 for f in s)


def test_the_trial_schedule_and_kinds_turned_off():
    s = fault_schedule(360, 60, 180, 10, 240, 20, quiet_end_s=36)
    assert [(f.at_s, f.kind) for f in s] == [
        (60, "kill"), (120, "kill"), (180, "kill"), (200, "etcd_down"), (210, "etcd_up"),
        (240, "kill"), (280, "disk_fill"), (300, "disk_free"), (300, "kill")]
    assert fault_schedule(360, 0, 0, 10, -1, 20, quiet_end_s=0) == []
    # an undo that would land in the quiet end takes its fault out with it
    assert Fault(200, "etcd_down", 1) not in fault_schedule(360, 0, 180, 200, 0, 0, quiet_end_s=0)


def _samples(series: dict[tuple[str, int], list[tuple[float, float]]], fds: float = 40) -> list[dict]:
    by_t: dict[float, list[dict]] = {}
    for (label, pid), points in series.items():
        for t, rss in points:
            by_t.setdefault(t, []).append({"job": "j", "label": label, "role": "r", "pid": pid,
                                           "rss_kb": rss, "fds": fds, "tree_rss_kb": rss})
    return [{"t": t, "procs": procs} for t, procs in sorted(by_t.items())]


def test_a_flat_series_passes_and_a_growing_one_fails():
    ts = [30.0 * i for i in range(1, 241)]  # two hours, every 30 s
    w = verdict_window_s(ts[-1])
    assert w == 900
    flat = [(t, 100_000 + (t % 90)) for t in ts]
    assert judge_series(flat, ts[-1], w, 30)["ok"]
    leak = [(t, 100_000 + 5 * t) for t in ts]  # +5 kB/s: 107.5 MB at [15, 30) min, ~136 MB at the end
    j = judge_series(leak, ts[-1], w, 30)
    assert j["judged"] and j["windows"] == "run" and not j["ok"] and 0.2 < j["growth"] < 0.3
    just_under = [(t, 100_000 * (1.099 if t >= ts[-1] - w else 1.0)) for t in ts]
    assert judge_series(just_under, ts[-1], w, 30)["ok"]


def test_restarted_members_start_new_series_judged_on_their_own_life_or_not_at_all():
    ts = [30.0 * i for i in range(1, 241)]
    samples = _samples({
        ("trainer-0", 11): [(t, 500_000) for t in ts if t < 1000],            # killed at ~17 min: short
        ("trainer-0", 12): [(t, 500_000 + (t - 1000) * 20) for t in ts if t >= 1000],  # own life, leaks
        ("relay-0", 13): [(t, 90_000) for t in ts],                            # whole run, flat
        ("rollout-0", 14): [(t, 70_000) for t in ts if t < 2400],             # lived 40 min < 3w
        ("rollout-0", 15): [(t, 70_000) for t in ts if 2400 <= t < 4000],     # 26 min: short
    })
    v = growth_verdict(samples, 30)
    s = v["per_series"]
    assert not s["j/trainer-0/11"]["rss_kb"]["judged"] and "short" in s["j/trainer-0/11"]["rss_kb"]["why"]
    own = s["j/trainer-0/12"]["rss_kb"]
    assert own["judged"] and own["windows"] == "own life" and not own["ok"]
    assert s["j/relay-0/13"]["rss_kb"]["windows"] == "run" and s["j/relay-0/13"]["fds"]["ok"]
    assert v["members_not_judged"] == ["j/rollout-0"]
    assert v["per_member"]["j/trainer-0"] == {"series": 2, "judged": 1, "ok": False}
    assert not v["ok"] and v["failed"] == [f"j/trainer-0/12 rss_kb +{own['growth']:.1%}",
                                           f"j/trainer-0/12 tree_rss_kb +{own['growth']:.1%}"]


def test_a_trial_scales_the_windows_down():
    ts = [10.0 * i for i in range(1, 37)]  # 6 minutes, every 10 s
    v = growth_verdict(_samples({("env-host-0", 7): [(t, 1000.0) for t in ts]}), 10)
    assert v["window_s"] == 90 and v["ok"] and v["per_series"]["j/env-host-0/7"]["fds"]["windows"] == "run"


def test_drop_counts_and_the_metrics_reader_keep_only_the_last_training_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"time": 1, "step": 1, "loss": 0.1, "trained_groups": 10, "dropped": {"staleness": 1}},
             {"time": 2, "step": 1, "eval_success": 0.5},
             {"time": 3, "step": 2, "loss": 0.2, "trained_groups": 14,
              "dropped": {"staleness": 2, "buffer_full": 1, "no_signal": 3}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"time": 4, "step": 3, "lo')  # torn
    reader = MetricsReader(path)
    assert reader.poll()["step"] == 2
    assert drop_counts(reader.last) == (3, 20)  # waste: staleness + buffer_full; consumed: trained + all drops
    with open(path, "a") as f:
        f.write('ss": 0.3, "trained_groups": 18}\n')
    assert reader.poll()["step"] == 3 and drop_counts(reader.last) == (0, 18)


def test_samples_after_the_duration_are_not_judged():
    # the daemons stop at 360 s and go one by one; rlfleet run lives on for its accounting
    ts = [10.0 * i for i in range(1, 41)]
    samples = _samples({("relay-0", 3): [(t, 500.0) for t in ts if t <= 365],
                        ("trainer-0", 4): [(t, 900.0) for t in ts if t <= 355],
                        ("rlfleet-run", 1): [(t, 80.0) for t in ts]})
    v = growth_verdict(samples, 10, until_s=360)
    assert v["run_end_s"] == 360 and v["ok"] and not v["members_not_judged"]
    assert {s["rss_kb"]["windows"] for s in v["per_series"].values()} == {"run"}


def test_the_results_page_is_rendered_from_the_records():
    assert page.PAGE.read_text() == page.render(page.read_records()), \
        "docs/results/soak.md differs from its records: python -m rlfleet.tools.bench.soak --render"


def _record() -> dict:
    """A finished soak's record, cut down to what the page reads (the shape of a real one)."""
    job = {"task": "arithmetic", "exit": 7, "accounting_ok": True, "drop_share": 0.0412, "restarts_logged": 3,
           "journal_lines_skipped": 0, "longest_no_step_s": 21.5}
    return {
        "command": "python -m rlfleet.tools.bench.soak --hours 0.2", "commit": "751927baaa5e0c8b814f",
        "dirty_files": 0, "machine": "vm 2 cores x86_64 24 GiB", "date": "2026-11-27 15:49:00 UTC",
        "hours": 0.2, "ran_s": 736.7, "stopped_early": False, "error": None, "window_s": 120.0,
        "note": "a synthetic record",
        "verdicts": {"accounting_ok_both": True, "no_growth": False, "drop_share_arithmetic": 0.0412,
                     "drop_share_ok": False, "ok": False},
        "growth": {"ok": False, "window_s": 176.4, "run_end_s": 705.6,
                   "failed": ["arithmetic-soak/reward-host-0/20840 rss_kb +13.8%"],
                   "members_not_judged": ["longtail-sim-soak/trainer-0"],
                   "per_member": {"arithmetic-soak/reward-host-0": {"series": 1, "judged": 1, "ok": False},
                                  "longtail-sim-soak/trainer-0": {"series": 3, "judged": 0, "ok": True}},
                   "per_series": {"arithmetic-soak/reward-host-0/20840": {
                       "rss_kb": {"judged": True, "windows": "run", "baseline": 100.0, "final": 113.8,
                                  "growth": 0.138, "ok": False},
                       "fds": {"judged": True, "windows": "run", "baseline": 40, "final": 40, "growth": 0.0,
                               "ok": True}},
                                  "longtail-sim-soak/trainer-0/31": {
                       "rss_kb": {"judged": False, "why": "short: lived 240 s, from 15 s to 256 s"}}}},
        "etcd_growth_not_judged": {"ok": True, "failed": []},
        "jobs": {"arithmetic-soak": job, "longtail-sim-soak": {**job, "task": "longtail-sim", "drop_share": None}},
        "fault_summary": {"count": {"kill": 7, "etcd_down": 2, "etcd_up": 2}, "kills_skipped": 0,
                          "kills_back": 7, "kills_not_back": 0, "back_after_s_median": 4.1,
                          "back_after_s_max": 25.0, "orphaned_children": 0, "etcd_healthy_after_s_max": 0.9},
    }


def test_the_page_shows_each_verdict_as_the_record_judged_it(tmp_path):
    path = tmp_path / "soak-trial.json"
    path.write_text(json.dumps(_record()))
    path.with_suffix(".png").write_bytes(b"")
    text = page.render(page.read_records(tmp_path))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["accounting"].endswith("| pass |") and "arithmetic-soak: exit 7" in rows["accounting"]
    assert rows["no growth"].endswith("| **FAIL** |") and "1 of 2 judged" in rows["no growth"]
    assert rows["drop share"].endswith("| **FAIL** |") and "4.12%" in rows["drop share"]
    assert rows["all"].endswith("| **FAIL** |")
    assert "it fails: no growth, drop share" in text and "Note: a synthetic record" in text
    assert "`arithmetic-soak/reward-host-0/20840 rss_kb +13.8%`" in text
    assert "`longtail-sim-soak/trainer-0` (0 of 3 series judged)" in text
    assert "| `longtail-sim-soak` | longtail-sim | 7 | True | – | 3 | 22 s | 0 |" in text
    assert f"({os.path.relpath(path.with_suffix('.png'), page.PAGE.parent)})" in text  # from docs/results/
    assert "method only" not in text
