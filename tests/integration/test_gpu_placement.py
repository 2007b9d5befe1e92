"""GPUs in placement with real processes (docs/operations/gpus.md): a real `rlfleet run`
of the tiny model whose spec gives its named host's reward-host a GPU and a pool's relay
one; a stand-in `nvidia-smi` on PATH prints a fixed inventory of two GPUs. The daemons'
own environments (/proc/<pid>/environ) carry what the placement assigned: the GPU given,
or an empty CUDA_VISIBLE_DEVICES for a daemon given none; a host whose agent reports no
GPU is not admitted into the GPU pool, and says why; `rlfleet status` shows the GPUs each
daemon holds, and the node record the agent's inventory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.tools.exit_codes import Exit

from .helpers import TINY_MODEL, small_job, stop, wait_for, write_spec

needs_model = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

JOB = small_job(eval_every_steps=1000, max_steps=100000, checkpoint_every=1000, extra="""
[[placement.hosts]]
name = "localhost"
roles = { resource-manager = 1, repack-manager = 1, trainer = 1, relay = 1, rollout = 1, env-host = 1, reward-host = 1 }
gpus = 2
gpus_per_daemon = { reward-host = 1 }

[[placement.pools]]
name = "gpu"
labels = { kind = "gpu" }
roles = { relay = 1 }
gpus_per_daemon = { relay = 1 }
""")
INVENTORY = "0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n"


def stand_in_nvidia_smi(folder: Path) -> dict[str, str]:
    """An environment whose PATH finds an `nvidia-smi` printing INVENTORY for any query."""
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\ncat <<'EOF'\n" + INVENTORY + "EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def visible_devices(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES in the process's own environment (None: not set)."""
    env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    return env.get("CUDA_VISIBLE_DEVICES")


def agent(job: str, host: str, etcd, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", "--job", job,
                             "--etcd", etcd.endpoints_arg, "--host", host, "--label", "kind=gpu"],
                            env={**env, "RLFLEET_RUN_DIR": str(log.parent / host)},
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


@needs_model
def test_each_daemon_starts_with_the_gpus_its_placement_gives_it(tmp_path, etcd):
    job = "gpus"
    spec = write_spec(tmp_path, job=job, extra=JOB)
    store = EtcdStore(etcd.endpoints)
    with_gpus = stand_in_nvidia_smi(tmp_path / "bin")
    run = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--etcd", etcd.endpoints_arg,
                            "--insecure", "--no-view"], env=with_gpus, stdout=open(tmp_path / "run.log", "wb"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    agents = []
    try:
        agents.append(agent(job, "g1", etcd, with_gpus, tmp_path / "g1.log"))
        agents.append(agent(job, "c1", etcd, dict(os.environ), tmp_path / "c1.log"))  # no nvidia-smi: no GPU

        def started() -> Cluster | None:
            c = Cluster.read(store, job)
            ids = {"trainer-0", "rollout-0", "reward-host-0", "relay-0", "relay-g1-0"}
            return c if ids <= {m.id for m in c.all_members if m.pid} and "c1" in c.nodes else None
        cluster = wait_for("the job's daemons and both agents", started, timeout_s=180)
        held = {m.id: visible_devices(m.pid) for m in cluster.all_members
                if m.id in ("trainer-0", "rollout-0", "reward-host-0", "relay-0", "relay-g1-0")}
        assert held == {"reward-host-0": "0", "relay-g1-0": "0",  # each host numbers its own GPUs
                        "trainer-0": "", "rollout-0": "", "relay-0": ""}
        assert [g.name for g in cluster.nodes["g1"].gpus] == ["NVIDIA H200"] * 2 and cluster.nodes["c1"].gpus == ()
        assert "c1" not in cluster.admissions
        waiting = {h: why for m in cluster.members("resource-manager") for h, why in
                   (m.info.get("waiting_hosts") or {}).items()}
        assert waiting["c1"] == "it has 0 GPU(s); every matching pool needs more: gpu (1)"

        status = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", job,
                                 "--etcd", etcd.endpoints_arg, "--output", "json"], capture_output=True, text=True,
                                timeout=60)
        placement = {p["id"]: p.get("gpus") for p in json.loads(status.stdout)["placement"]}
        assert placement["reward-host-0"] == [0] and placement["relay-g1-0"] == [0] and placement["trainer-0"] == []
        table = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", job,
                                "--etcd", etcd.endpoints_arg], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "COLUMNS": "250"})
        row = next(line for line in table.stdout.splitlines() if "reward-host-0" in line)
        assert "│ 0 " in row and "gpus" in table.stdout, table.stdout
    finally:
        for a in agents:
            stop(a)
        code = stop(run, timeout_s=60)
    assert code == Exit.STOPPED, (tmp_path / "run.log").read_text()[-3000:]
