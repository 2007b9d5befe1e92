"""A real daemon process under a stand-in for systemd: $NOTIFY_SOCKET points at a
socket the test binds, $WATCHDOG_USEC is set, etcd is real. The daemon must say
READY=1 once registered, STATUS= its cycle sentences, WATCHDOG=1 every cycle,
RELOADING=1 … READY=1 around a SIGHUP and STOPPING=1 on SIGTERM; a stalled main
loop (the test failpoint) must stop pinging the watchdog, so systemd would kill it.
Also: the daemon command's settings from the environment ($RLFLEET_HOST,
$RLFLEET_BIND_HOST, $RLFLEET_METRICS_HOST, $RLFLEET_METRICS_PORT)."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import uuid

import pytest

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.failpoints import DAEMON as DAEMON_FAILPOINT_ENV
from tests.integration.helpers import stop, store_with_spec, wait_for

from .notify_listener import NotifyListener

KEYS = JobKeys("sdn")
MEMBER = KEYS.member("reward-host", "rh-1")


@pytest.fixture
def store(tmp_path, etcd):
    with store_with_spec(tmp_path, etcd, "sdn") as s:
        yield s


@pytest.fixture
def listener():
    listener = NotifyListener(f"@rlfleet-test-{uuid.uuid4().hex}")
    yield listener
    listener.close()


def start_daemon(etcd, log, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlfleet.tools.cli", "daemon", "reward-host", "--job", "sdn",
         "--etcd", etcd.endpoints_arg, "--id", "rh-1"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **env})


def is_(key: str):
    return lambda n: n.get(key) == "1"


def pings_since(listener: NotifyListener, n) -> list:
    return [m for m in listener.since(n) if is_("WATCHDOG")(m)]


def test_a_daemon_tells_systemd_each_step_of_its_life(tmp_path, etcd, store, listener):
    proc = start_daemon(etcd, tmp_path / "rh.log", NOTIFY_SOCKET=listener.address, WATCHDOG_USEC="3000000")
    try:
        ready = listener.wait_for("READY=1", is_("READY"), timeout_s=60)
        # Registered before it said so: the member key is there with our pid.
        assert store.get(MEMBER).value["pid"] == proc.pid
        assert ready["STATUS"].startswith("registered as reward-host/rh-1 with lease")

        listener.read_until("5 pings after READY", lambda: len(pings_since(listener, ready)) >= 5)
        pings = [n.at for n in listener.received if is_("WATCHDOG")(n)]
        # A cycle each lease refresh (TTL 2 s / 3), well inside the 3 s watchdog.
        assert statistics.median(b - a for a, b in zip(pings, pings[1:])) < 1.5

        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for("RELOADING=1", is_("RELOADING"))
        assert int(reloading["MONOTONIC_USEC"]) > 0
        again = listener.wait_for("READY=1 after the reload",
                                  lambda n: is_("READY")(n) and n in listener.since(reloading))
        said = listener.wait_for("the reload's sentence", lambda n: "reloaded spec" in n.get("STATUS", ""))
        assert listener.received.index(said) > listener.received.index(again)

        proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING=1", is_("STOPPING"))
        assert stopping["STATUS"] == "draining reward-host/rh-1"
        assert proc.wait(30) == 0
        listener.read(0)
        assert not pings_since(listener, stopping)  # the loop has ended
        # STATUS only when the sentence changes: never twice the same one in a row.
        statuses = [n["STATUS"] for n in listener.received if "STATUS" in n.fields]
        assert all(a != b for a, b in zip(statuses, statuses[1:])), statuses
    finally:
        stop(proc)


def test_a_stalled_main_loop_stops_pinging_the_watchdog(tmp_path, etcd, store, listener):
    stall_file = tmp_path / "stall"
    log = tmp_path / "rh.log"
    proc = start_daemon(etcd, log, NOTIFY_SOCKET=listener.address, WATCHDOG_USEC="1000000",
                        **{DAEMON_FAILPOINT_ENV: f"stall_if_file:reward-host:{stall_file}"})
    try:
        ready = listener.wait_for("READY=1", is_("READY"), timeout_s=60)
        listener.read_until("3 pings after READY", lambda: len(pings_since(listener, ready)) >= 3)
        stall_file.touch()
        # Keep reading (the socket queues only 10 datagrams) until the loop says it stalls;
        # every ping it sent before is queued by then: sendto is synchronous.
        listener.read_until("the failpoint to stall the loop", lambda: "stalls now" in log.read_text())
        listener.read(0)
        before = len(listener.received)
        # Three watchdog intervals (9 pings if the loop were alive): none may come.
        late = [n for n in listener.read(3.0) if is_("WATCHDOG")(n)]
        assert not late, f"{len(late)} pings from a stalled loop (after {before} notifications)"
        assert proc.poll() is None  # stalled, not dead: killing it is systemd's job
    finally:
        proc.kill()
        proc.wait(30)


def test_the_daemon_command_takes_its_host_settings_from_the_environment(tmp_path, etcd, store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_daemon(etcd, tmp_path / "rh.log", RLFLEET_HOST="node-7", RLFLEET_BIND_HOST="127.0.0.2",
                        RLFLEET_METRICS_HOST="127.0.0.3", RLFLEET_METRICS_PORT=str(port))
    try:
        member = wait_for("reward-host registered with its addresses",
                          lambda: (kv := store.get(MEMBER)) and kv.value.get("addresses") and kv.value,
                          timeout_s=60)
        assert member["host"] == "node-7"
        assert member["addresses"] and all(a.startswith("tcp://127.0.0.2:") for a in member["addresses"].values())
        assert member["metrics"] == f"http://127.0.0.3:{port}/metrics"
    finally:
        assert stop(proc) == 0


def test_a_node_agent_is_ready_before_any_job_is_submitted(tmp_path, etcd, listener):
    """`systemctl start rlfleet-agent@<job>` on a fresh host: no spec yet, and the start
    must not time out waiting for one; the watchdog's pings go on while it waits."""
    log = tmp_path / "agent.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.tools.cli", "daemon", "agent", "--job", "nospec", "--etcd", etcd.endpoints_arg],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "3000000"})
    try:
        ready = listener.wait_for("READY=1", is_("READY"), timeout_s=60)
        assert "waiting for the job spec" in ready.get("STATUS", ""), ready
        listener.read_until("a watchdog ping after READY", lambda: pings_since(listener, ready), timeout_s=30)
        with EtcdStore(etcd.endpoints) as s:
            assert s.get_prefix(JobKeys("nospec").members_prefix) == []  # ready, yet no job to register in
    finally:
        assert stop(proc) == 0, log.read_text()[-2000:]
