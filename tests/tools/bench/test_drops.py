"""tools/bench/drops.py: the per-window drop share, and the results page rendered from the
committed records (a figure typed by hand into docs/results/drops.md fails here)."""

from __future__ import annotations

import json

import pytest

from rlfleet.tools.bench import drops


def line(t: float, step: int, trained: int, dropped: dict, ages: dict) -> dict:
    return {"time": t, "step": step, "loss": 0.0, "trained_groups": trained, "dropped": dropped,
            "staleness": ages, "wait_s": 0.1, "pending_groups": 2}


def test_windows_count_what_each_window_consumed_and_wasted():
    lines = [line(10, 1, 4, {}, {"1": 16}), line(50, 2, 8, {"staleness": 1}, {"2": 32}),
             line(70, 3, 12, {"staleness": 1, "no_signal": 2}, {"2": 16, "1": 16})]
    w = drops.windows(lines, t0=0.0, window_s=60.0, alpha=2)
    assert [x["consumed"] for x in w] == [9, 6]          # trained + every drop, per window
    assert [x["drop_share"] for x in w] == [round(1 / 9, 4), 0.0]  # no_signal is not waste
    assert w[1]["no_signal_share"] == round(2 / 6, 4)
    assert w[0]["at_bound"] == round(32 / 48, 3) and w[1]["at_bound"] == 0.5


def test_a_run_is_pinned_when_its_median_full_window_trains_most_at_the_bound():
    def run(at_bound: list[float], full: list[bool], share: float = 0.02) -> dict:
        return {"task": "arithmetic", "drop_share": share, "drop_share_by_window": [share] * len(at_bound),
                "windows": [{"window": i, "at_bound": a, "full": f, "drop_share": share}
                            for i, (a, f) in enumerate(zip(at_bound, full))]}
    # The last window, cut short by the stop, is not judged: here it alone is above one half.
    calm = run([0.3, 0.4, 0.45, 0.9], [True, True, True, False])
    assert (drops.at_bound_median(calm), drops.pinned(calm)) == (0.4, False)
    pinned = run([0.55, 0.6, 0.4, 0.1], [True, True, True, False])
    assert (drops.at_bound_median(pinned), drops.pinned(pinned)) == (0.55, True)
    s = drops.summarise([calm, run([0.3, 0.3], [True, False], share=0.031)])["arithmetic"]
    assert (s["runs"], s["drop_share_max"], s["pinned_runs"], s["target_met"]) == (2, 0.031, 0, False)
    s = drops.summarise([calm, pinned])["arithmetic"]
    assert (s["pinned_runs"], s["target_met"]) == (1, False)
    assert drops.summarise([calm])["arithmetic"]["target_met"] is True
    # Records from before "full" was kept: every window but the last is full.
    old = {"windows": [{"window": 0, "at_bound": 0.6}, {"window": 1, "at_bound": 0.6}, {"window": 2, "at_bound": 0.0}]}
    assert [w["window"] for w in drops.full_windows(old)] == [0, 1] and drops.pinned(old) is True


def test_windows_say_which_the_stop_cut_short():
    lines = [line(10, 1, 4, {}, {"1": 16}), line(70, 2, 8, {}, {"1": 16}), line(130, 3, 12, {}, {"1": 16})]
    assert [x["full"] for x in drops.windows(lines, t0=0.0, window_s=60.0, alpha=2)] == [True, True, False]


@pytest.mark.skipif(not list(drops.RECORDS.glob("drops-*.json")), reason="no drops record committed yet")
def test_the_results_page_is_rendered_from_the_records():
    assert drops.PAGE.read_text() == drops.render(drops.committed_records()), \
        "docs/results/drops.md differs from its records: python -m rlfleet.tools.bench.drops --render"


