"""The real trainer daemon process against a real etcd: acks, steps, kill -9, resume.

Trajectories go in through a ReliableSender exactly as the reward-host sends
them; the test reads what the trainer wrote (metrics.jsonl, the journal, the
checkpoint record in etcd) and what it registered (its member record).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.failpoints import TRAINER as FAILPOINT_ENV
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.daemons.trainer.journal import ExperienceJournal
from tests.integration.helpers import start_daemon, stop, wait_for, write_spec

from .conftest import claim_prompts, scored

JOB = "tt"
SPEC = """\
group_size = 2

[trainer]
batch_size = 4
learning_rate = 0.001
checkpoint_every = 2
max_steps = 100
"""
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def setup(tmp_path, etcd, tiny_model):
    model = tiny_model
    spec = write_spec(tmp_path, JOB, SPEC, model=model)
    store = EtcdStore(etcd.endpoints)
    procs: list[subprocess.Popen] = []

    def start(member_id: str, **env: str) -> subprocess.Popen:
        proc = start_daemon("trainer", member_id, job=JOB, etcd=etcd.endpoints_arg, log_dir=tmp_path,
                            run_dir=tmp_path / "run", args=("--spec", str(spec)), env=env)
        procs.append(proc)
        return proc

    yield start, store, tmp_path
    for proc in procs:
        stop(proc)
    store.close()


def member(store: EtcdStore, member_id: str) -> dict:
    kv = store.get(JobKeys(JOB).member("trainer", member_id))
    return kv.value if kv else {}


def address(store: EtcdStore, member_id: str, log: Path) -> str:
    claim_prompts(store, JOB)
    return wait_for(f"{member_id} serving trajectories (log: {log})",
                    lambda: member(store, member_id).get("addresses", {}).get("trajectories"),
                    timeout_s=60)


def metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def send_all(sender: ReliableSender, items) -> None:
    for st in items:
        sender.send(st.trajectory.trajectory_id, st)
    assert sender.flush(30), f"{sender.pending()} trajectories not acked"
    assert sender.failed == []


def group(p: int, version: int = 0) -> list:
    return [scored(p, 0, 1.0, tokens=(7, 8), version=version),
            scored(p, 1, 0.0, tokens=(9, 10, 2), version=version)]


def test_journal_before_ack_training_and_resume_after_kill_9(setup):
    """Three trainer processes in turn (one test: each start costs seconds of imports).

    x: dies between journaling a trajectory and acking it (a failpoint);
    a: receives the resend, trains 3 steps (checkpoint at 2), is SIGKILLed;
    b: a standby meanwhile (socket closed); takes over and resumes from checkpoint 2
       + the journal, versions going on from 3.
    """
    start, store, tmp = setup
    journal_path = tmp / "run" / "checkpoints" / "journal.bin"

    # -- x: the ack is sent only after the fsync ------------------------------------
    x = start("trainer-x", **{FAILPOINT_ENV: "exit_after_journal"})
    sender = ReliableSender(address(store, "trainer-x", tmp / "trainer-x.log"), resend_after_s=0.5)
    first = group(0)[0]
    sender.send(first.trajectory.trajectory_id, first)
    wait_for("the failpoint exit", lambda: sender.poll(0.1) is not None and x.poll() is not None)
    assert x.returncode == 17  # died between the journal's fsync and the ack ...
    assert sender.pending() == 1  # ... so no ack left
    with ExperienceJournal(journal_path) as j:
        assert {g: list(ts) for g, ts in j.state.pending.items()} == {"p0": ["p0-g0"]}  # on disk
    sender.close()

    # -- a: trains, checkpoints, publishes metrics; then kill -9 ----------------------
    a = start("trainer-a")
    sender = ReliableSender(address(store, "trainer-a", tmp / "trainer-a.log"), resend_after_s=0.5)
    # Six complete groups = 3 steps (B=4, G=2); p0-g0 is the upstream's resend.
    send_all(sender, [st for p in range(6) for st in group(p)])
    wait_for("3 steps in metrics.jsonl", lambda: len(metrics(tmp)) == 3, timeout_s=60)
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3]
    assert m[0]["trajectories"] == 4 and m[0]["tokens"] == 10 and m[0]["reward_mean"] == 0.5
    assert m[0]["staleness"] == {"0": 4} and m[2]["staleness"] == {"2": 4}
    assert m[2]["trained_groups"] == 6 and m[1]["checkpoint"]
    ckpt = wait_for("checkpoint record", lambda: store.get(JobKeys(JOB).trainer_checkpoint))
    assert ckpt.value["version"] == 2 and Path(ckpt.value["path"]).is_dir()
    # A standby: registered, socket closed (nothing to send to), waiting for leadership.
    b = start("trainer-b")
    wait_for("trainer-b registered", lambda: member(store, "trainer-b").get("training") == "standby")
    assert "trajectories" not in member(store, "trainer-b")["addresses"]
    # Acked but not yet trainable: p6 complete (one group short of a batch), p7 half,
    # p8 dropped upstream (its whole group is accounted as dropped).
    send_all(sender, [*group(6, 3), group(7, 3)[0],
                      scored(8, 0, 0.0, dropped_reason="env_error"), scored(8, 1, 1.0)])
    wait_for("version 3 in the member record", lambda: member(store, "trainer-a").get("version") == 3)
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    sender.close()

    # -- b: the standby takes over, resuming from the checkpoint and the journal -------
    sender = ReliableSender(address(store, "trainer-b", tmp / "trainer-b.log"), resend_after_s=0.5)
    # The checkpoint's version and weights (2); the two groups of step 3 lost their
    # training with the kill and are trained again as step 3, in their original batch.
    assert "resumed at version 2 (the checkpoint's), 1 steps (2 groups) to re-train up to version 3, 4 pending groups" in (
        tmp / "trainer-b.log").read_text()
    wait_for("step 3 made again", lambda: len(metrics(tmp)) == 4, timeout_s=60)
    # With p7 completed, 2 more complete groups (p6, p7): step 4. p6 again: duplicates, acked, ignored.
    send_all(sender, [group(7, 3)[1], *group(6, 3)])
    wait_for("1 more step", lambda: len(metrics(tmp)) == 5, timeout_s=60)
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3, 3, 4]
    # Step 3 again, from the restored version-2 weights, optimizer and batch: the same loss
    # to the last bit, and the same staleness (nothing dropped for it).
    assert m[3]["replayed"] and "replayed" not in m[2]
    assert m[3]["loss"] == m[2]["loss"] and m[3]["staleness"] == {"2": 4}
    assert m[-1]["trained_groups"] == 8 and m[-1]["dropped"] == {"env_error": 1}
    assert m[-1]["pending_groups"] == 0
    wait_for("version 4 in the member record", lambda: member(store, "trainer-b").get("version") == 4)
    sender.close()
    assert stop(b) == 0

    # Accounting: every acked group is trained or dropped with a reason, none lost,
    # and the resent p0-g0 was journaled once.
    with ExperienceJournal(journal_path) as j:
        assert set(j.state.trained) == {f"p{p}" for p in range(8)}
        assert j.state.dropped["p8"][0] == "env_error"
        assert j.state.pending == {}
        assert max(j.state.trained.values()) == 4
    # The clean stop checkpointed the last version.
    assert store.get(JobKeys(JOB).trainer_checkpoint).value["version"] == 4


def test_non_finite_rewards_and_steps_leave_training_advancing(setup, etcd):
    """The attack of issue 28 against the real daemon: a group [1e300, 0] and a user reward
    of 1e39 are dropped as non_finite at selection; groups whose behaviour log-probs are
    -1e30 (finite, <= 0: every wire check passes; the loss is inf) make three steps in a
    row skip, and the trainer restores its last checkpoint and re-trains what came after.
    Training advances throughout, no weight is ever non-finite, status names it."""
    start, store, tmp = setup
    a = start("trainer-a")
    sender = ReliableSender(address(store, "trainer-a", tmp / "trainer-a.log"), resend_after_s=0.5)
    send_all(sender, [st for p in range(4) for st in group(p)])
    wait_for("2 steps, checkpoint at 2", lambda: len(metrics(tmp)) == 2 and metrics(tmp)[1]["checkpoint"],
             timeout_s=60)
    attack = [scored(4, 0, 1e300), scored(4, 1, 0.0), scored(5, 0, 1e39), scored(5, 1, 0.0)]
    send_all(sender, [*attack, *group(6, 2), *group(7, 2)])
    wait_for("step 3 from the honest groups", lambda: len(metrics(tmp)) == 3, timeout_s=60)
    assert metrics(tmp)[2]["dropped"] == {"non_finite": 2}
    info = wait_for("the member record", lambda: (i := member(store, "trainer-a")).get("non_finite_groups") and i)
    assert info["non_finite_groups"] == 2 and "p5-g0: reward 1e+39 is not finite in float32" in info["non_finite"]

    poison = [scored(p, k, float(k), logprobs=[-1e30, -1e30], version=3) for p in range(8, 14) for k in range(2)]
    send_all(sender, poison)
    wait_for("3 steps skipped and a rewind", lambda: member(store, "trainer-a").get("rewinds") == 1, timeout_s=60)
    info = member(store, "trainer-a")
    assert (info["non_finite_steps"], info["non_finite_groups"]) == (3, 8) and "loss not finite" in info["non_finite"]
    log_a = (tmp / "trainer-a.log").read_text()
    assert "3 steps in a row skipped (trainer.max_skipped_steps): restored checkpoint version 2 (was at 3)" in log_a
    send_all(sender, [*group(14, 3), *group(15, 3)])
    wait_for("step 3 re-trained, then step 4", lambda: len(metrics(tmp)) == 5, timeout_s=60)
    m = metrics(tmp)
    assert [x["version"] for x in m] == [1, 2, 3, 3, 4] and m[3]["replayed"]
    assert m[-1]["dropped"] == {"non_finite": 8} and m[-1]["trained_groups"] == 8
    assert all(x["loss"] == x["loss"] and abs(x["grad_norm"]) < float("inf") for x in m)

    status = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", JOB,
                             "--etcd", etcd.endpoints_arg, "--output", "json"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    problems = json.loads(status.stdout)["problems"]
    assert status.returncode == 1 and any(
        "trainer/trainer-a: 8 groups dropped for non-finite numbers (3 steps skipped, 1 checkpoints restored)" in p
        for p in problems), problems
    sender.close()
    assert stop(a) == 0
    import torch
    from safetensors.torch import load_file
    final = tmp / "run" / "checkpoints" / "step-00000004" / "model.safetensors"
    assert all(bool(torch.isfinite(t).all()) for t in load_file(str(final)).values())


def test_a_squat_is_refused_and_the_real_group_trains(setup):
    """Forged ids cannot take a real trajectory's place: p0-g99 (no slot 99 in a group of
    2) and p1-g0 claiming group p0 are refused with the reason, before the real p0 and p1
    arrive; both real groups train untouched."""
    start, store, tmp = setup
    a = start("trainer-a")
    sender = ReliableSender(address(store, "trainer-a", tmp / "trainer-a.log"), resend_after_s=0.5)
    squat = scored(0, 99, 1e3)
    stray = scored(1, 0, 1e3)
    stray = type(stray)(trajectory=type(stray.trajectory)(**{
        **{f: getattr(stray.trajectory, f) for f in stray.trajectory.__struct_fields__}, "group_id": "p0"}),
        reward=1e3)
    for forged in (squat, stray):
        sender.send(forged.trajectory.trajectory_id, forged)
    assert sender.flush(30)
    assert sorted(sender.failed) == [
        ("p0-g99", "identity: trajectory_id 'p0-g99' is not p0-g<k> with 0 <= k < 2 "
                   "(task.group_size + env_host.redundant_samples)"),
        ("p1-g0", "identity: group_id 'p0' is not 'p1' (prompt_id 1)")]
    sender.failed.clear()
    send_all(sender, [*group(0), *group(1)])
    wait_for("step 1", lambda: len(metrics(tmp)) == 1, timeout_s=60)
    m = metrics(tmp)[0]
    assert m["trained_groups"] == 2 and m["dropped"] == {} and m["reward_mean"] == 0.5
    sender.close()
    assert stop(a) == 0


def test_sigterm_during_the_resume_evaluation_stops_the_trainer_at_once(tmp_path, etcd):
    """A trainer asked to stop while it evaluates version 0 at start-up abandons the
    evaluation and exits cleanly, instead of finishing it first (it ignored SIGTERM ~10 s):
    judged by what its log says it did, not by a wall-clock bound."""
    from tests.integration.helpers import TINY_MODEL
    spec = write_spec(tmp_path, JOB, "eval_size = 2048\n" + SPEC, model=TINY_MODEL)
    log = tmp_path / "trainer-a.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.tools.cli", "daemon", "trainer", "--job", JOB,
         "--etcd", etcd.endpoints_arg, "--spec", str(spec), "--id", "trainer-a"],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, cwd=REPO, env={**os.environ, "RLFLEET_RUN_DIR": str(tmp_path / "run")})
    try:
        wait_for("the evaluation of version 0 under way",
                 lambda: "evaluating version 0 on 2048 held-out prompts" in log.read_text(), timeout_s=90)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        text = log.read_text()
        assert proc.returncode == 0, text[-3000:]
        assert "evaluation of version 0 abandoned after" in text, text[-3000:]
        assert "eval at version 0: success" not in text, text[-3000:]
    finally:
        stop(proc)
