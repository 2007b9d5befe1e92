"""The TRL peer baseline: comparison logic on synthetic metrics, and a 2-step TRL smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.tools.bench import trl_peer
from rlfleet.tools.run.report import read_metrics


def write_metrics(path: Path, lines: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def run_lines(t0: float, evals: list[tuple[int, float, float]], steps: int, step_s: float,
              tokens: int = 100) -> list[dict]:
    """evals: (step, time offset, success); one train line per step every step_s seconds."""
    lines = [{"time": t0 + dt, "step": s, "eval_success": v} for s, dt, v in evals]
    lines += [{"time": t0 + (i + 1) * step_s, "step": i + 1, "reward_mean": 0.1, "tokens": tokens,
               "trajectories": 32} for i in range(steps)]
    return lines


def test_time_to_level_is_the_first_eval_reaching_it(tmp_path):
    d = write_metrics(tmp_path / "r", run_lines(1000.0, [(0, 0.0, 0.1), (5, 50.0, 0.3), (10, 100.0, 0.25),
                                                          (15, 150.0, 0.5)], steps=15, step_s=10.0))
    m = read_metrics(d / "metrics.jsonl")
    assert trl_peer.time_to_level(m, 0.25) == {"time_s": 50.0, "step": 5}
    assert trl_peer.time_to_level(m, 0.5) == {"time_s": 150.0, "step": 15}
    assert trl_peer.time_to_level(m, 0.1) == {"time_s": 0.0, "step": 0}
    assert trl_peer.time_to_level(m, 0.6) is None
    assert trl_peer.time_to_level(m, 0.5, t0=900.0) == {"time_s": 250.0, "step": 15}
    stats = trl_peer.run_stats(m)
    assert stats["steps"] == 15 and stats["tokens"] == 1500 and stats["trajectories"] == 480
    assert stats["tokens_per_s"] == 10.0  # 1500 tokens over 150 s
    assert (stats["eval_first"], stats["eval_last"], stats["eval_best"]) == (0.1, 0.5, 0.5)


def test_compare_uses_rlfleet_final_level_when_both_reach_it(tmp_path):
    rl = write_metrics(tmp_path / "rl", run_lines(0.0, [(0, 0.0, 0.1), (5, 40.0, 0.2), (10, 80.0, 0.4)],
                                                  steps=10, step_s=8.0, tokens=200))
    trl = write_metrics(tmp_path / "trl", run_lines(500.0, [(0, 0.0, 0.1), (5, 60.0, 0.3), (10, 120.0, 0.45)],
                                                    steps=10, step_s=12.0))
    result = trl_peer.compare(read_metrics(rl / "metrics.jsonl"), read_metrics(trl / "metrics.jsonl"),
                              launch={"rlfleet": -20.0, "trl": 490.0})
    assert result["level"] == 0.4 and result["level_kind"] == "rlfleet final eval success"
    assert result["rlfleet"]["to_level"] == {"time_s": 80.0, "step": 10}
    assert result["trl"]["to_level"] == {"time_s": 120.0, "step": 10}
    assert result["rlfleet"]["to_level_from_launch"] == {"time_s": 100.0, "step": 10}
    assert result["trl"]["to_level_from_launch"] == {"time_s": 130.0, "step": 10}
    assert result["rlfleet"]["tokens_per_s"] == 25.0 and result["trl"]["tokens_per_s"] == pytest.approx(8.3)
    table = trl_peer.format_table(result)
    assert "time to 0.400" in table and "80.0 s (step 10)" in table and "120.0 s (step 10)" in table
    # Fixed milestones above both first evals: neither run reached 0.5.
    assert result["milestones"] == {"0.50": {"rlfleet": None, "trl": None}, "0.80": {"rlfleet": None, "trl": None},
                                    "0.90": {"rlfleet": None, "trl": None}, "0.95": {"rlfleet": None, "trl": None}}
    assert "time to 0.50" in table and "never" in table


def test_compare_falls_back_to_the_best_common_level(tmp_path):
    rl = write_metrics(tmp_path / "rl", run_lines(0.0, [(0, 0.0, 0.1), (5, 40.0, 0.5)], steps=5, step_s=8.0))
    trl = write_metrics(tmp_path / "trl", run_lines(0.0, [(0, 0.0, 0.1), (5, 30.0, 0.3), (10, 70.0, 0.2)],
                                                    steps=10, step_s=7.0))
    result = trl_peer.compare(read_metrics(rl / "metrics.jsonl"), read_metrics(trl / "metrics.jsonl"))
    assert result["level"] == 0.3 and "not reached by trl" in result["level_kind"]
    assert result["rlfleet"]["to_level"] == {"time_s": 40.0, "step": 5}
    assert result["trl"]["to_level"] == {"time_s": 30.0, "step": 5}
    assert "to_level_from_launch" not in result["trl"]


def test_compare_skips_a_final_level_that_step_0_already_had(tmp_path):
    # rlfleet ended where it began: "time to 0.1" would be 0 s for both, which says nothing
    rl = write_metrics(tmp_path / "rl", run_lines(0.0, [(0, 0.0, 0.1), (5, 40.0, 0.2), (10, 80.0, 0.1)],
                                                  steps=10, step_s=8.0))
    trl = write_metrics(tmp_path / "trl", run_lines(0.0, [(0, 0.0, 0.1), (5, 50.0, 0.3)], steps=5, step_s=10.0))
    result = trl_peer.compare(read_metrics(rl / "metrics.jsonl"), read_metrics(trl / "metrics.jsonl"))
    assert result["level"] == 0.2 and "no gain over the first eval" in result["level_kind"]
    assert result["rlfleet"]["to_level"] == {"time_s": 40.0, "step": 5}
    assert result["trl"]["to_level"] == {"time_s": 50.0, "step": 5}


def test_compare_without_evals_says_which_run_lacks_them(tmp_path):
    rl = write_metrics(tmp_path / "rl", run_lines(0.0, [], steps=3, step_s=1.0))
    trl = write_metrics(tmp_path / "trl", run_lines(0.0, [(0, 0.0, 0.1)], steps=3, step_s=1.0))
    result = trl_peer.compare(read_metrics(rl / "metrics.jsonl"), read_metrics(trl / "metrics.jsonl"))
    assert result["level"] is None and result["level_kind"] == "no eval lines in: rlfleet"
    assert result["rlfleet"]["steps"] == 3
    assert "level: no eval lines in: rlfleet" in trl_peer.format_table(result)


def test_cli_compare_prints_and_writes_json(tmp_path, capsys):
    rl = write_metrics(tmp_path / "rl", run_lines(0.0, [(0, 0.0, 0.1), (5, 40.0, 0.3)], steps=5, step_s=8.0))
    trl = write_metrics(tmp_path / "trl", run_lines(0.0, [(0, 0.0, 0.1), (5, 50.0, 0.3)], steps=5, step_s=10.0))
    out = tmp_path / "cmp.json"
    assert trl_peer.main(["--out", str(trl), "--compare", str(rl), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "time to 0.300" in printed and "40.0 s (step 5)" in printed and "50.0 s (step 5)" in printed
    saved = json.loads(out.read_text())
    assert saved["level"] == 0.3 and saved["trl"]["to_level"] == {"time_s": 50.0, "step": 5}
    # a missing run is a precise error, not a traceback
    assert trl_peer.main(["--out", str(tmp_path / "nope"), "--compare", str(rl)]) == 2
    assert "no metrics file" in capsys.readouterr().err


# ------------------------------------------------------------------ with a real tiny model
def tiny_model(path: Path) -> Path:
    """A random 1-layer Qwen2 with the project's character tokenizer (no warm start)."""
    import torch

    from rlfleet.tools.build_model import build_model, build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    model = build_model(tokenizer, hidden=32, layers=1, seed=0)
    model.to(torch.float32).save_pretrained(str(path))
    return path


