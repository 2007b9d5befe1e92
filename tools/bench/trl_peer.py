"""Peer baseline: the same model, task and GRPO hyper-parameters under TRL's GRPOTrainer.

    python -m rlfleet.tools.bench.trl_peer --spec examples/arithmetic.toml --budget-s 600 \\
        --out runs/bench/trl-arithmetic
    python -m rlfleet.tools.bench.trl_peer --out runs/bench/trl-arithmetic --compare runs/arithmetic/<ts>
    python -m rlfleet.tools.bench.trl_peer --spec examples/arithmetic.toml --budget-s 600 \\
        --out runs/bench/trl-arithmetic --side-by-side --runs 3 --json tools/bench/results/peer.json

``--side-by-side`` runs both sides ``--runs`` times (default 3), each side in a fresh process,
one after the other; the side that goes first alternates (rlfleet first in runs 0, 2, ...) so
neither always gets the cooler machine. The record keeps every run's comparison and, in
``summary``, each side's median and range over the runs, and the median of the per-run
ratio of trained tokens/s (a ratio of two runs minutes apart, never of pooled figures).

The TRL run writes the same metrics.jsonl as rlfleet's trainer (train lines: time, step,
reward_mean, tokens, trajectories; eval lines: time, step, eval_success), so
tools/run/report.py and tools/bench/learning.py read both.

What is the same: the model folder, the prompt text and tokenization (task.format_turn of
the env's first observation, encoded exactly as daemons/tasks/episodes.py does), the
train prompt stream (make_prompts("train", n, job.seed), in order: no shuffling), the
rule reward, group size, completions per step (trainer.batch_size, one optimizer step per
batch), learning rate and its schedule (fused AdamW, no weight decay, grad-norm clip 1.0), sampling
temperature/top_p, the per-turn token budget (task.max_new_tokens + 1, as the env-host
asks), PPO-clip eps ([trainer.loss] clip_eps), no KL term (beta=0), token-level loss aggregation (TRL "dapo" =
rlfleet "token"), and greedy held-out eval every task.eval_every_steps on eval_size
prompts through daemons.tasks.episodes.evaluate_model.

Unavoidable differences (also written into run.json):
- TRL is synchronous: generate the batch with the current weights, then one optimizer
  step, so its importance ratio is exactly 1 (num_iterations=1). rlfleet's ratio is
  against the rollout's behaviour log-probs, which may be some versions stale.
- TRL divides advantages by the group's *sample* std + 1e-4; rlfleet by the population
  std + 1e-6 (advantages about 7% larger at G=8; Adam makes the scale nearly moot).
- TRL generates with HF generate over left-padded prompts; RoPE makes the pad offset
  invisible to the model, so this changes speed, not results.
- TRL's eval runs inline (training waits for it); its time is in eval_s of each line.

Multi-turn tasks (frozenlake) are refused: GRPOTrainer samples one completion per prompt,
and a one-move version of FrozenLake (reward only if the first move reaches the goal) is
a different task whose numbers would mislead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import JobSpec, load_spec, parse_spec
from rlfleet.tools.bench.output import median_range, provenance, write_json
from rlfleet.tools.exit_codes import RUN_ENDED
from rlfleet.tools.run.report import RunMetrics, read_metrics

log = logging.getLogger("rlfleet.bench")

DIFFERENCES = [
    "TRL is synchronous (generate, then one optimizer step on that batch): importance ratio is 1; "
    "rlfleet's ratio is against possibly stale behaviour log-probs",
    "TRL scales advantages by the group's sample std + 1e-4, rlfleet by the population std + 1e-6",
    "TRL pads prompts on the left for HF generate (RoPE: no effect on results)",
    "TRL's eval runs inline and blocks training (eval_s in each eval line)",
]


# ------------------------------------------------------------------ comparison (no torch)
def time_to_level(m: RunMetrics, level: float, t0: float | None = None) -> dict[str, float] | None:
    """First eval line whose success reaches `level`: {"time_s" since t0, "step"}; None if never.

    t0 defaults to the run's first metrics line.
    """
    start = m.t0 if t0 is None else t0
    for r in sorted(m.evals, key=lambda r: r["time"]):
        if r["eval_success"] >= level - 1e-9:  # successes are k/n: exact, but be float-safe
            return {"time_s": round(r["time"] - start, 1), "step": r["step"]}
    return None


def run_stats(m: RunMetrics) -> dict[str, Any]:
    """Steps, wall, trained tokens and tokens/s (generated tokens that went into the loss,
    end-to-end: first metrics line to last train line), eval first/last/best."""
    out: dict[str, Any] = {"steps": max((r["step"] for r in m.train), default=0)}
    last = max((r["time"] for r in m.train), default=m.t0)
    wall = last - m.t0
    tokens = sum(int(r.get("tokens", 0)) for r in m.train)
    out.update(train_wall_s=round(wall, 1), tokens=tokens,
               tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
               trajectories=sum(int(r.get("trajectories", 0)) for r in m.train))
    if m.evals:
        evals = sorted(m.evals, key=lambda r: r["time"])
        out.update(eval_first=evals[0]["eval_success"], eval_last=evals[-1]["eval_success"],
                   eval_best=max(r["eval_success"] for r in evals), evals=len(evals))
    return out


MILESTONES = (0.5, 0.8, 0.9, 0.95)


def compare(rlfleet: RunMetrics, trl: RunMetrics,
            launch: dict[str, float] | None = None) -> dict[str, Any]:
    """Side-by-side numbers of two runs of the same job.

    The level is rlfleet's final eval success when both runs reach it and it is above
    both first evals (else every run "reaches" it at step 0); otherwise the best level
    both reached (min of the two bests). `launch` ({"rlfleet": t, "trl": t}, unix
    seconds) adds time-to-level measured from process start.
    """
    runs = {"rlfleet": rlfleet, "trl": trl}
    result: dict[str, Any] = {name: run_stats(m) for name, m in runs.items()}
    if not rlfleet.evals or not trl.evals:
        missing = [name for name, m in runs.items() if not m.evals]
        result.update(level=None, level_kind=f"no eval lines in: {', '.join(missing)}")
        return result
    target = result["rlfleet"]["eval_last"]
    missed = [name for name, m in runs.items() if time_to_level(m, target) is None]
    if not missed and target > max(result[name]["eval_first"] for name in runs):
        level, kind = target, "rlfleet final eval success"
    else:
        level = min(result[name]["eval_best"] for name in runs)
        why = (f"not reached by {', '.join(missed)}" if missed
               else "no gain over the first eval")
        kind = f"best level both reached (rlfleet final {target:.3f}: {why})"
    result.update(level=level, level_kind=kind)
    for name, m in runs.items():
        result[name]["to_level"] = time_to_level(m, level)
        if launch and name in launch:
            result[name]["to_level_from_launch"] = time_to_level(m, level, t0=launch[name])
    # A final level of 1.0 on a small eval set is one lucky eval away: fixed milestones
    # above both starting points show the whole race.
    start = max(result[name]["eval_first"] for name in runs)
    result["milestones"] = {f"{lv:.2f}": {name: time_to_level(m, lv) for name, m in runs.items()}
                            for lv in MILESTONES if lv > start}
    return result


def format_table(result: dict[str, Any]) -> str:
    def cell(v: Any, fmt: str = "{}") -> str:
        return "-" if v is None else fmt.format(v)

    def reach(d: dict[str, Any] | None) -> str:
        return "never" if d is None else f"{d['time_s']:.1f} s (step {d['step']})"

    rows = [("", "rlfleet", "trl")]
    r, t = result["rlfleet"], result["trl"]
    for label, key, fmt in (("steps", "steps", "{}"), ("train wall (s)", "train_wall_s", "{:.1f}"),
                            ("trained tokens", "tokens", "{}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
                            ("eval first", "eval_first", "{:.3f}"), ("eval last", "eval_last", "{:.3f}"),
                            ("eval best", "eval_best", "{:.3f}")):
        rows.append((label, cell(r.get(key), fmt), cell(t.get(key), fmt)))
    level = result.get("level")
    if level is not None:
        rows.append((f"time to {level:.3f}", reach(r.get("to_level")), reach(t.get("to_level"))))
        if "to_level_from_launch" in r or "to_level_from_launch" in t:
            rows.append(("  from launch", reach(r.get("to_level_from_launch")),
                         reach(t.get("to_level_from_launch"))))
    for lv, reached in result.get("milestones", {}).items():
        rows.append((f"time to {lv}", reach(reached.get("rlfleet")), reach(reached.get("trl"))))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"level: {result.get('level_kind')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the TRL run
def load_job(spec_path: str | os.PathLike, model: str | None = None) -> JobSpec:
    """The spec, with model.path replaced by `model` when given (resolved against the cwd)."""
    if model is None:
        return load_spec(spec_path)
    data = tomllib.loads(Path(spec_path).read_text())
    data.setdefault("model", {})["path"] = str(Path(model).resolve())
    return parse_spec(data, source=os.fspath(spec_path), base_dir=Path(spec_path).absolute().parent)


def task_for(spec: JobSpec) -> Any:
    """The job's task exactly as the fleet builds it from [task.env] (whose defaults are
    the shipped model's warm-start difficulty); refuses multi-turn tasks (module docstring)."""
    from rlfleet.common.spec.seams import TASKS

    task = TASKS.build(spec.task.env, max_turns=spec.task.max_turns)
    if task.multi_turn:
        raise SystemExit(
            f"trl_peer: task {spec.task.env.kind!r} is multi-turn (up to {task.max_turns} turns); TRL's "
            "GRPOTrainer samples one completion per prompt, so it cannot run this task. A one-turn "
            "variant would be a different task; the peer supports single-turn tasks (arithmetic).")
    return task


