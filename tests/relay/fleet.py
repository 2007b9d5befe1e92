"""A chain of real relay daemons (subprocesses) on one machine, against a real etcd."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import RelayMaster
from rlfleet.common.spec.job import load_spec
from rlfleet.relay.reader import WeightReader
from rlfleet.relay.status import query_relay
from rlfleet.relay.topology import read_chain
from tests.integration.helpers import stop, wait_for, write_spec

RELAY_SECTION = """
[relay]
transport = "{transport}"
chunk_mib = 1
keep_versions = 2
window_chunks = 4
"""


def model_tensors(seed: int, layers: int = 2, hidden: int = 256, vocab: int = 512) -> dict[str, np.ndarray]:
    """A Qwen2-shaped tensor set (names matter for the resharding rules)."""
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        t[p + "self_attn.q_proj.bias"] = rng.standard_normal(hidden, dtype=np.float32)
        t[p + "mlp.gate_proj.weight"] = rng.standard_normal((2 * hidden, hidden), dtype=np.float32)
        t[p + "mlp.up_proj.weight"] = rng.standard_normal((2 * hidden, hidden), dtype=np.float32)
        t[p + "mlp.down_proj.weight"] = rng.standard_normal((hidden, 2 * hidden), dtype=np.float32)
        t[p + "input_layernorm.weight"] = rng.standard_normal(hidden, dtype=np.float32)
    t["model.norm.weight"] = rng.standard_normal(hidden, dtype=np.float32)
    t["lm_head.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
    return t


def blob_tensors(seed: int, mib: int) -> dict[str, np.ndarray]:
    """`mib` MiB of random bytes in a few tensors."""
    rng = np.random.default_rng(seed)
    n = mib << 18  # float32 values per MiB * mib
    return {f"blob.{i}": rng.standard_normal(n // 4, dtype=np.float32) for i in range(4)}


def assert_holds(fleet: RelayFleet, rid: str, version: int, tensors: dict[str, np.ndarray], layout: int = 1) -> None:
    """Relay ``rid`` serves ``version`` (waited for), with exactly ``tensors`` in it."""
    reader = WeightReader(fleet.store, fleet.job, f"host-{rid}", layout=layout)
    try:
        wait_for(f"{rid} to serve version {version}", lambda: version in reader.versions(), 30)
    except AssertionError as exc:  # say what each relay did (a one-off under load is otherwise a guess)
        logs = {p.name: p.read_text()[-2500:] for p in sorted(fleet.tmp.glob("relay-*.log"))}
        raise AssertionError(f"{exc}\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items())) from None
    with reader.open(version) as view:
        assert view.version == version and set(view.tensors) == set(tensors)
        for name, arr in tensors.items():
            assert np.array_equal(view.tensors[name], arr), f"{rid}: {name} differs in version {version}"


class RelayFleet:
    def __init__(self, etcd_endpoint: str, tmp: Path, job: str = "rly", transport: str = "tcp") -> None:
        self.endpoint, self.tmp, self.job = etcd_endpoint, tmp, job
        self.keys = JobKeys(job)
        self.store = EtcdStore(etcd_endpoint)
        self.shm_root = f"/dev/shm/rlfleet-test-{uuid.uuid4().hex[:8]}"
        spec = write_spec(tmp, job, RELAY_SECTION.format(transport=transport))
        self.store.put(self.keys.spec, load_spec(spec).to_dict())
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, rid: str, **env: str) -> subprocess.Popen:
        full_env = {**os.environ, "RLFLEET_RELAY_SHM_ROOT": self.shm_root, **env}
        log = open(self.tmp / f"{rid}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "relay", "--job", self.job,
                                 "--etcd", self.endpoint, "--id", rid, "--host", f"host-{rid}"],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=full_env)
        self.procs[rid] = proc
        return proc

    def start_chain(self, n: int, **env: str) -> list[str]:
        ids = [f"relay-{i}" for i in range(n)]
        # relay-0 first, so it is the first master (the others wait one cycle behind it).
        self.start(ids[0], **env)
        wait_for("relay-0 to become master", lambda: self.master() == "relay-0", 30)
        for rid in ids[1:]:
            self.start(rid, **env)
        wait_for(f"{n} relays in the chain", lambda: len(self.chain().order) == n, 30)
        return ids

    def kill9(self, rid: str) -> None:
        proc = self.procs.pop(rid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def master(self) -> str | None:
        master = RelayMaster.read(self.store, self.keys)
        return master.id if master is not None else None

    def chain(self):
        return read_chain(self.store, self.keys)

    def address(self, rid: str) -> str:
        return self.chain().members[rid].address

    def stats(self, rid: str) -> dict[str, Any]:
        s = query_relay(self.address(rid), timeout=2.0)
        assert s is not None, f"{rid} did not answer a status query"
        return s

    def progress(self, rid: str, version: int, layout: int = 1) -> int:
        s = query_relay(self.address(rid), timeout=2.0) or {}
        return (s.get("progress") or {}).get(f"{version}/tp{layout}", [0, 0])[0]

    def log(self, rid: str) -> str:
        return (self.tmp / f"{rid}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc, timeout_s=10)
        self.store.close()
        shutil.rmtree(self.shm_root, ignore_errors=True)
