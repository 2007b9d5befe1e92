"""The real reward-host daemon (a subprocess) between a fake trainer and the env-host's own
delivery path: what the daemon tests share (start, registration, acks, the paced stream)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.outbox import OutboxThread
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

from .fakes import FakeTrainer


class RewardHostHarness:
    """One job's reward-host ``rh-0`` with ``spec_body`` as its spec, a registered fake
    trainer (leader), and an outbox that submits trajectories to it and counts the acks."""

    def __init__(self, tmp_path: Path, etcd, trainer: FakeTrainer, job: str, spec_body: str) -> None:
        self.etcd, self.job, self.keys = etcd, job, JobKeys(job)
        self.store = EtcdStore(etcd.endpoints)
        self.store.put(self.keys.member("trainer", "t-0"),
                       {"id": "t-0", "role": "trainer", "state": "running", "leader": True,
                        "addresses": {"trajectories": trainer.address}})
        # The reward-host loads no model; the spec only needs the folder (and sees weights).
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "model.safetensors").write_bytes(b"")
        self.spec_path = write_spec(tmp_path, job, spec_body, model=model)
        self.log = tmp_path / "reward-host.log"
        self._acked: set[str] = set()
        self._lock = threading.Lock()
        self.outbox = OutboxThread("test-env-host", on_acked=self._on_acked, resend_after_s=0.5,
                                   max_backoff_s=1.0)
        self.outbox.start()
        self.proc = None

    def _on_acked(self, batch) -> None:
        with self._lock:
            self._acked.update(key for key, ok, _ in batch if ok)

    def n_acked(self) -> int:
        with self._lock:
            return len(self._acked)

    def start(self) -> str:
        """Start the daemon and follow its address once this very process has registered
        (a killed one's key lingers until its lease expires)."""
        self.proc = rlfleet("daemon", "reward-host", "--job", self.job, "--etcd", self.etcd.endpoints_arg,
                            "--id", "rh-0", "--spec", str(self.spec_path), log=self.log)
        address = wait_for("reward-host registered", lambda: self._registered(self.proc.pid), timeout_s=30)
        self.outbox.set_addresses([address])
        return address

    def _registered(self, pid: int) -> str | None:
        kv = self.store.get(self.keys.member("reward-host", "rh-0"))
        if kv and kv.value["pid"] == pid and kv.value["state"] == "running":
            return kv.value["addresses"].get("trajectories")
        return None

    def feed(self, trajs: Sequence[Trajectory], halfway: threading.Event) -> threading.Thread:
        """A steady stream in a thread: the first half, then the rest once ``halfway`` is set.
        The 5 ms between submissions spreads arrivals over the test's faults (a pace, not a
        wait on anything)."""

        def run() -> None:
            for i, t in enumerate(trajs):
                if i == len(trajs) // 2:
                    halfway.wait(90)
                self.outbox.submit(t.trajectory_id, t)
                time.sleep(0.005)

        feeder = threading.Thread(target=run, daemon=True)
        feeder.start()
        return feeder

    def close(self) -> None:
        self.outbox.stop()
        self.outbox.join(5)
        try:
            if self.proc is not None:
                assert stop(self.proc) == 0, self.log.read_text()[-3000:]
        finally:
            self.store.close()
