"""The real reward-host daemon (a subprocess) against real etcd and a fake trainer endpoint:
every trajectory reaches the trainer (after dedup, exactly once per id) with the right
reward, even when the reward-host is SIGKILLed mid-stream and restarted."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rlfleet.common.etcd_store import EtcdStore
from rlfleet.common.keys import JobKeys
from rlfleet.common.outbox import OutboxThread
from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .fakes import FakeTrainer, trajectory

JOB = "rhtest"
SPEC = """
[reward_host.backend]
kind = "rule_pool"
workers = 2
timeout_s = 5
"""


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, the killed daemon, cannot reap it).
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def trainer():
    t = FakeTrainer()
    yield t
    t.close()


def test_scored_exactly_once_per_id_across_a_sigkill(tmp_path, etcd, trainer):
    keys = JobKeys(JOB)
    store = EtcdStore(etcd.endpoints)
    store.put(keys.member("trainer", "t-0"), {"id": "t-0", "role": "trainer", "state": "running",
                                              "leader": True,
                                              "addresses": {"trajectories": trainer.address}})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    # The reward-host loads no model; the spec only needs the folder (and sees weights).
    spec_path = write_spec(tmp_path, JOB, SPEC, model=tmp_path / "model")
    log = tmp_path / "reward-host.log"

    def start():
        return rlfleet("daemon", "reward-host", "--job", JOB, "--etcd", etcd.endpoints_arg,
                       "--id", "rh-0", "--spec", str(spec_path), log=log)

    def registered(pid: int) -> str | None:
        kv = store.get(keys.member("reward-host", "rh-0"))
        if kv and kv.value["pid"] == pid and kv.value["state"] == "running":
            return kv.value["addresses"].get("trajectories")
        return None

    task = get_task("arithmetic")
    prompts = task.make_prompts("train", 150, seed=4)
    trajs = [trajectory(p, i, k, p.answer if (i + k) % 3 else "7")
             for i, p in enumerate(prompts) for k in range(2)]
    acked: set[str] = set()
    lock = threading.Lock()

    def on_acked(batch):
        with lock:
            acked.update(key for key, ok, _ in batch if ok)

    # The env-host's own delivery path: an outbox that follows the reward-host's address.
    outbox = OutboxThread("test-env-host", on_acked=on_acked, resend_after_s=0.5, max_backoff_s=1.0)
    outbox.start()
    proc = start()
    try:
        address = wait_for("reward-host registered", lambda: registered(proc.pid), timeout_s=30)
        outbox.set_addresses([address])

        held = threading.Event()

        def feed():  # a steady stream: the first half, then the rest once the trainer holds its acks
            for i, t in enumerate(trajs):
                if i == len(trajs) // 2:
                    held.wait(60)
                outbox.submit(t.trajectory_id, t)
                time.sleep(0.005)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        wait_for("some acks", lambda: len(acked) >= 30, timeout_s=30, every_s=0.005)
        # Work in flight at the kill, however fast this machine is: the trainer stops acking,
        # so what the reward-host scores from now on waits in it, unacked, until the kill.
        trainer.hold.set()
        held_from = len(trainer.copies)
        held.set()
        wait_for("scored trajectories waiting for the trainer's ack",
                 lambda: len(trainer.copies) > held_from, timeout_s=30, every_s=0.005)
        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: some trajectories are in flight
        proc.wait(10)
        trainer.hold.clear()
        assert len(acked) < len(trajs), "the stream was over before the kill; nothing was tested"
        # Orphaned workers see their pipe close and exit by themselves.
        wait_for("orphaned reward workers to exit", lambda: not any(alive(w) for w in workers),
                 timeout_s=10)
        feeder.join(10)
        proc = start()
        # The dead daemon's key lingers until its lease expires; wait for the new one.
        new_address = wait_for("reward-host re-registered", lambda: registered(proc.pid), timeout_s=30)
        outbox.set_addresses([new_address])
        wait_for("every trajectory acked", lambda: len(acked) == len(trajs), timeout_s=40)

        got = trainer.unique()
        assert set(got) == {t.trajectory_id for t in trajs}  # none lost, none invented
        for t in trajs:
            s = got[t.trajectory_id]
            prompt = prompts[t.prompt_id]
            assert s.reward == task.reward(prompt, [t.turns[0].action]), t.trajectory_id
            assert s.reward_error == "" and s.trajectory == t
        value = store.get(keys.member("reward-host", "rh-0")).value
        wait_for("counters published", lambda: store.get(keys.member("reward-host", "rh-0")).value
                 .get("scored", 0) > 0, timeout_s=10)
        assert value["addresses"]["trajectories"] == new_address
    finally:
        outbox.stop()
        outbox.join(5)
        assert stop(proc) == 0, log.read_text()[-3000:]
        store.close()
