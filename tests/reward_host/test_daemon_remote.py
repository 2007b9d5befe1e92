"""The real reward-host daemon (a subprocess) with the remote_http backend, against real
etcd, two reference endpoints (subprocesses) and a fake trainer endpoint: kill -9 of an
endpoint mid-request, then kill -9 of the reward-host with scored trajectories unacked.
Every trajectory still reaches the trainer exactly once per id (after dedup) with the
right reward, and no endpoint scores a trajectory id twice."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rlfleet.common.etcd_store import EtcdStore
from rlfleet.common.keys import JobKeys
from rlfleet.common.outbox import OutboxThread
from rlfleet.daemons.tasks import get_task
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .fakes import FakeTrainer, trajectory
from .test_remote import Endpoint

JOB = "rhremote"


@pytest.fixture
def trainer():
    t = FakeTrainer()
    yield t
    t.close()


@pytest.fixture
def endpoints():
    slow = Endpoint("--latency-s", "1.0")  # holds requests long enough to be killed mid-request
    fast = Endpoint("--latency-s", "0.01")
    yield slow, fast
    slow.close()
    fast.close()


def test_kill9_of_an_endpoint_and_of_the_reward_host_lose_nothing(tmp_path, etcd, trainer, endpoints):
    slow, fast = endpoints
    keys = JobKeys(JOB)
    store = EtcdStore(etcd.endpoints)
    store.put(keys.member("trainer", "t-0"), {"id": "t-0", "role": "trainer", "state": "running",
                                              "leader": True,
                                              "addresses": {"trajectories": trainer.address}})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    spec_path = write_spec(tmp_path, JOB, f"""
[reward_host.backend]
kind = "remote_http"
endpoints = ["{slow.url}", "{fast.url}"]
max_concurrency = 4
timeout_s = 10
total_timeout_s = 60
[reward_host.backend.retry]
backoff_base_s = 0.05
backoff_max_s = 0.5
[reward_host.backend.breaker]
failures = 2
open_s = 60
""", model=tmp_path / "model")
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
    prompts = task.make_prompts("train", 60, seed=5)
    trajs = [trajectory(p, i, k, p.answer if (i + k) % 3 else "7")
             for i, p in enumerate(prompts) for k in range(2)]
    acked: set[str] = set()
    lock = threading.Lock()

    def on_acked(batch):
        with lock:
            acked.update(key for key, ok, _ in batch if ok)

    def n_acked() -> int:
        with lock:
            return len(acked)

    outbox = OutboxThread("test-env-host", on_acked=on_acked, resend_after_s=0.5, max_backoff_s=1.0)
    outbox.start()
    proc = start()
    try:
        address = wait_for("reward-host registered", lambda: registered(proc.pid), timeout_s=30)
        outbox.set_addresses([address])
        halfway = threading.Event()

        def feed():  # the first half, then the rest once the reward-host has been killed
            for i, t in enumerate(trajs):
                if i == len(trajs) // 2:
                    halfway.wait(90)
                outbox.submit(t.trajectory_id, t)
                time.sleep(0.005)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        wait_for("requests held by the slow endpoint", lambda: slow.stats()["in_flight"] >= 2,
                 timeout_s=30, every_s=0.01)
        slow.kill9()  # mid-request: its jobs are retried on the fast one
        after_kill = n_acked()
        wait_for("acks again, through the fast endpoint", lambda: n_acked() >= after_kill + 10,
                 timeout_s=30, every_s=0.01)
        # Scored trajectories unacked at the reward-host's kill: the trainer holds its acks.
        trainer.hold.set()
        held_from = len(trainer.copies)
        wait_for("scored trajectories waiting for the trainer's ack",
                 lambda: len(trainer.copies) > held_from, timeout_s=30, every_s=0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        trainer.hold.clear()
        assert n_acked() < len(trajs), "the stream was over before the kill; nothing was tested"
        halfway.set()
        proc = start()
        new_address = wait_for("reward-host re-registered", lambda: registered(proc.pid), timeout_s=30)
        outbox.set_addresses([new_address])
        wait_for("every trajectory acked", lambda: n_acked() == len(trajs), timeout_s=60)
        feeder.join(10)

        got = trainer.unique()
        assert set(got) == {t.trajectory_id for t in trajs}  # none lost, none invented
        for t in trajs:
            s = got[t.trajectory_id]
            assert s.reward == task.reward(prompts[t.prompt_id], [t.turns[0].action]), t.trajectory_id
            assert s.reward_error == "" and s.trajectory == t
        fast_stats = fast.stats()
        assert max(fast_stats["scorings"].values()) == 1  # idempotent by trajectory id
        # ... although the restarted reward-host asked again for what the trainer had not acked.
        assert max(fast_stats["asked"].values()) >= 2
    finally:
        outbox.stop()
        outbox.join(5)
        assert stop(proc) == 0, log.read_text()[-3000:]
        store.close()
