"""tools/bench/losses.py without running a fleet: the spec changes of a run, the record it
writes (the fields the table of docs/results/losses.md is built from), the summary, the slowed trainer's
environment, and the plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from rlfleet.common.failpoints import TRAINER_STEP_DELAY_S as STEP_DELAY_ENV
from rlfleet.tools.bench import losses as bench
from rlfleet.tools.bench.learning import spec_for

REPO = Path(__file__).resolve().parents[3]


def fake_run(task="arithmetic", seed=0, first=0.25, final=0.5, staleness=None):
    return {"task": task, "seed": seed, "first": first, "final": final, "best": max(first, final),
            "gain_points": round(100 * (final - first), 1), "steps": 40,
            "staleness": staleness if staleness is not None else {"0": 64, "3": 32, "8": 32},
            "run_dir": f"runs/{task}-{seed}", "run_wall_s": 95.0}


def test_the_loss_table_is_replaced_whole_and_stress_sets_alpha(tmp_path):
    assert bench.overrides_for("tis", False, 8) == {"trainer.loss": {"kind": "tis"}}
    assert bench.overrides_for("cispo", True, 8) == {"trainer.loss": {"kind": "cispo"}, "trainer.max_staleness": 8}
    # applied to the shipped example, the spec validates: ppo_clip's clip_eps does not
    # follow into a kind that has no such key
    from rlfleet.common.spec.job import load_spec

    path = spec_for(REPO / "examples", "arithmetic", 1, bench.overrides_for("topr", True, 8))
    try:
        spec = load_spec(path)
        assert spec.trainer.loss.kind == "topr" and spec.trainer.max_staleness == 8 and spec.job.seed == 1
    finally:
        path.unlink()
    assert bench.shipped_alpha(REPO / "examples", "arithmetic") == 2


def test_a_record_has_what_the_table_needs():
    r = bench.record_of("tis", True, 8, 2.0, fake_run())
    assert {k: r[k] for k in ("loss", "task", "seed", "stress", "first", "final")} == {
        "loss": "tis", "task": "arithmetic", "seed": 0, "stress": True, "first": 0.25, "final": 0.5}
    # the histogram keys become ints; mean (0*64 + 3*32 + 8*32) / 128 = 2.75
    assert r["staleness"] == {0: 64, 3: 32, 8: 32} and r["staleness_max"] == 8 and r["staleness_mean"] == 2.75
    assert r["step_delay_s"] == 2.0 and bench.record_of("tis", False, 2, 2.0, fake_run())["step_delay_s"] == 0.0


def test_summary_per_loss_task_and_condition():
    records = [bench.record_of("tis", True, 8, 2.0, fake_run(seed=s, final=f)) for s, f in ((0, 0.5), (1, 0.7))]
    records.append(bench.record_of("tis", False, 2, 0.0, fake_run(final=math.nan, staleness={"0": 5})))
    s = bench.summarise(records)
    assert s["tis/arithmetic/stress"]["final_mean"] == 0.6 and s["tis/arithmetic/stress"]["final_min"] == 0.5
    assert s["tis/arithmetic/stress"]["staleness"] == {0: 128, 3: 64, 8: 64}
    assert math.isnan(s["tis/arithmetic/default"]["final_mean"])  # no evaluation: no figure, not 0


def test_step_delay_is_set_for_the_block_only(monkeypatch):
    monkeypatch.delenv(STEP_DELAY_ENV, raising=False)
    with bench.step_delay(2.5):
        assert os.environ[STEP_DELAY_ENV] == "2.5"
        with bench.step_delay(0):
            assert STEP_DELAY_ENV not in os.environ
        assert os.environ[STEP_DELAY_ENV] == "2.5"
    assert STEP_DELAY_ENV not in os.environ


def test_plot_and_argument_checks(tmp_path):
    records = [bench.record_of(loss, stress, 8, 2.0, fake_run(task=task, seed=seed))
               for loss in ("ppo_clip", "tis") for task in ("arithmetic", "frozenlake")
               for stress in (False, True) for seed in (0, 1)]
    bench.plot(records, tmp_path / "losses.png")
    assert (tmp_path / "losses.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        bench.main(["--losses", "grpo", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--conditions", "hot", "--out", str(tmp_path)])


def test_resume_runs_only_the_missing_runs_seed_major(tmp_path, monkeypatch):
    ran = []

    def run_task(task, seed, budget_s, examples, overrides):
        ran.append((overrides["trainer.loss"]["kind"], seed, "trainer.max_staleness" in overrides,
                    os.environ.get(STEP_DELAY_ENV)))
        return fake_run(task=task, seed=seed)

    monkeypatch.setattr(bench, "run_task", run_task)
    monkeypatch.delenv(STEP_DELAY_ENV, raising=False)
    argv = ["--losses", "ppo_clip,tis", "--tasks", "arithmetic", "--seeds", "2", "--out", str(tmp_path),
            "--examples", str(REPO / "examples")]
    assert bench.main(argv) == 0
    # seed-major: both losses and both conditions at seed 0 before any seed 1; the stress
    # runs wait the task's own delay
    assert [(loss, seed, stress) for loss, seed, stress, _ in ran[:4]] == [
        ("ppo_clip", 0, False), ("tis", 0, False), ("ppo_clip", 0, True), ("tis", 0, True)]
    assert {d for _, _, stress, d in ran if stress} == {repr(bench.STRESS_DELAY_S["arithmetic"])}
    assert len(ran) == 8
    # cut short after 3 runs: --resume keeps them and runs the other 5
    data = json.loads((tmp_path / "losses.json").read_text())
    data["records"] = data["records"][:3]
    (tmp_path / "losses.json").write_text(json.dumps(data))
    ran.clear()
    assert bench.main(argv + ["--resume"]) == 0
    assert len(ran) == 5 and ran[0][:3] == ("tis", 0, True)
    assert len(json.loads((tmp_path / "losses.json").read_text())["records"]) == 8


def test_the_readme_table_from_a_finished_run(tmp_path, capsys):
    records = [bench.record_of("tis", stress, 8, 0.1, fake_run(seed=seed, final=final,
                                                              staleness={"7": 30, "8": 60, "2": 10}))
               for stress in (False, True) for seed, final in ((0, 0.5), (1, 0.7))]
    (tmp_path / "losses.json").write_text(json.dumps({"records": records}))
    assert bench.main(["--table", str(tmp_path / "losses.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| loss | arithmetic, default | arithmetic, α = 8, trainer slowed |"
    # mean 0.6, population std 0.1; staleness (2*10 + 7*30 + 8*60) / 100 = 7.1
    assert lines[2] == ("| `tis` | 0.600 ± 0.100 (min 0.500, n=2) "
                        "| 0.600 ± 0.100 (min 0.500, n=2; staleness mean 7.1, max 8) |")
