"""metrics.jsonl: one JSON object per line, appended by the training thread.

A step line (``step_line``) has: time, step (= version: step n makes version n),
reward_mean/std, loss, trajectories, groups, tokens (generated tokens trained on),
tokens_per_s (over the step's compute), step_s, snapshot_s (the copy handed to the
publisher), wait_s (waiting for data), published_version / push_s (the last push
that finished), staleness {versions behind: trajectories in this step}, dropped
{reason: groups, job total}, trained_groups / pending_groups (job totals),
ratio_mean, clip_frac, approx_kl, entropy, grad_norm, lr, checkpoint (path or null),
mixed_version (trajectories in this step with a turn made by more than one weight
version: only the `partial` mode makes them), continuations (interrupted generations
continued, this step), repack_overhead_s (each repacked generation's wait, this step),
replayed (true only on a step made again after a restore: its step number appears twice,
the later line is the one whose weights live on; resume.py).
The sim trainer backend (sim_learner.py) has no ratio/KL/entropy/grad_norm/lr; it adds
model_step_s (the modeled step, in model seconds), batch_tokens (the prompt + completion
tokens it was modeled on) and sim_lag_s (wall seconds the step ran over its model).
Eval lines (daemons/trainer/evaluation.py) share the file: time, step, eval_success.

The main figures of each step line are Prometheus metrics of the trainer too (`export`),
for the cluster's dashboard (ansible/files/grafana/rlfleet.json); the file stays the record.

A full disk (docs/operations/disk-full.md) does not stop training for this file's sake: a line that
cannot be appended is cut back out (no torn line for readers), counted in
METRICS_LOG_FAILURES and logged once until a line is written again; the Prometheus
metrics are set all the same. The counters of the trainer's other disk failures
(checkpoints, journal) are here too, labelled with the member id (``set_member_id``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

STEP = Gauge("rlfleet_trainer_step", "Training steps done (= the weight version the last step made)")
REWARD_MEAN = Gauge("rlfleet_trainer_reward_mean", "Mean reward of the last step's trajectories")
STEP_TOKENS_PER_S = Gauge("rlfleet_trainer_step_tokens_per_second",
                          "Generated tokens trained on per second of the last step's compute")
TOKENS = PromCounter("rlfleet_trainer_tokens_total", "Generated tokens trained on")
STALENESS_MEAN = Gauge("rlfleet_trainer_staleness_mean",
                       "Mean versions behind of the last step's trajectories")
STALENESS_MAX = Gauge("rlfleet_trainer_staleness_max", "Most versions behind in the last step")
WAIT_SECONDS = Gauge("rlfleet_trainer_wait_seconds", "Time the last step waited for data")
DROPPED_GROUPS = Gauge("rlfleet_trainer_dropped_groups", "Groups dropped so far in the job, by reason",
                       ["reason"])
EVAL_SUCCESS = Gauge("rlfleet_trainer_eval_success", "Held-out success of the last evaluation")
PAUSED = Gauge("rlfleet_trainer_paused",
               "1 while the trainer holds at a step boundary, checkpointed (`rlfleet pause`)")

# Disk failures (docs/operations/disk-full.md); reason: no_space (ENOSPC, EDQUOT) or io_error.
CHECKPOINT_FAILURES = PromCounter("rlfleet_trainer_checkpoint_failures_total",
                                  "Checkpoints not written (the previous one kept), by reason",
                                  ["id", "reason"])
JOURNAL_WRITE_FAILURES = PromCounter("rlfleet_trainer_journal_write_failures_total",
                                     "Journal writes that failed (retried; nothing acked or trained "
                                     "meanwhile), by reason", ["id", "reason"])
JOURNAL_BLOCKED = Gauge("rlfleet_trainer_journal_blocked",
                        "1 while the journal cannot be written: intake and training wait", ["id"])
METRICS_LOG_FAILURES = PromCounter("rlfleet_trainer_metrics_log_failures_total",
                                   "metrics.jsonl lines not written, by reason", ["id", "reason"])

_member = {"id": ""}  # the trainer daemon's member id, the `id` label of the counters above

log = logging.getLogger("rlfleet.trainer")

_LEARNER_KEYS = ("ratio_mean", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr",
                 "model_step_s", "batch_tokens", "sim_lag_s")


def set_member_id(member_id: str) -> None:
    """Called once by the trainer daemon: the ``id`` label of the disk-failure metrics."""
    _member["id"] = member_id


def member_id() -> str:
    return _member["id"]


def io_reason(exc: BaseException) -> str:
    """no_space when the filesystem (or the quota) is full, io_error for any other I/O error."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "no_space"
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return "io_error"