def prompt_rows(task: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """The train stream's first n prompts as dataset rows; "prompt" is the exact turn text."""
    rows = []
    for p in task.make_prompts("train", n, seed=seed):
        text = task.format_turn(task.make_env().reset(p))
        # The whole Prompt rides along as JSON: the reward needs it, whatever fields it grows.
        rows.append({"prompt": text, "task_prompt": json.dumps(p.to_dict())})
    return rows


class _Recorder:
    """What the reward function saw in the current step (rewards, completion token counts)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.tokens = 0


def make_reward(task: Any, recorder: _Recorder | None = None) -> Any:
    """A TRL reward function: the task's rule reward of each completion."""
    from rlfleet.daemons.tasks import Prompt

    def rule_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    task_prompt: list[str], **_: Any) -> list[float]:
        out = [task.reward(Prompt.from_dict(json.loads(p)), [c])
               for c, p in zip(completions, task_prompt, strict=True)]
        if recorder is not None:
            recorder.rewards.extend(out)
            recorder.tokens += sum(len(ids) for ids in completion_ids)  # end token included
        return out

    return rule_reward


def _metrics_callback(*, model: Any, tokenizer: Any, task: Any, eval_prompts: list[Any],
                      every: int, deadline: float, group_size: int, recorder: _Recorder,
                      path: Path) -> Any:
    import torch
    from transformers import TrainerCallback

    from rlfleet.daemons.tasks.episodes import evaluate_model

    def write(line: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    class MetricsCallback(TrainerCallback):
        """rlfleet's metrics.jsonl lines, held-out evals, and the wall-clock budget."""

        last_eval_step = -1
        step_started = 0.0

        def evaluate(self, step: int) -> None:
            started = time.perf_counter()
            model.eval()
            success = evaluate_model(model, tokenizer, task, eval_prompts, greedy=True)
            model.train()
            self.last_eval_step = step
            eval_s = time.perf_counter() - started
            write({"time": round(time.time(), 3), "step": step, "eval_success": success,
                   "eval_n": len(eval_prompts), "eval_s": round(eval_s, 3)})
            print(f"step {step:4d}  eval success {success:.3f}  ({eval_s:.1f} s)", flush=True)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.evaluate(0)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step_s = time.perf_counter() - self.step_started
            rewards = torch.tensor(recorder.rewards or [0.0])
            write({"time": round(time.time(), 3), "step": state.global_step,
                   "reward_mean": round(float(rewards.mean()), 4),
                   "reward_std": round(float(rewards.std(unbiased=False)), 4),
                   "trajectories": len(recorder.rewards), "groups": len(recorder.rewards) // group_size,
                   "tokens": recorder.tokens, "tokens_per_s": round(recorder.tokens / max(step_s, 1e-9), 1),
                   "step_s": round(step_s, 4)})
            recorder.rewards, recorder.tokens = [], 0
            if state.global_step % every == 0:
                self.evaluate(state.global_step)
            if time.monotonic() >= deadline:
                control.should_training_stop = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.last_eval_step != state.global_step:
                self.evaluate(state.global_step)

    return MetricsCallback()


def run_trl(spec: JobSpec, out: Path, budget_s: float, *, max_steps: int | None = None,
            threads: int | None = None) -> dict[str, Any]:
    """Train with TRL's GRPOTrainer until max_steps or the budget; returns run_stats."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    launched = time.time()
    deadline = time.monotonic() + budget_s
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        raise SystemExit(f"trl_peer: {metrics} already holds a run; pass another --out")
    task = task_for(spec)
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.disable_progress_bar()
    # transformers 5 renames gradient_checkpointing; TRL still uses the old names.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(f"torch threads: {threads} (the TRL run is alone on this machine)", flush=True)
    t, g = spec.trainer, spec.task.group_size
    if t.loss.kind != "ppo_clip":  # TRL's loss is PPO-clip; another loss is another experiment
        raise SystemExit(f"trl_peer: compares [trainer.loss] kind = 'ppo_clip' only, got {t.loss.kind!r}")
    steps = max_steps or t.max_steps
    prompts_per_step = t.batch_size // g
    out.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_list(prompt_rows(task, steps * prompts_per_step, spec.job.seed))
    eval_prompts = task.make_prompts("eval", spec.task.eval_size, seed=spec.job.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(spec.model.path))
    model = AutoModelForCausalLM.from_pretrained(str(spec.model.path), dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, seed=spec.job.seed, data_seed=spec.job.seed,
        max_steps=steps, per_device_train_batch_size=t.batch_size, gradient_accumulation_steps=1,
        num_generations=g, num_iterations=1, shuffle_dataset=False,
        # The same schedule: "constant"/"linear" with warmup mean the same in TRL (HF).
        learning_rate=t.learning_rate, lr_scheduler_type=t.lr_schedule, warmup_steps=t.warmup_steps,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused",
        beta=0.0, epsilon=t.loss.clip_eps, loss_type="dapo", scale_rewards="group",
        temperature=spec.rollout.temperature, top_p=spec.rollout.top_p, top_k=0,
        max_completion_length=task.max_new_tokens + 1,  # + the end token, as the env-host asks
        save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, bf16=False, fp16=False)
    recorder = _Recorder()
    callback = _metrics_callback(model=model, tokenizer=tokenizer, task=task, eval_prompts=eval_prompts,
                                 every=spec.task.eval_every_steps, deadline=deadline, group_size=g,
                                 recorder=recorder, path=metrics)
    trainer = GRPOTrainer(model=model, reward_funcs=[make_reward(task, recorder)], args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    trainer.remove_callback(PrinterCallback)  # our own lines instead of a dict per step
    trainer.train()
    stats = run_stats(read_metrics(metrics))
    record = {"spec": spec.to_dict(), "task_difficulty": task.difficulty(), "threads": threads,
              "budget_s": budget_s, "max_steps": steps, "launch_time": round(launched, 3),
              "max_completion_length": task.max_new_tokens + 1, "differences": DIFFERENCES,
              "trl_version": _version("trl"), "torch_version": torch.__version__, "summary": stats}
    (out / "run.json").write_text(json.dumps(record, indent=2, default=str))
    return stats


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


# ------------------------------------------------------------------ rlfleet side
def run_rlfleet(spec_path: str, budget_s: float) -> tuple[Path, float]:
    """`rlfleet run SPEC --no-view --duration BUDGET`; returns (run dir, launch unix time)."""
    cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", spec_path, "--no-view",
           "--duration", str(budget_s)]
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    try:
        rest, _ = proc.communicate(timeout=budget_s + 180)  # + start-up and the stop grace
    except subprocess.TimeoutExpired:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
        raise SystemExit(f"trl_peer: rlfleet run did not stop within {budget_s + 180:.0f} s:\n"
                         f"{(first + rest)[-2000:]}") from None
    if not first.startswith("run dir:"):
        raise SystemExit(f"trl_peer: rlfleet run printed no 'run dir:' line (exit {proc.returncode}):\n"
                         f"{(first + rest)[-2000:]}")
    if proc.returncode not in RUN_ENDED:
        raise SystemExit(f"trl_peer: rlfleet run failed (exit {proc.returncode}):\n{(first + rest)[-2000:]}")
    return Path(first.split("run dir:", 1)[1].strip()), launched


def run_trl_process(spec_path: str, out: Path, budget_s: float, threads: int | None) -> None:
    """The TRL side in a fresh process (this module without --side-by-side), as rlfleet's is."""
    cmd = [sys.executable, "-m", "rlfleet.tools.bench.trl_peer", "--spec", spec_path, "--out", str(out),
           "--budget-s", str(budget_s), *(["--threads", str(threads)] if threads else [])]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=budget_s + 300)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"trl_peer: the TRL run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")


