"""The real env-host and reward-host daemons (subprocesses) with real etcd, a fake rollout
and a fake trainer on real sockets. The env-host is SIGKILLed mid-stream and restarted
with the same id: it resumes its journal, and the accounting invariant holds — every
claimed prompt is trained-side delivered (all G trajectories) or still in flight."""

from __future__ import annotations

import os
import signal
import time

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.daemons.env_host.claims import parse_cursor
from rlfleet.daemons.env_host.journal import TrajectoryJournal
from rlfleet.daemons.tasks.prompts import parse_trajectory_id, trajectory_id
from tests.daemons.reward_host.fakes import FakeTrainer
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .fakes import FakeRollout, policy, tokenizer_dir
from .test_runner import solve

JOB = "ehtest"
G = 2
SPEC = """\
group_size = {g}

[env_host]
max_concurrent = 8
turn_timeout_s = 5
trajectory_timeout_s = 10

[reward_host.backend]
workers = 1
"""


def test_env_host_survives_sigkill_and_accounts_for_every_prompt(tmp_path, etcd):
    # This test once failed about 1 run in 15 under load (a claimed prompt neither
    # delivered nor journaled): a claim's etcd swap that timed out after etcd applied it
    # left a range recorded as ours but never journaled (fixed in claims.py, tested in
    # test_claims.py). It runs once, without a retry.
    _sigkill_and_account(tmp_path, etcd, JOB)


def _sigkill_and_account(tmp_path, etcd, JOB):
    tmp_path.mkdir(parents=True, exist_ok=True)
    keys = JobKeys(JOB)
    store = EtcdStore(etcd.endpoints)
    trainer = FakeTrainer()

    def slow_solver(srv, req):
        time.sleep(0.01)
        return policy(solve, version=3)(srv, req)

    rollout = FakeRollout(slow_solver)
    store.put(keys.member("trainer", "t-0"), {"id": "t-0", "state": "running", "leader": True,
                                              "addresses": {"trajectories": trainer.address}})
    store.put(keys.member("rollout", "r-0"), {"id": "r-0", "state": "running",
                                              "addresses": {"requests": rollout.address}})
    spec = write_spec(tmp_path, JOB, SPEC.format(g=G), model=tokenizer_dir())
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(role: str, member_id: str):
        return rlfleet("daemon", role, "--job", JOB, "--etcd", etcd.endpoints_arg, "--id", member_id,
                       "--spec", str(spec), log=logs / f"{member_id}.log")

    reward_host = start("reward-host", "rh-0")
    env_host = start("env-host", "eh-0")
    try:
        wait_for("trajectories reach the trainer", lambda: len(trainer.unique()) >= 20, timeout_s=60)
        os.kill(env_host.pid, signal.SIGKILL)
        env_host.wait(10)
        before = len(trainer.unique())
        nxt_at_kill, _ = parse_cursor(store.get(keys.prompts_cursor).value)

        env_host = start("env-host", "eh-0")  # same id: same journal
        wait_for("work goes on after the restart", lambda: len(trainer.unique()) >= before + 30,
                 timeout_s=60)
        # A stopped env-host has drained: what it sent was acked, and the reward-host acks
        # only what the trainer acked, so nothing is still on its way to the trainer.
        assert stop(env_host) == 0, (logs / "eh-0.log").read_text()[-3000:]
    finally:
        if env_host.poll() is None:
            stop(env_host)
        assert stop(reward_host) == 0, (logs / "rh-0.log").read_text()[-3000:]
        trainer.close()
        rollout.close()

    log_text = (logs / "eh-0.log").read_text()
    assert "replayed" in log_text  # the second incarnation read the first one's journal
    nxt, recorded = parse_cursor(store.get(keys.prompts_cursor).value)
    assert set(recorded) == {"eh-0"} and nxt > nxt_at_kill
    journal = TrajectoryJournal(tmp_path / "runs" / JOB / "env-host" / "eh-0.jsonl", G)
    live = set(journal.live_prompts())
    got = trainer.unique()
    assert {parse_trajectory_id(t)[0] for t in got} <= set(range(nxt)), "a trajectory of an unclaimed prompt"
    for p in range(nxt):
        tids = [trajectory_id(p, k) for k in range(G)]
        if p in live:
            continue  # still in flight: journaled, resumed by the next start
        assert all(t in got for t in tids), f"prompt {p} was claimed but is neither delivered nor in flight"
    for s in got.values():
        assert s.trajectory.dropped_reason == "", s.trajectory.info
        assert s.reward == 1.0 and s.reward_error == ""
        assert s.trajectory.turns[0].weight_version == 3
    store.close()
