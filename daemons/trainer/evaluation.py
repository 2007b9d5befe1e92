"""Held-out evaluation inside the trainer: greedy success on the task's eval split.

Run by the training thread every `task.eval_every_steps` versions (and once for
version 0), on the learner's own weights, so an eval line describes exactly one
version. It costs the trainer time but keeps rollouts free for training; the
eval set is small (`task.eval_size`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from rlfleet.common.spec.job import JobSpec
from rlfleet.daemons.trainer.metrics_log import EVAL_SUCCESS, MetricsLog, append_json_line

log = logging.getLogger("rlfleet.trainer")

EVAL_CHUNK = 64  # prompts evaluated between two looks at the stop flag


def task_for(spec: JobSpec) -> Any:
    """The same Task object the env-hosts train on (one definition: the spec's [task])."""
    from rlfleet.daemons.tasks.prompts import task_from_spec

    return task_from_spec(spec)


def evaluation_off(spec: JobSpec, learner: Any) -> str | None:
    """Why held-out evaluation cannot run for this job, or None when it can. It needs a
    policy to generate with (the sim backend has none) and the model's tokenizer (a bare
    weights folder has none)."""
    if getattr(learner, "model", None) is None and not hasattr(learner, "eval_policy"):
        return (f"the {spec.trainer.backend.kind} trainer backend has no policy to generate with")
    if not (Path(spec.model.path) / "tokenizer.json").exists():
        return f"no tokenizer in {spec.model.path}"
    return None


def policy_to_evaluate(learner: Any) -> Any:
    """The HF module evaluation generates with: the torch learner's own model, or for a
    learner whose model is not an HF one (megatron) the copy its ``eval_policy()`` makes."""
    make = getattr(learner, "eval_policy", None)
    return make() if make is not None else learner.model


class Evaluator:
    def __init__(self, spec: JobSpec, metrics_path: Path) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.metrics_path = metrics_path
        self.task = task_for(spec)
        self.tokenizer = AutoTokenizer.from_pretrained(str(spec.model.path))
        self.prompts = self.task.make_prompts("eval", spec.task.eval_size, seed=spec.task.eval_seed)
        self.done_versions = self._already_evaluated()

    def _already_evaluated(self) -> set[int]:
        """Versions with an eval line already (a restarted trainer does not repeat them)."""
        done: set[int] = set()
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "eval_success" in rec:
                    done.add(int(rec.get("step", -1)))
        return done

    def due(self, version: int) -> bool:
        every = self.spec.task.eval_every_steps
        last = version >= self.spec.trainer.max_steps
        return version not in self.done_versions and (version % every == 0 or last)

    def run(self, model: Any, version: int, stop: threading.Event | None = None) -> float | None:
        """Held-out success of ``model`` as version ``version``, written as an eval line; None
        if ``stop`` was set meanwhile (checked every EVAL_CHUNK prompts: a trainer asked to
        stop does not finish a long evaluation first; nothing is written, it is due again)."""
        import torch

        from rlfleet.daemons.tasks.episodes import evaluate_model

        started = time.monotonic()
        log.info("evaluating version %d on %d held-out prompts", version, len(self.prompts),
                 extra={"event": "eval_start"})
        was_training = model.training
        model.eval()
        wins = 0.0
        try:
            with torch.no_grad():
                for at in range(0, len(self.prompts), EVAL_CHUNK):
                    if stop is not None and stop.is_set():
                        log.info("evaluation of version %d abandoned after %d of %d prompts: stopping",
                                 version, at, len(self.prompts), extra={"event": "eval_abandoned"})
                        return None
                    chunk = self.prompts[at:at + EVAL_CHUNK]  # greedy: the same answers as in one call
                    wins += len(chunk) * evaluate_model(model, self.tokenizer, self.task, chunk, greedy=True,
                                                        seed=self.spec.job.seed)
        finally:
            if was_training:
                model.train()
        success = wins / len(self.prompts) if self.prompts else 0.0
        line = {"time": round(time.time(), 3), "step": version, "version": version,
                "eval_success": success, "eval_n": len(self.prompts),
                "eval_s": round(time.monotonic() - started, 3)}
        try:
            append_json_line(self.metrics_path, line)
        except OSError as exc:  # a full disk (docs/operations/disk-full.md): the metric still tells
            MetricsLog(self.metrics_path).failed(line, exc)
        self.done_versions.add(version)
        EVAL_SUCCESS.set(success)
        log.info("eval at version %d: success %.3f on %d held-out prompts", version, success,
                 len(self.prompts), extra={"event": "eval", "eval_success": success})
        return success