def write_spec(tmp_path: Path, model: Path, task: str = "arithmetic") -> Path:
    spec = tmp_path / f"{task}.toml"
    spec.write_text(f"""
[job]
name = "trl-smoke"
runs_dir = "{tmp_path / 'runs'}"
[model]
path = "{model}"
[task]
group_size = 2
eval_size = 4
eval_every_steps = 1
[task.env]
kind = "{task}"
[trainer]
batch_size = 4
learning_rate = 1e-3
max_steps = 2
""")
    return spec


def test_reward_is_the_task_rule_reward():
    from rlfleet.daemons.tasks import get_task

    task = get_task("arithmetic", digits=2)
    p = task.make_prompts("train", 1, seed=0)[0]
    row = trl_peer.prompt_rows(task, 1, 0)[0]
    assert row["prompt"] == task.format_turn(task.make_env().reset(p))  # the evaluate.py text
    reward = trl_peer.make_reward(task)
    got = reward(prompts=[row["prompt"]] * 3, completions=[p.answer, p.answer + "1", "x"],
                 completion_ids=[[1], [1], [1]], task_prompt=[row["task_prompt"]] * 3)
    assert got == [1.0, 0.0, 0.0]


def test_frozenlake_is_refused_with_a_reason(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")  # the spec wants weights; nothing loads them
    spec = trl_peer.load_job(write_spec(tmp_path, model, task="frozenlake"))
    with pytest.raises(SystemExit, match="multi-turn.*one completion per prompt"):
        trl_peer.task_for(spec)


def test_two_step_grpo_run_writes_rlfleet_metrics(tmp_path):
    pytest.importorskip("trl")
    import torch

    torch.set_num_threads(1)
    model = tiny_model(tmp_path / "model")
    spec = trl_peer.load_job(write_spec(tmp_path, model))
    out = tmp_path / "trl"
    stats = trl_peer.run_trl(spec, out, budget_s=120, threads=1)
    m = read_metrics(out / "metrics.jsonl")
    assert m.bad_lines == 0
    assert [r["step"] for r in m.train] == [1, 2]
    assert all(r["trajectories"] == 4 and r["groups"] == 2 and r["tokens"] >= 4 for r in m.train)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in m.train)
    assert [r["step"] for r in m.evals] == [0, 1, 2]  # before training, then every step
    assert all(r["eval_n"] == 4 and 0.0 <= r["eval_success"] <= 1.0 for r in m.evals)
    assert stats["steps"] == 2 and stats["tokens"] == sum(r["tokens"] for r in m.train)
    record = json.loads((out / "run.json").read_text())
    from rlfleet.daemons.tasks import get_task
    # no warmstart.json: the task's default difficulty; + 1 for the end token, as the env-host asks
    assert record["threads"] == 1
    assert record["max_completion_length"] == get_task("arithmetic").max_new_tokens + 1
    # a second run into the same folder would mix two runs' lines: refused, nothing touched
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="already holds a run"):
        trl_peer.run_trl(spec, out, budget_s=120, threads=1)
    assert (out / "metrics.jsonl").read_text() == before


