"""The multi-stage reward service in a real job: `rlfleet run` of the shipped
examples/arithmetic-multistage.toml (a rule check on local worker processes, then a
simulated judge with a long tail; EBF and timeout-aware scaling). Trajectories are
scored through both stages (the reward-host's own Prometheus metrics), plans change
the stages' worker counts, the reward-host is killed -9 with trajectories in its
pipeline, and afterwards the accounting invariant holds: every claimed prompt trained,
dropped with a reason, or in flight; none lost.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.tools.exit_codes import Exit

from .helpers import REPO, TINY_MODEL, rlfleet, stop, wait_for

pytestmark = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

JOB = "arithmetic-multistage"


def example_spec(tmp_path: Path) -> Path:
    text = (REPO / "examples" / "arithmetic-multistage.toml").read_text()
    for old, new in (('path = "../models/tiny-qwen2"', f'path = "{TINY_MODEL}"'),
                     ('runs_dir = "runs"', f'runs_dir = "{tmp_path / "runs"}"'),
                     ("lease_ttl_s = 3.0", "lease_ttl_s = 2.0"), ("retry_timeout_s = 1.0", "retry_timeout_s = 0.5")):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "arithmetic-multistage.toml"
    path.write_text(text)
    return path


def reward_host(store: EtcdStore) -> dict | None:
    members = [kv.value for kv in store.get_prefix(JobKeys(JOB).role_members_prefix("reward-host"))]
    return members[0] if members and members[0].get("state") == "running" else None


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from a daemon's /metrics."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def stage_ok(metrics: dict, stage: str) -> float:
    return metrics.get(("rlfleet_reward_stage_requests_total",
                        (("outcome", "ok"), ("stage", stage))), 0.0)


def scored_through_both(store: EtcdStore, pid: int | None = None) -> dict | None:
    """The reward-host's metrics once it has scored a batch's worth through both stages,
    applied a plan that moved the judge from its cold start, and closed a batch (its
    extra delay measured); None before. ``pid``: a reward-host other than this one."""
    member = reward_host(store)
    if member is None or (pid is not None and member["pid"] == pid):
        return None
    try:
        metrics = scrape(member["metrics"])
    except OSError:
        return None
    done = (stage_ok(metrics, "check") >= 32 and stage_ok(metrics, "judge") >= 32
            and metrics.get(("rlfleet_reward_plan_changes_total", (("stage", "judge"),)), 0) >= 1
            and metrics.get(("rlfleet_reward_batch_extra_delay_seconds_count", ()), 0) >= 1)
    return metrics if done else None


def test_the_multistage_example_trains_and_survives_kill_9_of_the_reward_host(tmp_path, etcd):
    log = tmp_path / "run.log"
    proc = rlfleet("run", str(example_spec(tmp_path)), "--etcd", etcd.endpoints_arg, "--no-view",
                   "--duration", "280", log=log)
    store = EtcdStore(etcd.endpoints)
    try:
        run_dir = Path(wait_for("the run dir line", lambda: next(
            (line.split("run dir:", 1)[1].strip() for line in log.read_text().splitlines()
             if line.startswith("run dir:")), None), timeout_s=30))
        metrics = wait_for("a batch scored through both stages and a plan applied",
                           lambda: scored_through_both(store), timeout_s=180)
        assert stage_ok(metrics, "check") >= stage_ok(metrics, "judge")  # in order

        victim = wait_for("trajectories in the reward pipeline", lambda: (
            (m := reward_host(store)) and m.get("in_flight", 0) > 0 and m), timeout_s=60)
        os.kill(victim["pid"], signal.SIGKILL)
        # A new process, cold, scores through both stages and scales again (its counters
        # start at 0).
        wait_for("the restarted reward-host to score through both stages",
                 lambda: scored_through_both(store, pid=victim["pid"]), timeout_s=180)
    finally:
        code = stop(proc, timeout_s=60)
    assert code == Exit.STOPPED, log.read_text()[-3000:]  # stopped by SIGTERM, accounting checked

    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["ok"], accounting
    assert accounting["lost_total"] == 0 and accounting["trained"] > 0
    assert accounting["claimed"] == (accounting["trained"] + accounting["dropped_total"]
                                     + accounting["in_flight"])
