from __future__ import annotations

import json

from rlfleet.tools.report import plot, read_metrics, summary


def test_summary_and_plots_from_metrics(tmp_path):
    lines = [
        {"time": 100.0, "step": 0, "eval_success": 0.25},
        {"time": 110.0, "step": 1, "reward_mean": 0.3, "tokens_per_s": 1000, "staleness": {"0": 30, "1": 2},
         "trajectories": 32, "tokens": 300, "step_s": 0.5, "wait_s": 4.0, "snapshot_s": 0.01},
        {"time": 120.0, "step": 2, "reward_mean": 0.5, "tokens_per_s": 1200, "staleness": {"1": 32},
         "trajectories": 32, "tokens": 500, "step_s": 0.75, "wait_s": 8.0, "snapshot_s": 0.01},
        {"time": 121.0, "step": 2, "eval_success": 0.6, "eval_s": 1.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"time": 1')  # torn last line
    m = read_metrics(path)
    assert (len(m.train), len(m.evals), m.bad_lines) == (2, 2, 1)
    s = summary(m)
    assert s["steps"] == 2 and s["wall_s"] == 21.0
    assert (s["eval_success_first"], s["eval_success_last"]) == (0.25, 0.6)
    assert s["staleness"] == {0: 30, 1: 34}
    # Rates over the span from the first step to the last (10 s): the second batch only.
    assert (s["trained_trajectories"], s["trained_tokens"]) == (64, 800)
    assert (s["trajectories_per_s"], s["trained_tokens_per_s"]) == (3.2, 50.0)
    assert s["trainer_time_s"] == {"learn": 1.2, "wait_for_batch": 12.0, "snapshot": 0.0, "eval": 1.0}
    written = plot(m, tmp_path, title="t")
    assert [p.name for p in written] == ["learning_vs_time.png", "learning_vs_step.png"]
    assert all(p.stat().st_size > 1000 for p in written)
