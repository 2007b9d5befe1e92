"""The node agent as an operator runs it: `rlfleet daemon agent` (process backend)
against a real etcd, real daemons started from placement, a real crash loop.

The spec places a resource-manager and a reward-host on the agent's host and
everything else on a host with no agent. The agent starts the resource-manager
itself (bootstrap); the reward-host only once the elected resource-manager has
written its placement key. The reward-host exits at start (the daemon entry
point's test failpoint), so the agent reports it failing in nodes/<host>, and
`rlfleet status` says so and exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.failpoints import DAEMON as DAEMON_FAILPOINT_ENV
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit

from .helpers import agent_host_placement, wait_for, write_spec

HOST = "agent-h1"
PLACEMENT = agent_host_placement(HOST)
KEYS = JobKeys("agentjob")


def node(store: EtcdStore) -> dict | None:
    kv = store.get(KEYS.node(HOST))
    return kv.value if kv else None


def test_the_agent_bootstraps_acts_on_placement_and_reports_a_failing_daemon(tmp_path, etcd):
    spec_path = write_spec(tmp_path, job="agentjob", extra=PLACEMENT)
    store = EtcdStore(etcd.endpoints)
    store.put(KEYS.spec, load_spec(spec_path).to_dict())
    env = {**os.environ, "RLFLEET_RUN_DIR": str(tmp_path / "run"), "RLFLEET_LABELS": "cpu=x86",
           DAEMON_FAILPOINT_ENV: "exit_at_start:reward-host"}
    log = open(tmp_path / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", "--job", "agentjob",
                              "--etcd", etcd.endpoints_arg, "--host", HOST, "--label", "roles=manager,reward"],
                             stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        record = wait_for("the agent's node record", lambda: node(store), timeout_s=60)
        assert record["labels"] == {"cpu": "x86", "roles": "manager,reward"}
        assert record["agent"]["backend"] == "process" and record["agent"]["pid"] == agent.pid
        assert record["cpus_logical"] >= 1 and record["host"] == HOST

        rm = wait_for("the bootstrapped resource-manager", lambda: store.get(
            KEYS.member("resource-manager", "resource-manager-0")), timeout_s=60).value
        assert rm["host"] == HOST
        wait_for("the resource-manager's placement", lambda: store.get(
            KEYS.placement(HOST, "reward-host", "reward-host-0")), timeout_s=30)
        failing = wait_for("reward-host-0 reported failing", lambda: (
            (d := (node(store) or {}).get("daemons", {}).get("reward-host-0")) and d["failing"] and d), timeout_s=90)
        assert failing["restarts"] >= 5 and failing["last_exit"] == "exit code 1"
        assert (tmp_path / "run" / "logs" / "reward-host-0.log").exists()
        # Only what is placed on its own host runs: nothing of "elsewhere" was started.
        assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == [
            "resource-manager-0.log", "reward-host-0.log"]

        status = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "status", "--job", "agentjob",
                                 "--etcd", etcd.endpoints_arg], capture_output=True, text=True, timeout=60)
        assert status.returncode == Exit.FAILURE, status.stdout + status.stderr
        assert f"problem: reward-host-0 on {HOST}: failing (keeps dying:" in status.stdout, status.stdout
        assert "failing: reward-host-0" in status.stdout and "cpu=x86" in status.stdout  # the nodes table

        # /targets: Prometheus http_sd for the daemons registered from this host; /metrics: the agent's own.
        me = store.get(KEYS.member("agent", HOST)).value
        base = me["metrics"].removesuffix("/metrics")
        groups = wait_for("the resource-manager among the targets", lambda: [
            g for g in json.loads(urllib.request.urlopen(base + "/targets", timeout=10).read())
            if g["labels"]["role"] == "resource-manager"], timeout_s=30)
        assert groups == [{"targets": [rm["metrics"].split("/")[2]],
                           "labels": {"job": "agentjob", "host": HOST, "role": "resource-manager",
                                      "id": "resource-manager-0"}}]
        assert b'rlfleet_up{id="agent-h1",role="agent"} 1.0' in urllib.request.urlopen(base + "/metrics",
                                                                                       timeout=10).read()
        rm_pid = rm["pid"]
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(30)
    assert code == 0, (tmp_path / "agent.log").read_text()[-3000:]
    # Its daemons were drained with it, and its registration and node record went at once.
    wait_for("the resource-manager to be gone", lambda: not os.path.exists(f"/proc/{rm_pid}"), timeout_s=10)
    assert node(store) is None and store.get(KEYS.member("agent", HOST)) is None


def test_the_agent_under_systemd_starts_units_from_placement_and_leaves_them_running(tmp_path, etcd, monkeypatch):
    """The same agent with the systemd backend (in-process, a fake systemctl on PATH that
    records its calls): the bootstrap and a placed daemon become `systemctl start` of
    their units, each after its environment file; a unit that left the placement is
    stopped; the agent's own stop leaves the units to systemd."""
    import threading

    from rlfleet.common.daemon import DaemonOptions
    from rlfleet.daemons.agent.daemon import Agent, unit_env
    from rlfleet.daemons.agent.systemd import SystemdBackend
    from tests.daemons.agent.test_systemd import FakeSystemd

    fake = FakeSystemd(tmp_path)
    monkeypatch.setenv("PATH", f"{fake.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(fake.dir))
    spec_path = write_spec(tmp_path, job="agentjob", extra=PLACEMENT)
    store = EtcdStore(etcd.endpoints)
    store.put(KEYS.spec, load_spec(spec_path).to_dict())
    backend = SystemdBackend("agentjob", HOST, unit_env("agentjob", etcd.endpoints_arg, HOST, {}),
                             env_dir=tmp_path / "units")
    agent = Agent(DaemonOptions(job="agentjob", member_id=HOST, host=HOST), EtcdStore(etcd.endpoints),
                  backend="systemd", labels={"roles": "reward"}, etcd=etcd.endpoints_arg, backend_impl=backend)
    runner = threading.Thread(target=agent.run)
    runner.start()
    rm_unit, rh_unit = "rlfleet@agentjob:resource-manager-0.service", "rlfleet@agentjob:reward-host-0.service"
    try:
        wait_for("the bootstrap's unit started", lambda: f"start --no-block {rm_unit}" in fake.calls(), timeout_s=30)
        env_file = (tmp_path / "units" / "agentjob:resource-manager-0.env").read_text()
        assert "RLFLEET_ROLE=resource-manager\n" in env_file and f"RLFLEET_ETCD={etcd.endpoints_arg}\n" in env_file
        fake.state(rm_unit, "active")
        store.put(KEYS.placement(HOST, "reward-host", "reward-host-0"),
                  {"host": HOST, "role": "reward-host", "id": "reward-host-0"})
        wait_for("the placed unit started", lambda: f"start --no-block {rh_unit}" in fake.calls(), timeout_s=30)
        fake.state(rh_unit, "active")
        record = wait_for("both reported running", lambda: (n := node(store)) and all(
            d["state"] == "running" for d in n["daemons"].values()) and len(n["daemons"]) == 2 and n, timeout_s=30)
        assert record["agent"]["backend"] == "systemd" and record["labels"] == {"roles": "reward"}
        store.delete(KEYS.placement(HOST, "reward-host", "reward-host-0"))
        wait_for("the unplaced unit stopped", lambda: f"stop --no-block {rh_unit}" in fake.calls(), timeout_s=30)
    finally:
        agent.request_stop()
        runner.join(30)
    assert not runner.is_alive()
    assert f"stop --no-block {rm_unit}" not in fake.calls()  # the agent's stop leaves units to systemd
    assert node(store) is None
