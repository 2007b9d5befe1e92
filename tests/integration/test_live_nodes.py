"""Adding and draining a machine in a live job, with real processes: a real
`rlfleet run` trains the tiny model against the test's etcd; a second node agent
for a host the spec does not name ("extra", labelled kind=cpu) registers, the
resource-manager admits it into the spec's pool, places a relay and a rollout
there, the relay joins the chain and catches up, and the rollout serves
(`rlfleet node add`; started again afterwards, it reports the same phases, from the
records' own timestamps). Then `rlfleet node drain` stops them without losing a
trajectory (the run ends with its accounting invariant checked) and `rlfleet
node remove` takes the host out. The lab test (tests/deploy/test_live_fleet.py)
plays the same on systemd hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.tools.exit_codes import Exit

from .helpers import TINY_MODEL, rlfleet, small_job, stop, wait_for, write_spec

needs_model = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="models/tiny-qwen2 not built")

# max_steps: stopped by the test (SIGTERM); a step takes well under a second
JOB = small_job(eval_every_steps=1000, max_steps=100000, checkpoint_every=1000, extra="""
[[placement.pools]]
name = "cpu-workers"
labels = { kind = "cpu" }
roles = { relay = 1, rollout = 1 }
capacity = 1
""")


def cli(*args: str, etcd, timeout_s: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", *args, "--etcd", etcd.endpoints_arg],
                          capture_output=True, text=True, timeout=timeout_s)


@needs_model
def test_a_host_joins_a_live_job_serves_then_drains_without_losing_work(tmp_path, etcd):
    job = "live"
    spec = write_spec(tmp_path, job=job, extra=JOB)
    store = EtcdStore(etcd.endpoints)
    run = rlfleet("run", str(spec), "--etcd", etcd.endpoints_arg, "--insecure", "--no-view",
                  log=tmp_path / "run.log")
    agent = None
    try:
        wait_for("the first training step", lambda: (c := Cluster.read(store, job)).progress is not None
                 and c.progress.trained_groups > 0, timeout_s=180)
        # Refusals first, while only the named host runs: they change nothing.
        refused = cli("node", "drain", "localhost", "--job", job, etcd=etcd)
        assert refused.returncode == Exit.REFUSED, refused.stderr
        assert "runs the only running" in refused.stderr and "trainer (trainer-0)" in refused.stderr
        unknown = cli("node", "cordon", "nosuch", "--job", job, etcd=etcd)
        assert unknown.returncode == Exit.BAD_SPEC and "unknown host 'nosuch'" in unknown.stderr
        not_drained = cli("node", "remove", "localhost", "--job", job, etcd=etcd)
        assert not_drained.returncode == Exit.REFUSED and "not drained" in not_drained.stderr

        env = {**os.environ, "RLFLEET_RUN_DIR": str(tmp_path / "extra")}
        agent = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", "--job", job,
                                  "--etcd", etcd.endpoints_arg, "--host", "extra", "--label", "kind=cpu"],
                                 env=env, stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT)
        added = cli("node", "add", "extra", "--job", job, "--timeout", "150", "--json", str(tmp_path / "add.json"),
                    etcd=etcd)
        assert added.returncode == Exit.OK, added.stdout + added.stderr
        record = json.loads((tmp_path / "add.json").read_text())
        assert record["ok"] and all(v is not None and v >= 0 for v in record["phases"].values()), record
        # Started again once the host serves (as after provisioning), it reports the same
        # phases: they come from the records' timestamps, not from when it looks.
        again = cli("node", "add", "extra", "--job", job, "--timeout", "30", "--json", str(tmp_path / "again.json"),
                    etcd=etcd)
        assert again.returncode == Exit.OK, again.stdout + again.stderr
        later = json.loads((tmp_path / "again.json").read_text())
        assert later["phases"] == record["phases"] and later["total_s"] == record["total_s"] >= 1.0, (record, later)
        cluster = Cluster.read(store, job)
        assert later["milestones_at"]["registered"] == cluster.nodes["extra"].registered
        assert later["milestones_at"]["first_trajectory"] == \
            cluster.member("rollout", "rollout-extra-0").info["first_result_at"]
        assert cluster.admissions["extra"].pool == "cpu-workers"
        relay = cluster.member("relay", "relay-extra-0")
        rollout = cluster.member("rollout", "rollout-extra-0")
        assert relay is not None and relay.info["newest"] >= record["caught_up_to_version"] >= 0
        assert rollout is not None and rollout.info.get("first_result_at")
        assert "relay-extra-0" in cluster.relay_chain.order

        listing = cli("node", "list", "--job", job, "--output", "json", etcd=etcd)
        assert listing.returncode == 0, listing.stderr
        listed = json.loads(listing.stdout)
        assert {r["host"]: r["pool"] for r in listed} == {"localhost": "(named)", "extra": "cpu-workers"}

        drained = cli("node", "drain", "extra", "--job", job, "--timeout", "120", etcd=etcd)
        assert drained.returncode == Exit.OK, drained.stdout + drained.stderr + repr(
            [(m.role, m.id, m.host, m.state) for m in Cluster.read(store, job).all_members])
        cluster = Cluster.read(store, job)
        assert [m.role for m in cluster.all_members if m.host == "extra"] == ["agent"]  # it stays up
        assert not [p for p in cluster.placement if p.host == "extra"]
        wait_for("the chain without the drained relay",
                 lambda: "relay-extra-0" not in Cluster.read(store, job).relay_chain.order, timeout_s=30)
        removed = cli("node", "remove", "extra", "--job", job, etcd=etcd)
        assert removed.returncode == Exit.OK, removed.stderr
        wait_for("the admission forgotten", lambda: "extra" not in Cluster.read(store, job).admissions)
        # Training goes on after the drain (the named host's rollout serves alone).
        trained = Cluster.read(store, job).progress.trained_groups
        wait_for("training after the drain",
                 lambda: Cluster.read(store, job).progress.trained_groups > trained, timeout_s=120)
    finally:
        if agent is not None:
            stop(agent)
        code = stop(run, timeout_s=60)
    # Stopped by the test (exit 7, not 4): the run checked the accounting invariant itself.
    assert code == Exit.STOPPED, (tmp_path / "run.log").read_text()[-3000:]
    accounting = json.loads(next((tmp_path / "runs" / job).glob("*/accounting.json")).read_text())
    assert accounting["ok"] and not accounting["lost"] and accounting["trained"] > 0, accounting