def test_set_puts_toml_values_into_every_runs_spec(tmp_path):
    import argparse
    import tomllib

    from rlfleet.tools.bench.drops import spec_for
    from rlfleet.tools.bench.spec_variants import parse_override
    settings = dict(map(parse_override, ["env_host.pace_for_lag=true", "trainer.max_staleness = 4"]))
    assert settings == {"env_host.pace_for_lag": True, "trainer.max_staleness": 4}
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "arithmetic.toml").write_text('[job]\nname = "arithmetic"\n[trainer]\nmax_steps = 10\n')
    spec = tomllib.loads(spec_for(examples, "arithmetic", 2, settings).read_text())
    assert spec["job"]["name"] == "arithmetic-drops2" and spec["trainer"] == {"max_steps": 10**7, "max_staleness": 4}
    assert spec["env_host"] == {"pace_for_lag": True}
    for bad in ("no-equals", "=1", "x.y=not toml"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_override(bad)


def fake_bench(monkeypatch, made: list, commit: str = "a") -> None:
    """drops.run_once answers at once (each call noted in ``made``) and the code is at ``commit``."""
    def fake_run(examples, task, run, minutes, window_min, settings):
        made.append((run, dict(settings)))
        return {"task": task, "run": run, "drop_share": 0.01, "drop_share_by_window": [0.01], "claimed": 100,
                "steps": 12 + run if settings else 10, "pacing_stalls": 0, "load_1m_before": 1.0, "load_1m_after": 1.0,
                "windows": [{"window": 0, "at_bound": 0.2, "full": True, "drop_share": 0.01}]}
    monkeypatch.setattr(drops, "run_once", fake_run)
    monkeypatch.setattr(drops, "provenance", lambda module, argv: {"command": "x", "commit": commit * 40,
                                                                  "uncommitted_changes": [], "machine": "m", "date": "d"})


def test_append_adds_runs_to_the_record_of_the_same_setting(tmp_path, monkeypatch):
    made = []
    fake_bench(monkeypatch, made)
    args = ["--minutes", "30", "--tasks", "arithmetic", "--tag", "lag", "--set", "env_host.pace_for_lag=true",
            "--out", str(tmp_path)]
    assert drops.main([*args, "--runs", "2"]) == 0
    fake_bench(monkeypatch, made, commit="b")
    assert drops.main([*args, "--runs", "1", "--append"]) == 0
    rec = json.loads((tmp_path / "drops-arithmetic-lag.json").read_text())
    assert [run for run, _ in made] == [0, 1, 2] and [r["run"] for r in rec["runs"]] == [0, 1, 2]
    assert [r["commit"][0] for r in rec["runs"]] == ["a", "a", "b"] and rec["commit"] == "a" * 40
    assert rec["complete"] and rec["summary"]["runs"] == 3 and rec["later_commands"][0]["commit"] == "b" * 40
    assert "at `bbbbbbbbbb`" in drops.render([rec])
    # Another setting, another length or no record at all is refused, precisely.
    with pytest.raises(SystemExit, match="was made with settings"):
        drops.main(["--minutes", "30", "--tasks", "arithmetic", "--tag", "lag", "--out", str(tmp_path), "--append"])
    with pytest.raises(SystemExit, match="was made with minutes = 30.0"):
        drops.main([*args[2:], "--minutes", "5", "--append"])
    with pytest.raises(SystemExit, match="no record"):
        drops.main(["--tasks", "frozenlake", "--out", str(tmp_path), "--append"])


def test_arms_take_turns_and_each_has_its_record(tmp_path, monkeypatch, capsys):
    made = []
    fake_bench(monkeypatch, made)
    arms = ["--arm", "base", "--arm", "lag:env_host.pace_for_lag=true;trainer.max_staleness=3"]
    assert drops.main(["--tasks", "arithmetic", "--runs", "2", "--out", str(tmp_path), *arms]) == 0
    lag = {"env_host.pace_for_lag": True, "trainer.max_staleness": 3}
    assert made == [(0, {}), (0, lag), (1, {}), (1, lag)]  # turns within each run number
    base, other = (json.loads((tmp_path / f"drops-arithmetic-{t}.json").read_text()) for t in ("base", "lag"))
    assert (base["settings"], base["side_by_side"]) == ({}, ["lag"])
    assert (other["settings"], other["side_by_side"]) == (lag, ["base"])
    assert "Side by side with `lag`" in drops.render([base])
    page = drops.render([base, other])
    assert "## Side by side on arithmetic: `base`, `lag`" in page
    assert "| 0 | 10, 1.00%, 20.0% | 12, 1.00%, 20.0% | 1.20× |" in page, page
    assert "`lag` made 1.25× the steps of `base` (median of 2 run number(s))" in page, page
    assert "## Side by side" not in drops.render([base])  # the other arm's record is missing
    # --append adds a run to every arm, each checked against its own record.
    assert drops.main(["--tasks", "arithmetic", "--runs", "1", "--out", str(tmp_path), "--append", *arms]) == 0
    assert made[4:] == [(2, {}), (2, lag)]
    assert [r["run"] for r in json.loads((tmp_path / "drops-arithmetic-lag.json").read_text())["runs"]] == [0, 1, 2]
    for bad, message in ((["--arm", "a", "--tag", "x"], "--arm replaces"),
                         (["--arm", "a", "--arm", "a:x.y=1"], "two arms"), (["--arm", "a b"], "letters, digits")):
        with pytest.raises(SystemExit):
            drops.main(["--out", str(tmp_path), *bad])
        assert message in capsys.readouterr().err


def test_an_arms_record_without_its_tag_gets_it_from_its_file_name(tmp_path, monkeypatch):
    """Records made before the arms named themselves ("tag") still pair up on the page."""
    monkeypatch.setattr(drops, "RECORDS", tmp_path)
    for tag, other in (("base", "paced"), ("paced", "base")):
        (tmp_path / f"drops-arithmetic-{tag}.json").write_text(json.dumps({"task": "arithmetic",
                                                                           "side_by_side": [other], "runs": []}))
    (tmp_path / "drops-arithmetic.json").write_text(json.dumps({"task": "arithmetic", "runs": []}))
    assert [r.get("tag") for r in drops.committed_records()] == ["base", "paced", None]  # in name order
