from __future__ import annotations

import json

from rlfleet.tools.run.report import (
    MetricsTail,
    RunMetrics,
    draw,
    moving_average,
    plot,
    read_metrics,
    smoothing_window,
    summary,
)


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


def test_moving_average_is_trailing_and_keeps_every_point():
    assert moving_average([0, 1, 0, 1, 1], 2) == [0.0, 0.5, 0.5, 0.5, 1.0]
    assert moving_average([1.0, 0.0, 0.0], 1) == [1.0, 0.0, 0.0]
    assert moving_average([], 5) == []
    assert (smoothing_window(10), smoothing_window(400), smoothing_window(10_000)) == (1, 20, 50)


def test_the_plot_draws_raw_reward_its_moving_average_and_marked_evaluations(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [{"time": 100.0 + i, "step": i, "reward_mean": float(i % 2)} for i in range(1, 201)]
    lines += [{"time": 100.0, "step": 0, "eval_success": 0.2}, {"time": 300.0, "step": 200, "eval_success": 0.9}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    fig, ax = plt.subplots()
    draw(ax, read_metrics(path), "step")
    raw, smooth, evals = ax.get_lines()
    assert raw.get_label() == "train reward (batch mean, raw)" and raw.get_alpha() < 0.5
    assert smooth.get_label() == "train reward (10-step moving average)"
    # The raw batch mean swings 0/1; its moving average shows the trend (0.5) instead.
    assert list(raw.get_ydata()[-4:]) == [1.0, 0.0, 1.0, 0.0]
    assert all(abs(y - 0.5) < 1e-9 for y in smooth.get_ydata()[10:])
    assert evals.get_label() == "held-out eval success (each evaluation)"
    assert evals.get_marker() == "D" and list(evals.get_xdata()) == [0, 200]
    plt.close(fig)


def test_a_long_run_is_drawn_in_linear_work():
    # The soak's 29,561-step run took 190 s to draw (the start time was rescanned for every
    # point) and its rlfleet run was killed while drawing: count the lines' time reads.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reads = [0]

    class Line(dict):
        def __getitem__(self, key):
            reads[0] += key == "time"
            return super().__getitem__(key)

    n = 2_000
    m = RunMetrics(train=[Line(time=1000.0 + i, step=i, reward_mean=0.5) for i in range(n)],
                   evals=[Line(time=1000.0 + 50 * i, step=50 * i, eval_success=0.5) for i in range(n // 50)])
    fig, ax = plt.subplots()
    draw(ax, m, "time")
    plt.close(fig)
    assert reads[0] <= 4 * (n + n // 50), f"{reads[0]:,} time reads to draw {n:,} steps"


def test_metrics_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == (0, 0)  # not written yet
    with open(path, "w") as f:
        f.write(json.dumps({"time": 1.0, "step": 0, "eval_success": 0.5}) + "\n" + '{"time": 2.0, "st')
    assert tail.poll() == (0, 1)
    with open(path, "a") as f:  # the torn line is completed, and one more comes
        f.write('ep": 1, "reward_mean": 0.5}\n' + json.dumps({"time": 3.0, "step": 2}) + "\n")
    assert tail.poll() == (2, 0)
    assert [r["step"] for r in tail.metrics.train] == [1, 2] and tail.metrics.bad_lines == 0
    assert tail.poll() == (0, 0)


def test_metrics_tail_keeps_its_last_lines_and_the_whole_runs_staleness(tmp_path):
    """A run of hours held every training line in `rlfleet run`'s memory (the soak saw its
    RSS climb): the tail keeps the last ``keep_train`` and carries the staleness of the rest."""
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path, keep_train=10, keep_whole=3)
    line = {"reward_mean": 0.5, "tokens": 100, "dropped": {"staleness": 1}}
    with open(path, "w") as f:
        for step in range(1, 101):
            f.write(json.dumps({"time": float(step), "step": step, "staleness": {"0": 3, "2": 1}, **line}) + "\n")
    assert tail.poll() == (100, 0)
    assert [r["step"] for r in tail.metrics.train] == list(range(91, 101))
    assert tail.metrics.staleness() == read_metrics(path).staleness() == {0: 300, 2: 100}
    # Only the last keep_whole stay whole; the others keep what the view's staleness needs.
    assert [len(r) for r in tail.metrics.train] == [3] * 7 + [6] * 3
    with open(path, "a") as f:  # step 99 trained again after a restore: counted once
        f.write(json.dumps({"time": 101.0, "step": 99, "staleness": {"1": 4}, **line}) + "\n")
    assert tail.poll() == (1, 0)
    assert tail.metrics.staleness() == read_metrics(path).staleness() == {0: 297, 2: 99, 1: 4}
    assert [len(r) for r in tail.metrics.train] == [3] * 7 + [6] * 3 and tail.metrics.train[-1]["tokens"] == 100