def batch_versions(batch: list[Any]) -> dict[str, Any]:
    """What the step's trajectories say about their versions: how many mix versions
    within a turn, how many generations were continued, and each repack's overhead."""
    mixed = continued = 0
    overheads: list[float] = []
    for group in batch:
        for st in group:
            t = st.trajectory
            mixed += any(len({seg.version for seg in turn.segments}) > 1 for turn in t.turns)
            continued += _count(t.info.get("continuations", ""))
            overheads += _seconds(t.info.get("repack_overhead_s", ""))
    return {"mixed_version": mixed, "continuations": continued, "repack_overhead_s": overheads}


def _count(raw: str) -> int:
    # info is the env-host's free text: a malformed figure is no figure, never an error
    return int(raw) if raw.isdigit() else 0


def _seconds(raw: str) -> list[float]:
    out = []
    for x in raw.split(","):
        try:
            v = float(x)
        except ValueError:
            continue
        if 0 <= v < 1e6:
            out.append(v)
    return out


def step_line(*, version: int, stats: dict[str, Any], ages: Counter[int], wait_s: float,
              snapshot_s: float, publisher: Any, summary: dict[str, Any],
              checkpoint: Path | None, versions: dict[str, Any] | None = None,
              replayed: bool = False) -> dict[str, Any]:
    """The metrics line of one training step (``stats``: what the learner's train_step returned;
    ``summary``: the journal's job totals; ``replayed``: a step lost to a restore, made
    again from its original batch, resume.py)."""
    return {
        "time": round(time.time(), 3), "step": version, "version": version,
        "reward_mean": stats["reward_mean"], "reward_std": stats["reward_std"],
        "loss": stats["loss"], "trajectories": stats["trajectories"], "groups": stats["groups"],
        "tokens": int(stats["tokens"]),
        "tokens_per_s": round(stats["tokens"] / max(stats["step_s"], 1e-9), 1),
        "step_s": round(stats["step_s"], 4), "snapshot_s": round(snapshot_s, 4),
        "wait_s": round(wait_s, 4),
        # the push runs behind training: these describe the last push that finished
        "published_version": getattr(publisher, "published_version", None),
        "push_s": round(getattr(publisher, "last_publish_s", 0.0), 4),
        "staleness": {str(k): v for k, v in sorted(ages.items())},
        **summary,  # dropped {reason: groups}, trained_groups, pending_groups: job totals
        **{k: stats[k] for k in _LEARNER_KEYS if k in stats},
        "checkpoint": str(checkpoint) if checkpoint else None,
        **(versions or {}),
        **({"replayed": True} if replayed else {}),
    }


def append_json_line(path: Path, line: dict[str, Any]) -> None:
    """Append one JSON line; on an OSError (a full disk) the file is cut back to where it
    was before raising: a torn line would break every reader of the file."""
    data = (json.dumps(line) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except OSError:
            f.truncate(start)
            raise


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.error = ""  # why the last line was not written; "" once one is again

    def append(self, line: dict[str, Any]) -> None:
        export(line)
        try:
            append_json_line(self.path, line)
        except OSError as exc:
            self.failed(line, exc)
            return
        if self.error:
            log.info("metrics lines written to %s again", self.path, extra={"event": "metrics_log_ok"})
            self.error = ""

    def failed(self, line: dict[str, Any], exc: OSError) -> None:
        reason = io_reason(exc)
        METRICS_LOG_FAILURES.labels(id=member_id(), reason=reason).inc()
        if not self.error:  # once per outage: a full disk fails every step
            log.error("metrics line of step %s not written to %s (%s: %s); training goes on",
                      line.get("step"), self.path, reason, exc, extra={"event": "metrics_log_error"})
        self.error = f"{reason}: {exc}"


def export(line: dict[str, Any]) -> None:
    """Set the trainer's Prometheus metrics from one step line."""
    STEP.set(line["step"])
    REWARD_MEAN.set(line["reward_mean"])
    STEP_TOKENS_PER_S.set(line["tokens_per_s"])
    TOKENS.inc(line["tokens"])
    WAIT_SECONDS.set(line["wait_s"])
    ages = {int(k): n for k, n in line["staleness"].items()}
    if ages:
        STALENESS_MEAN.set(sum(k * n for k, n in ages.items()) / max(sum(ages.values()), 1))
        STALENESS_MAX.set(max(ages))
    for reason, groups in (line.get("dropped") or {}).items():
        DROPPED_GROUPS.labels(reason=reason).set(groups)
