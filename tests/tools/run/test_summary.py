"""The text `rlfleet run` prints about training: the end summary against a golden
file, the progress and evaluation lines. Set RLFLEET_UPDATE_GOLDEN=1 to rewrite the
golden file after an intended change, and read its diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlfleet.tools.run.report import read_metrics
from rlfleet.tools.run.summary import end_summary, eval_line, progress_line

GOLDEN = Path(__file__).parent / "golden" / "end_summary.txt"

METRICS = [
    {"time": 1000.0, "step": 0, "eval_success": 0.289, "eval_s": 1.0},
    {"time": 1010.0, "step": 1, "reward_mean": 0.25, "tokens_per_s": 900, "staleness": {"0": 32},
     "trajectories": 32, "tokens": 320, "step_s": 0.5, "wait_s": 9.0},
    {"time": 1020.0, "step": 2, "reward_mean": 0.5, "tokens_per_s": 1100, "staleness": {"1": 30, "2": 2},
     "trajectories": 32, "tokens": 400, "step_s": 0.5, "wait_s": 9.0},
    {"time": 1021.0, "step": 2, "eval_success": 0.75, "eval_s": 1.0},
    {"time": 1030.0, "step": 3, "reward_mean": 0.875, "tokens_per_s": 1200, "staleness": {"1": 32},
     "trajectories": 32, "tokens": 410, "step_s": 0.5, "wait_s": 9.0},
    {"time": 1031.0, "step": 3, "eval_success": 0.7, "eval_s": 1.0},
]
ACCOUNTING = {"claimed": 14, "trained": 12, "dropped": {"staleness": 1}, "dropped_total": 1, "in_flight": 1,
              "lost": [], "lost_total": 0, "conflicts": [], "ok": True}


def metrics(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    return read_metrics(path)


def test_end_summary_matches_the_golden_file(tmp_path):
    run_dir = Path("runs/arithmetic/20250101-120000")
    text = end_summary(metrics(tmp_path), job="arithmetic", max_steps=3, headline="finished", run_dir=run_dir,
                       accounting=ACCOUNTING, restarts={"trainer-0": 0, "rollout-0": 2, "env-host-0": 1},
                       cpu_s={"trainer-0": 30.0, "rollout-0": 20.5, "supervisor": 0.4},
                       plots=[run_dir / "learning_vs_time.png", run_dir / "learning_vs_step.png"])
    if os.environ.get("RLFLEET_UPDATE_GOLDEN"):
        GOLDEN.write_text(text + "\n")
    assert text + "\n" == GOLDEN.read_text()


def test_a_run_that_trained_nothing_and_a_broken_accounting_say_so(tmp_path):
    broken = {**ACCOUNTING, "ok": False, "lost": [3, 4], "lost_total": 2}
    text = end_summary(read_metrics(tmp_path / "absent.jsonl"), job="j", max_steps=10,
                       headline="no progress (exit 6)", run_dir=tmp_path, accounting=broken, restarts={},
                       cpu_s={}, plots=[])
    assert text.splitlines()[0] == "== j: no progress (exit 6) =="
    assert "  steps             none of 10 trained" in text
    assert "held-out success" not in text and "plots" not in text
    assert "  restarts          none" in text
    assert "  accounting        BROKEN: 2 lost, 0 trained and dropped; 14 prompts claimed" in text
    no_check = end_summary(read_metrics(tmp_path / "absent.jsonl"), job="j", max_steps=10, headline="h",
                           run_dir=tmp_path, accounting=None, restarts={}, cpu_s={}, plots=[])
    assert "  accounting        not checked" in no_check


def test_progress_and_evaluation_lines(tmp_path):
    m = metrics(tmp_path)
    assert progress_line(m, 3) == ("step 3/3   reward 0.875   eval success 0.700   1200 tok/s   "
                                   "staleness 0: 32  1: 62  2: 2")
    assert eval_line(m) == "evaluation at step 3: held-out success 0.700 (first 0.289, best 0.750)"
    assert eval_line(m, 1) == "evaluation at step 2: held-out success 0.750 (first 0.289, best 0.750)"
    assert eval_line(m, 0) == "evaluation at step 0: held-out success 0.289 (first 0.289, best 0.289)"
    assert progress_line(read_metrics(tmp_path / "absent.jsonl"), 3) == "training: waiting for the first step"