def test_side_by_side_alternates_who_goes_first_and_records_every_run(tmp_path, monkeypatch, capsys):
    """--runs 3: rlfleet first in runs 0 and 2, TRL first in run 1; a record after each run
    with its provenance, every comparison, and the median of the per-run ratios."""
    order: list[str] = []
    speeds = [(25.0, 10.0), (20.0, 10.0), (30.0, 10.0)]  # per run: (rlfleet, trl) tokens/s

    def this_run() -> int:
        return (len(order) - 1) // 2  # two sides per run

    def fake_rlfleet(spec_path, budget_s):
        order.append("rlfleet")
        tokens = int(speeds[this_run()][0] * 8)
        return write_metrics(tmp_path / f"rl{len(order)}", run_lines(0.0, [(0, 0.0, 0.1), (10, 80.0, 0.9)],
                                                                     steps=10, step_s=8.0, tokens=tokens)), -5.0

    def fake_trl(spec_path, out, budget_s, threads):
        order.append("trl")
        write_metrics(out, run_lines(100.0, [(0, 0.0, 0.1), (10, 120.0, 0.9)], steps=10, step_s=12.0,
                                     tokens=int(speeds[this_run()][1] * 12)))
        (out / "run.json").write_text(json.dumps({"launch_time": 95.0}))

    monkeypatch.setattr(trl_peer, "run_rlfleet", fake_rlfleet)
    monkeypatch.setattr(trl_peer, "run_trl_process", fake_trl)
    monkeypatch.setattr(trl_peer, "provenance", lambda module, argv: {"command": "x", "commit": "a" * 40})
    spec = Path(__file__).resolve().parents[3] / "examples" / "arithmetic.toml"
    out = tmp_path / "peer.json"
    assert trl_peer.main(["--spec", str(spec), "--out", str(tmp_path / "trl"), "--side-by-side", "--runs", "3",
                          "--json", str(out)]) == 0
    assert order == ["rlfleet", "trl", "trl", "rlfleet", "rlfleet", "trl"]
    record = json.loads(out.read_text())
    assert record["commit"] == "a" * 40 and [r["run"] for r in record["runs"]] == [0, 1, 2]
    assert [r["order"][0] for r in record["runs"]] == ["rlfleet", "trl", "rlfleet"]
    ratio = record["summary"]["tokens_per_s_ratio"]
    assert ratio["each"] == [2.5, 2.0, 3.0] and ratio["median"] == 2.5  # per run, then the median
    assert record["summary"]["trl"]["tokens_per_s"]["median"] == 10.0
    reached = record["summary"]["milestones"]["0.80"]
    assert reached["rlfleet"]["reached"] == 3 and reached["rlfleet"]["time_s"]["median"] == 80.0
    assert record["runs"][0]["rlfleet"]["to_level_from_launch"] == {"time_s": 85.0, "step": 10}
    # A second invocation into the same --out is refused before anything runs.
    assert trl_peer.main(["--spec", str(spec), "--out", str(tmp_path / "trl"), "--side-by-side"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_runs_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        trl_peer.main(["--out", "x", "--compare", "y", "--runs", "0"])
    assert "--runs 0: at least one" in capsys.readouterr().err


def test_the_page_renders_from_a_record_of_this_bench(tmp_path, monkeypatch):
    """The peer page's template (tools/bench/pages/peer.md) renders from a record shaped as --side-by-side writes it."""
    from rlfleet.tools.bench import pages

    runs = []
    for i, (rl_s, trl_s) in enumerate([(8.0, 12.0), (9.0, 12.0), (7.0, 13.0)]):
        rl = read_metrics(write_metrics(tmp_path / f"rl{i}", run_lines(
            0.0, [(0, 0.0, 0.29), (10, 10 * rl_s, 0.9)], steps=10, step_s=rl_s, tokens=300)) / "metrics.jsonl")
        trl = read_metrics(write_metrics(tmp_path / f"trl{i}", run_lines(
            0.0, [(0, 0.0, 0.29), (10, 10 * trl_s, 0.95)], steps=10, step_s=trl_s, tokens=300)) / "metrics.jsonl")
        result = trl_peer.compare(rl, trl)
        result.update(run=i, order=["rlfleet", "trl"])
        result["rlfleet"]["cpu_s"] = {"trainer": 28.0 + i, "env-host": 10.0}
        runs.append(result)
    record = {"command": "python -m rlfleet.tools.bench.trl_peer --side-by-side", "commit": "c" * 40,
              "machine": "m 2 cores", "date": "2026-11-28", "spec": "examples/arithmetic.toml", "budget_s": 300.0,
              "runs": runs, "summary": trl_peer.summarize(runs)}
    (tmp_path / "peer.json").write_text(json.dumps(record))
    page = pages.render((Path(pages.TEMPLATES) / "peer.md").read_text(), "peer.md", records_dir=tmp_path)
    assert "| trained tokens/s | 38 (33–43) | 25 (23–25) |" in page, page
    assert "| rlfleet ÷ TRL, tokens/s (each run) | **1.50×** (1.50, 1.33, 1.86) | |" in page, page
    assert "| time to held-out success 0.80 | 80.0 (70.0–90.0) s | 120.0 (120.0–130.0) s |" in page, page
    assert "| 1 | 29.0 | 10.0 | 39.0 |" in page, page
    # The README's row: the highest level both reached in every run (0.90; rlfleet never reached 0.95).
    assert pages.FILLERS["peer_highest_milestone"](lambda name: record, "peer.json") == \
        "to held-out success 0.90 in 80.0 s against TRL's 120.0 s (medians)"
    assert "{{" not in page, page
