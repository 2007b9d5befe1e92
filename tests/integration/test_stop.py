"""A durable stop with real processes (docs/operations/maintenance-mode.md, "Stopping a
job"): `rlfleet stop` on a job a node agent runs (process backend), then the agent
killed and started again as a host's reboot would: it starts nothing while the job is
stopped; `rlfleet status` says STOPPED and exits 0; `rlfleet start` runs it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit

from .helpers import agent_host_placement, wait_for, write_spec
from .test_pause import alive, cli, held_for, member

HOST = "stop-host"
JOB = "stopjob"


def test_a_stopped_job_stays_stopped_when_its_host_comes_back_and_runs_again_on_start(tmp_path, etcd):
    spec_path = write_spec(tmp_path, job=JOB, extra=agent_host_placement(HOST))
    keys, store = JobKeys(JOB), EtcdStore(etcd.endpoints)
    store.put(keys.spec, load_spec(spec_path).to_dict())
    env = {**os.environ, "RLFLEET_RUN_DIR": str(tmp_path / "run")}
    log = open(tmp_path / "agent.log", "ab")
    etcd_args = ("--job", JOB, "--etcd", etcd.endpoints_arg)

    def start_agent() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", *etcd_args,
                                 "--host", HOST], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)

    def ours() -> list[dict]:  # the daemons this host's agent runs, as registered
        return [m for role, mid in (("reward-host", "reward-host-0"), ("resource-manager", "resource-manager-0"))
                if (m := member(store, keys, role, mid))]

    agent = start_agent()
    try:
        wait_for("the host's two daemons registered", lambda: len(ours()) == 2, timeout_s=90)
        before = [m["pid"] for m in ours()]
        stopped = cli("stop", *etcd_args, "--reason", "drill", "--timeout", "60")
        assert stopped.returncode == Exit.OK, stopped.stdout + stopped.stderr
        assert f"no daemon of job {JOB} registered" in stopped.stdout
        # deregistered in their drain, then gone once it ends (the exit flush takes up to a second)
        wait_for("the host's daemons exited", lambda: not any(alive(pid) for pid in before), timeout_s=30)

        status = cli("status", *etcd_args)
        assert status.returncode == Exit.OK, status.stdout + status.stderr  # the placement stays, expected down
        assert "STOPPED since" in status.stdout and "drill" in status.stdout
        assert "placed on" not in status.stdout

        # The host goes down hard and comes back: a new agent, the placement still in etcd.
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        agent = start_agent()
        wait_for("the new agent's node record", lambda: (kv := store.get(keys.node(HOST))) is not None
                 and kv.value.get("agent", {}).get("pid") == agent.pid, timeout_s=60)
        held_for("nothing of the stopped job started", 5.0, lambda: not ours() and agent.poll() is None)

        started = cli("start", *etcd_args)
        assert started.returncode == Exit.OK and f"job {JOB} started by" in started.stdout, started.stdout
        wait_for("the host's two daemons registered again", lambda: len(ours()) == 2, timeout_s=90)
        assert cli("start", *etcd_args).stdout.startswith(f"job {JOB} is not stopped")
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(30)
        for m in ours():
            os.kill(m["pid"], signal.SIGTERM)
        store.close()
    assert code == 0
    text = (tmp_path / "agent.log").read_text()
    assert "job stopped since " in text and ": stopping what runs here, starting nothing" in text
    assert "job started: acting on placement again" in text
