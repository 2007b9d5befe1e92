"""The soak benchmark's pure parts: its fault schedule and its verdicts on synthetic series."""

from __future__ import annotations

import json

from rlfleet.tools.bench.soak import (ETCD_PHASE_S, Fault, MetricsReader, drop_counts, fault_schedule,
                                      growth_verdict, judge_series, verdict_window_s)


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