# ------------------------------------------------------------------ the runs side by side
def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side's median and range over the runs (steps, train wall, tokens/s, last eval),
    the median of the per-run rlfleet/TRL tokens/s ratio, and per milestone each side's
    median time over the runs that reached it (and in how many runs it did)."""
    out: dict[str, Any] = {"runs": len(results)}
    for side in ("rlfleet", "trl"):
        out[side] = {key: median_range([r[side][key] for r in results if r[side].get(key) is not None])
                     for key in ("steps", "train_wall_s", "tokens_per_s", "eval_last")}
    ratios = [round(r["rlfleet"]["tokens_per_s"] / r["trl"]["tokens_per_s"], 3)
              for r in results if r["trl"].get("tokens_per_s")]
    out["tokens_per_s_ratio"] = {**(median_range(ratios) or {}), "each": ratios}
    levels = sorted({lv for r in results for lv in r.get("milestones", {})})
    out["milestones"] = {lv: {side: {"reached": sum(1 for r in results if (r.get("milestones", {}).get(lv) or {})
                                                    .get(side) is not None),
                                     "time_s": median_range([r["milestones"][lv][side]["time_s"] for r in results
                                                              if (r.get("milestones", {}).get(lv) or {}).get(side)])}
                              for side in ("rlfleet", "trl")} for lv in levels}
    return out


def side_by_side(spec_path: str, out: Path, budget_s: float, runs: int, threads: int | None,
                 json_out: Path | None, made_by: dict[str, Any]) -> int:
    """``runs`` times rlfleet and TRL, alternating which goes first; a record after each run."""
    results: list[dict[str, Any]] = []
    for i in range(runs):
        trl_out = out / f"run-{i}"
        order = ("rlfleet", "trl") if i % 2 == 0 else ("trl", "rlfleet")
        launch: dict[str, float] = {}
        rl_dir: Path | None = None
        for side in order:
            if side == "rlfleet":
                rl_dir, launch["rlfleet"] = run_rlfleet(spec_path, budget_s)
                print(f"run {i}: rlfleet run dir {rl_dir}", flush=True)
            else:
                run_trl_process(spec_path, trl_out, budget_s, threads)
        if (trl_launch := _launch_time(trl_out)) is not None:
            launch["trl"] = trl_launch
        assert rl_dir is not None
        result = compare(read_metrics(rl_dir / "metrics.jsonl"), read_metrics(trl_out / "metrics.jsonl"), launch)
        result.update(run=i, order=list(order), rlfleet_run=str(rl_dir), trl_run=str(trl_out))
        result["rlfleet"]["cpu_s"] = _cpu_by_daemon(rl_dir)  # where the fleet's CPU went
        results.append(result)
        print(f"-- run {i} ({' then '.join(order)})\n{format_table(result)}", flush=True)
        if json_out:
            write_json(json_out, {**made_by, "spec": spec_path, "budget_s": budget_s, "differences": DIFFERENCES,
                                  "runs": results, "summary": summarize(results)})
    if json_out:
        print(f"wrote {json_out}")
    return 0


# ------------------------------------------------------------------ CLI
def _cpu_by_daemon(run_dir: Path) -> dict[str, float] | None:
    """CPU seconds per daemon of an rlfleet run (its summary.json), None when it has none."""
    try:
        return json.loads((run_dir / "summary.json").read_text())["cpu_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _launch_time(run_dir: Path) -> float | None:
    try:
        return float(json.loads((run_dir / "run.json").read_text())["launch_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _report(result: dict[str, Any], json_out: Path | None) -> None:
    print(format_table(result), flush=True)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
        print(f"wrote {json_out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", help="job spec (TOML); needed to train")
    ap.add_argument("--model", help="model folder to use instead of the spec's model.path")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock cap of each run")
    ap.add_argument("--out", type=Path, required=True, help="the TRL run's folder (metrics.jsonl, run.json)")
    ap.add_argument("--max-steps", type=int, default=None, help="default: trainer.max_steps of the spec")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--compare", type=Path, metavar="RUN_DIR",
                    help="an rlfleet run folder to compare with; without --spec, --out must hold a TRL run")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run rlfleet, then TRL, with the same budget, and compare")
    ap.add_argument("--runs", type=int, default=3, help="with --side-by-side: how many times both sides run")
    ap.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: at least one")
    if args.side_by_side and (args.compare or not args.spec):
        ap.error("--side-by-side needs --spec and runs rlfleet itself (no --compare)")
    if args.side_by_side and (args.model or args.max_steps):
        ap.error("--model and --max-steps change the TRL side only; --side-by-side runs both "
                 "sides on the spec's model.path and trainer.max_steps")
    if not args.spec and not args.compare:
        ap.error("nothing to do: give --spec to train, --compare RUN_DIR to compare, or both")
    if args.budget_s <= 0:
        ap.error(f"--budget-s: must be > 0, got {args.budget_s:g}")
    if args.compare and args.spec and not (args.compare / "metrics.jsonl").is_file():
        ap.error(f"--compare: no metrics file {args.compare / 'metrics.jsonl'}")  # before training
    logging.basicConfig(level=logging.WARNING)

    rl_dir = args.compare
    if args.spec:
        try:
            spec = load_job(args.spec, args.model)
        except SpecError as exc:
            print(exc, file=sys.stderr)
            return 2
        task_for(spec)  # refuse a multi-turn task before anything runs
        if args.side_by_side:
            taken = [d for d in (args.out / f"run-{i}" for i in range(args.runs)) if (d / "metrics.jsonl").exists()]
            if taken:
                print(f"trl_peer: {taken[0] / 'metrics.jsonl'} already holds a run; pass another --out",
                      file=sys.stderr)
                return 2
            made_by = provenance("rlfleet.tools.bench.trl_peer", argv)  # before the runs: the code they start from
            return side_by_side(args.spec, args.out, args.budget_s, args.runs, args.threads, args.json, made_by)
        if (args.out / "metrics.jsonl").exists():
            print(f"trl_peer: {args.out / 'metrics.jsonl'} already holds a run; pass another --out",
                  file=sys.stderr)
            return 2
        stats = run_trl(spec, args.out, args.budget_s, max_steps=args.max_steps, threads=args.threads)
        print(f"trl: {stats['steps']} steps in {stats['train_wall_s']:.1f} s, eval "
              f"{stats.get('eval_first', float('nan')):.3f} -> {stats.get('eval_last', float('nan')):.3f}, "
              f"{stats['tokens_per_s']:.1f} trained tok/s   [{args.out}]", flush=True)
    if rl_dir is None:
        return 0
    rl_metrics, trl_metrics = rl_dir / "metrics.jsonl", args.out / "metrics.jsonl"
    for path in (rl_metrics, trl_metrics):
        if not path.is_file():
            print(f"trl_peer: no metrics file {path}", file=sys.stderr)
            return 2
    result = compare(read_metrics(rl_metrics), read_metrics(trl_metrics))
    result.update(rlfleet_run=str(rl_dir), trl_run=str(args.out))
    _report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
