"""A trainer restart loses no step (daemons/trainer/resume.py): kill -9 mid-step,
mid-checkpoint and mid-publish, one after another, with the staleness bound tight; with
the torch backend and with the megatron backend (on the CPU).

On main before this, a restarted trainer took the journal's version with the
checkpoint's weights, so every reopened group was judged staler than it had been and
dropped: here each of them is trained again at its original step, and the weights at
the end are the weights of a run that was never killed, on the same data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.failpoints import TRAINER as FAILPOINT_ENV
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.daemons.trainer.journal import ExperienceJournal
from rlfleet.tools.run.report import read_metrics, summary
from tests.integration.helpers import stop, wait_for, write_spec

from .conftest import scored
from .test_daemon import JOB, REPO, address
from .test_daemon import SPEC as DAEMON_SPEC

SPEC = DAEMON_SPEC + "max_staleness = 2\n"  # [trainer] is its last section
STEPS = 6
# The megatron backend on the CPU (megatron/on_cpu.py): its checkpoints are megatron's
# distributed checkpoints (distcp/) plus the HF weights compared below.
BACKENDS = {"torch": "", "megatron": '[trainer.backend]\nkind = "megatron"\n'}


def batch(i: int) -> list:
    """Step i+1's two groups, generated two versions behind it (staleness 2, the bound)."""
    return [scored(p, k, float(k), tokens=(7 + k, 8, 2), version=max(0, i - 2))
            for p in (2 * i, 2 * i + 1) for k in range(2)]


@pytest.fixture(params=sorted(BACKENDS))
def trainers(request, tmp_path, etcd, tiny_model):
    if request.param == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'rlfleet[megatron]'")
    spec = write_spec(tmp_path, JOB, SPEC + BACKENDS[request.param], model=tiny_model)
    store = EtcdStore(etcd.endpoints)
    procs: list[subprocess.Popen] = []

    def run(run_dir: Path, member_id: str, batches: int, failpoint: str = "", *,
            paced: bool = False) -> subprocess.Popen:
        """A trainer sent every trajectory of the first ``batches`` steps (what an earlier
        one acked comes again: duplicates are acked and ignored); with a failpoint, it is
        waited for until it has killed itself. ``paced``: each batch only once the one
        before it was trained (the buffer holds (1 + α) batches, as claim pacing keeps it)."""
        env = {k: v for k, v in os.environ.items() if k != FAILPOINT_ENV}
        env.update({"RLFLEET_RUN_DIR": str(run_dir), **({FAILPOINT_ENV: failpoint} if failpoint else {})})
        log = tmp_path / f"{member_id}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.tools.cli", "daemon", "trainer", "--job", JOB,
             "--etcd", etcd.endpoints_arg, "--spec", str(spec), "--id", member_id],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=REPO, env=env)
        procs.append(proc)
        sender = ReliableSender(address(store, member_id, log), resend_after_s=0.5)
        for i in range(batches):
            for st in batch(i):
                sender.send(st.trajectory.trajectory_id, st)
            if paced:
                assert sender.flush(30), f"{sender.pending()} trajectories not acked"
                wait_for(f"step {i + 1}", lambda: len(metrics_of(run_dir)) == i + 1, timeout_s=60)
        if failpoint:
            wait_for(f"{member_id} killed at {failpoint} (log: {log})", lambda: (sender.poll(0.05), proc.poll())[1] is not None,
                     timeout_s=60)
            assert proc.returncode == -9, log.read_text()[-2000:]
        else:
            assert sender.flush(30), f"{sender.pending()} trajectories not acked"
        sender.close()
        return proc

    yield run, store, tmp_path
    for proc in procs:
        stop(proc)
    store.close()


def test_kill_9_mid_step_mid_checkpoint_mid_publish_loses_no_step(trainers):
    run, store, tmp = trainers
    killed = tmp / "killed"
    run(killed, "trainer-a", 3, "kill_mid_step:3")          # steps 1, 2 (checkpoint 2); 3 lost unjournaled
    run(killed, "trainer-b", 4, "kill_mid_checkpoint:4")    # 3, 4 journaled; the checkpoint of 4 never lands
    run(killed, "trainer-c", 5, "kill_mid_publish:5")       # 3, 4 again (checkpoint 4), 5 journaled, then killed
    last = run(killed, "trainer-d", STEPS)                  # 5 again, then 6
    wait_for("step 6", lambda: any(x["version"] == STEPS for x in metrics_of(killed)), timeout_s=60)
    assert stop(last) == 0

    m = metrics_of(killed)
    # Killed mid-checkpoint and mid-publish, steps 4 and 5 were journaled before their
    # metrics line: their only lines are those of the re-trained steps.
    assert [(x["version"], bool(x.get("replayed"))) for x in m] == [
        (1, False), (2, False), (3, False), (3, True), (4, True), (5, True), (6, False)]
    assert all(x["staleness"] in ({"0": 4}, {"1": 4}, {"2": 4}) for x in m)  # none judged staler than it was
    with ExperienceJournal(killed / "checkpoints" / "journal.bin") as j:
        consumed = set(j.state.trained) | set(j.state.dropped)
        assert j.state.dropped == {} and j.state.pending == {}
        assert set(j.state.trained) == {f"p{p}" for p in range(2 * STEPS)} == consumed
    s = summary(read_metrics(killed / "metrics.jsonl"))
    assert s["steps"] == STEPS and s["retrained_steps"] == 3
    logs = "".join((tmp / f"trainer-{x}.log").read_text() for x in "bcd")
    for resumed in ("resumed at version 2 (the checkpoint's), 0 steps (0 groups)",
                    "resumed at version 2 (the checkpoint's), 2 steps (4 groups) to re-train up to version 4",
                    "resumed at version 4 (the checkpoint's), 1 steps (2 groups) to re-train up to version 5"):
        assert resumed in logs

    # The same data, never killed: the same weights (the re-trained steps repeat the lost
    # ones from the same checkpoint, optimizer and RNG state, on the same batches).
    whole = tmp / "whole"
    assert stop(run(whole, "trainer-e", STEPS, paced=True)) == 0
    a = load_file(str(killed / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors"))
    b = load_file(str(whole / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def metrics_of(run_dir: Path) -> list[dict]:
    """The step lines of ``run_dir/metrics.jsonl`` (evaluation lines have no loss)."""
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if "loss" in x]
