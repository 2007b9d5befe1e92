"""A step line of metrics.jsonl is also the trainer's Prometheus metrics (the cluster
dashboard's training panels)."""

from __future__ import annotations

import json
from collections import Counter

from prometheus_client import REGISTRY

from rlfleet.daemons.trainer.metrics_log import MetricsLog, step_line


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_step_line_sets_the_trainer_metrics(tmp_path):
    tokens_before = value("rlfleet_trainer_tokens_total") or 0.0
    stats = {"reward_mean": 0.75, "reward_std": 0.1, "loss": 0.2, "trajectories": 32, "groups": 4,
             "tokens": 640, "step_s": 0.5}
    line = step_line(version=7, stats=stats, ages=Counter({0: 8, 1: 16, 2: 8}), wait_s=0.25, snapshot_s=0.0,
                     publisher=None, summary={"dropped": {"staleness": 3}, "trained_groups": 28},
                     checkpoint=None)
    MetricsLog(tmp_path / "metrics.jsonl").append(line)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 7  # the file is unchanged
    assert value("rlfleet_trainer_step") == 7
    assert value("rlfleet_trainer_reward_mean") == 0.75
    assert value("rlfleet_trainer_step_tokens_per_second") == 1280.0
    assert value("rlfleet_trainer_tokens_total") == tokens_before + 640
    assert value("rlfleet_trainer_staleness_mean") == 1.0  # (0*8 + 1*16 + 2*8) / 32
    assert value("rlfleet_trainer_staleness_max") == 2
    assert value("rlfleet_trainer_wait_seconds") == 0.25
    assert value("rlfleet_trainer_dropped_groups", reason="staleness") == 3
