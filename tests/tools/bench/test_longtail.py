"""The long-tail bench's harness (tools/bench/longtail.py) without running a fleet: the
sweep repeated with the settings taking turns, every run kept, ratios taken within one
repetition, and the summary over valid runs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.tools.bench import longtail

SPEC = Path(__file__).resolve().parents[3] / "examples" / "longtail-sim.toml"


def run(mode: str, rollouts: int, traj_s: float, *, run_no: int = 0, valid: bool = True,
        tok_s: float | None = None) -> dict:
    return {"run": run_no, "mode": mode, "rollouts": rollouts, "valid": valid,
            "trained_trajectories_per_s": traj_s, "generated_tokens_per_s": tok_s,
            **({} if valid else {"invalid_because": "sim lag 0.080 > 0.05"})}


def test_ratios_are_taken_within_a_repetition_and_their_median_given():
    records = [run("sync", 16, 2.0, run_no=0), run("trajectory_repack", 16, 8.0, run_no=0),
               run("sync", 16, 4.0, run_no=1), run("trajectory_repack", 16, 8.0, run_no=1),
               run("sync", 16, 1.0, run_no=2), run("trajectory_repack", 16, 6.0, run_no=2)]
    out = longtail.ratios_by_run(records)
    assert out["by_run"] == {"0": {"16": {"over_sync": 4.0}}, "1": {"16": {"over_sync": 2.0}},
                             "2": {"16": {"over_sync": 6.0}}}
    assert out["median"] == {"16": {"over_sync": 4.0}}  # not 6.0 / 2.33, a ratio of pooled figures


def test_a_void_run_is_kept_but_in_no_figure():
    records = [run("trajectory", 64, 100.0, run_no=0), run("trajectory_repack", 64, 50.0, run_no=0, valid=False),
               run("trajectory", 64, 90.0, run_no=1), run("trajectory_repack", 64, 99.0, run_no=1)]
    ratios = longtail.ratios_by_run(records)
    assert ratios["by_run"]["0"] == {}  # its repack run was void: no ratio that repetition
    assert ratios["median"] == {"64": {"over_trajectory": 1.1}}
    rows = {r["mode"]: r for r in longtail.summarize(records)}
    assert rows["trajectory_repack"]["runs"] == 2 and rows["trajectory_repack"]["void"] == 1
    assert rows["trajectory_repack"]["trained_trajectories_per_s"] == {"median": 99.0, "min": 99.0, "max": 99.0, "n": 1}
    assert rows["trajectory"]["trained_trajectories_per_s"] == {"median": 95.0, "min": 90.0, "max": 100.0, "n": 2}
    assert rows["trajectory"]["generated_tokens_per_s"] is None  # no run has it


def test_the_summary_lists_the_modes_in_their_order_per_fleet_size():
    records = [run(m, n, 1.0) for n in (64, 16) for m in reversed(longtail.MODES)]
    assert [(r["rollouts"], r["mode"]) for r in longtail.summarize(records)] == \
        [(n, m) for n in (16, 64) for m in longtail.MODES]


def test_the_sweep_repeats_with_the_settings_taking_turns(tmp_path, monkeypatch, capsys):
    made: list[tuple[str, int]] = []

    def fake_run(spec: Path, duration_s: float):
        text = spec.read_text()
        mode = "trajectory_repack" if 'kind = "laminar"' in text else text.split('mode = "')[1].split('"')[0]
        rollouts = int(text.split("rollouts = ")[1].split("\n")[0])
        made.append((mode, rollouts))
        return tmp_path / f"run{len(made)}", {}, 7

    def fake_measure(run_dir, mode, rollouts, etcd, code):
        return {**run(mode, rollouts, float(len(made))), "max_lag": 0.01, "rollout_idle_fraction": 0.1, "steps": 5,
                "staleness_le3_share": 1.0, "mixed_version_trajectories": 0, "repack_events": 0,
                "repack_overhead_s_p50": None, "repack_overhead_s_p99": None, "kv_utilization_mean": 0.2,
                "generated_tokens_per_s": 10.0}

    monkeypatch.setattr(longtail, "run_once", fake_run)
    monkeypatch.setattr(longtail, "measure", fake_measure)
    monkeypatch.setattr(longtail, "provenance", lambda module, argv: {"command": "x", "commit": "a" * 40})
    out = tmp_path / "longtail.json"
    code = longtail.main(["--spec", str(SPEC), "--rollouts", "16,64", "--modes", "sync,trajectory_repack",
                          "--runs", "2", "--json", str(out)])
    assert code == 0
    one_sweep = [("sync", 16), ("trajectory_repack", 16), ("sync", 64), ("trajectory_repack", 64)]
    assert made == one_sweep * 2  # each repetition runs every setting before the next begins
    record = json.loads(out.read_text())
    assert record["runs"] == 2 and record["max_lag"] == longtail.MAX_LAG
    assert [r["run"] for r in record["records"]] == [0] * 4 + [1] * 4
    assert set(record["ratios"]["by_run"]) == {"0", "1"}
    assert all(row["runs"] == 2 and row["void"] == 0 for row in record["summary"])
    assert not list(SPEC.parent.glob(f".{SPEC.stem}-*.toml"))  # the per-run specs are removed


def test_a_run_is_judged_by_its_lag_over_the_run_not_its_largest_sample(tmp_path):
    def judged(final_lags: list[float], invalid_because: str | None) -> dict:
        (tmp_path / "sim").mkdir(exist_ok=True)
        (tmp_path / "sim" / "rollout-0.json").write_text(json.dumps(
            {"rollouts": {f"sim-{i}": {"lag": lag} for i, lag in enumerate(final_lags)}}))
        r = {"max_lag": 0.4, "valid": invalid_because is None,
             **({"invalid_because": invalid_because} if invalid_because else {})}
        longtail.judge_final_lag(r, tmp_path)
        return r

    start_up_only = judged([0.001, 0.004], "sim lag 0.406 > 0.05")
    assert start_up_only["valid"] and "invalid_because" not in start_up_only
    assert start_up_only["final_lag"] == 0.004 and start_up_only["max_lag"] == 0.4  # the sample is kept
    short = judged([0.001], "sim lag 0.322 > 0.05; fewer than 3 training steps")
    assert not short["valid"] and short["invalid_because"] == "fewer than 3 training steps"
    behind = judged([0.01, 0.08], None)
    assert not behind["valid"] and behind["invalid_because"] == "sim lag 0.080 > 0.05"


def test_runs_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        longtail.main(["--runs", "0"])
    assert "--runs 0: at least one" in capsys.readouterr().err


def test_the_page_renders_from_records_of_this_bench(tmp_path):
    """The page's template (tools/bench/pages/longtail.md) renders from records shaped as
    main() writes them, whatever the committed ones hold."""
    from rlfleet.tools.bench import pages

    def record(mode: str, n: int, run_no: int, traj_s: float, valid: bool = True) -> dict:
        return {**run(mode, n, traj_s, run_no=run_no, valid=valid, tok_s=traj_s * 600),
                "rollout_idle_fraction": 0.1, "staleness_le3_share": 0.8, "mixed_version_trajectories": 0,
                "repack_events": 40 if mode == "trajectory_repack" else 0,
                "repack_overhead_s_p50": 0.06 if mode == "trajectory_repack" else None,
                "repack_overhead_s_p99": 0.2 if mode == "trajectory_repack" else None,
                "etcd_writes_per_s": 30.0, "repack_plan_ms_p50": 2.3, "repack_plan_ms_max": 2.9,
                "steps": 5, "window_s": 79.0, "cpu_s": {"rollout": 30.0, "env-host": 13.0}}
    speed = {"sync": 15.0, "one_step_off": 17.0, "partial": 110.0, "trajectory": 100.0, "trajectory_repack": 97.0}
    runs = [record(m, n, i, speed[m] * n / 64 * (1 + i / 50), valid=(i, m) != (2, "partial"))
            for i in range(3) for n in (16, 64) for m in longtail.MODES]
    head = {"command": "python -m rlfleet.tools.bench.longtail --runs 3", "commit": "c" * 40,
            "machine": "m 2 cores", "date": "2026-11-28", "runs": 3, "max_lag": longtail.MAX_LAG}
    (tmp_path / "longtail.json").write_text(json.dumps(
        {**head, "records": runs, "summary": longtail.summarize(runs), "ratios": longtail.ratios_by_run(runs)}))
    big = [record("trajectory_repack", 1000, i, 9.0) for i in range(3)]
    (tmp_path / "longtail-1000.json").write_text(json.dumps({**head, "records": big}))
    slow = [record("trajectory_repack", 1000, i, 9.0, valid=False) for i in range(3)]
    (tmp_path / "longtail-1000-timescale5.json").write_text(json.dumps({**head, "records": slow}))
    first = [record("sync", 64, 0, 0.0, valid=False), record("trajectory", 64, 0, 100.0)]
    (tmp_path / "longtail-100s.json").write_text(json.dumps({**head, "records": first}))
    template = (Path(pages.TEMPLATES) / "longtail.md").read_text()
    page = pages.render(template, "longtail.md", records_dir=tmp_path)
    assert "| 64 | partial | 2 (+1 void) |" in page
    assert "| 64 | trajectory + repack | 3 | 98.9 (97.0–100.9) |" in page, page
    assert "over sync: **6.47×**" in page and "target ≥ 3×, met" in page
    assert "over partial: **0.88×**" in page and "**missed**, by 41%" in page
    assert "3 valid runs of 3; 5 training steps in a 79 s window; etcd **30 writes/s**" in page
    assert "runs are kept void: no valid run of 3 (sim lag 0.080 > 0.05;" in page, page
    assert "1 of its 2 runs void (sync at 64: sim lag 0.080 > 0.05)" in page, page
    assert "{{" not in page, page


def test_the_control_plane_line_says_what_is_missing_instead_of_failing():
    from rlfleet.tools.bench import pages

    pages.load_fillers()
    valid = {**run("trajectory_repack", 1000, 9.0), "steps": 4, "window_s": 52.0, "etcd_writes_per_s": None,
             "repack_plan_ms_p50": 6.7, "repack_plan_ms_max": 8.7, "cpu_s": {"rollout-0": 70.0}}
    void = {**run("trajectory_repack", 1000, 9.0, valid=False), "run": 1}
    line = pages.FILLERS["control_plane"](lambda name: {"records": [valid, void]}, "longtail-1000.json")
    assert line.startswith("1 valid runs of 2 (void: sim lag 0.080 > 0.05)"), line
    assert "etcd **– writes/s**" in line and "**6.7 ms p50**" in line, line
    assert pages.FILLERS["control_plane"](lambda name: {"records": [void]}, "x.json") == \
        "no valid run of 1 (sim lag 0.080 > 0.05)"
