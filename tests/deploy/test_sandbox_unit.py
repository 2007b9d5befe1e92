"""The sandbox under systemd, on a real host of the lab (docs/operations/sandbox.md "Under systemd").

The node agent's systemd backend itself (daemons/agent/systemd.py), driving the host's
systemd through nsenter, starts two instances of the shipped `rlfleet@.service`
template whose ExecStart a test drop-in replaces by tests/deploy/sandbox_probe.py (a
stand-in daemon serving common/sandbox/parent.py): env-host-0 of a role that runs the sandbox,
so with the agent's 50-sandbox.conf, and env-host-1 without it. With the drop-in each
hostile program is a recorded failure while the unit keeps serving (same main pid, no
restart), and the code holds no capability; without it the sandbox refuses, naming the
missing capabilities and the drop-in. Prints the unit's exposure as systemd rates it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from rlfleet.common.control.placement import Placed
from rlfleet.daemons.agent.sandbox_dropin import DROPIN_TEXT
from rlfleet.daemons.agent.systemd import SystemdBackend, parse_show
from rlfleet.tools.bench.unit_security import analyse
from rlfleet.tools.lab.paths import lab_dir
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
JOB = "probe"
WITH, WITHOUT = Placed("h1", "env-host", "env-host-0"), Placed("h1", "env-host", "env-host-1")
PROBE_DROPIN = """[Service]
ExecStart=
ExecStart=/usr/bin/python3 /opt/rlfleet/probe/sandbox_probe.py %i
"""
CASES = {  # name: (source, the reason the sandbox must record)
    "loop": ("while True: pass", "cpu_limit"),
    "fork bomb": ("import os\nwhile True: os.fork()", "fork_limit"),
    "memory hog": ("hog = bytearray(1 << 30)", "memory_limit"),
    "socket": ("import socket\nsocket.create_connection(('10.219.0.254', 22), timeout=2)", "network_denied"),
    "write outside tmp (the unit's state)": ("open('/var/lib/rlfleet/escaped', 'w')", "write_denied"),
    "write outside tmp (/dev/shm)": ("open('/dev/shm/escaped', 'w')", "write_denied"),
    "setuid(0)": ("import os\nos.setuid(0)", "exception"),
}


class LabHost:
    """One booted lab host, reached from the machine: systemd through nsenter, files
    (its /run included) through /proc/<its PID 1>/root."""

    def __init__(self, lab_name: str, host: str) -> None:
        state = json.loads((lab_dir(lab_name) / "state.json").read_text())
        leader = state["hosts"][host]["leader_pid"]
        self.nsenter = ["nsenter", "-t", str(leader), "-a", "--"]
        self.root = Path(f"/proc/{leader}/root")

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.nsenter, *argv], **kw)

    def install(self) -> None:
        """The template unit, the probe and the sandbox's two files, and user rlfleet."""
        units = self.root / "etc/systemd/system"
        shutil.copy(REPO / "systemd/rlfleet@.service", units / "rlfleet@.service")
        (units / "rlfleet@.service.d").mkdir(exist_ok=True)
        (units / "rlfleet@.service.d/60-probe.conf").write_text(PROBE_DROPIN)
        probe = self.root / "opt/rlfleet/probe"
        probe.mkdir(parents=True, exist_ok=True)
        for src in (REPO / "common/sandbox/parent.py", REPO / "common/sandbox/child.py",
                    REPO / "tests/deploy/sandbox_probe.py"):
            shutil.copy(src, probe / src.name)
        self.run(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/rlfleet",
                  "--shell", "/usr/sbin/nologin", "rlfleet"], check=True, timeout=60)
        self.run(["systemctl", "daemon-reload"], check=True, timeout=60)

    def backend(self, sandboxed: bool, dropin_dir: Path | None = None) -> SystemdBackend:
        """The agent's backend, on this host's systemd and /run."""
        return SystemdBackend(JOB, "h1", {"RLFLEET_JOB": JOB}, env_dir=self.root / "run/rlfleet/units",
                              run=self.run, sandboxed=lambda role: sandboxed,
                              dropin_dir=dropin_dir or self.root / "run/systemd/system")

    def dropin(self, placed: Placed) -> Path:
        return self.root / f"run/systemd/system/rlfleet@{JOB}:{placed.member_id}.service.d/50-sandbox.conf"

    def start_and_wait(self, b: SystemdBackend, placed: Placed) -> None:
        b.start(placed)
        wait_for(f"{placed.member_id} active", lambda: b.observe(placed).active and parse_show(
            b.systemctl("show", "-p", "ActiveState", b.unit(placed.member_id)))["ActiveState"] == "active",
            timeout_s=120, every_s=0.5)

    def ask(self, placed: Placed, source: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(90)
            s.connect(str(self.root / f"var/lib/rlfleet/probe-{placed.member_id}.sock"))
            s.sendall(source.encode())
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return json.loads(b"".join(chunks))


def test_the_sandbox_in_a_unit_with_and_without_the_agents_drop_in(lab_factory, capsys):
    lab = lab_factory("sbx", 1, subnet="10.219.0")
    host = LabHost(lab.name, "h1")
    host.install()
    ask = host.ask
    agent, plain = host.backend(True), host.backend(False)
    dropin = host.dropin(WITH)
    host.start_and_wait(agent, WITH)
    host.start_and_wait(plain, WITHOUT)
    assert dropin.read_text() == DROPIN_TEXT
    assert not host.dropin(WITHOUT).parent.exists()

    def main_pid() -> tuple[str, str]:
        shown = parse_show(agent.systemctl("show", "-p", "MainPID,NRestarts", agent.unit(WITH.member_id)))
        return shown["MainPID"], shown["NRestarts"]

    serving = main_pid()
    caps = ask(WITH, "print(open('/proc/self/status').read())")
    held = {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in caps["stdout"].splitlines())
            if k in ("CapEff", "CapPrm", "CapInh", "CapAmb")}
    assert held == {"CapEff": 0, "CapPrm": 0, "CapInh": 0, "CapAmb": 0}, caps
    for name, (source, reason) in CASES.items():
        got = ask(WITH, source)
        print(f"[sandbox unit] {name}: {got}")
        assert got.get("reason") == reason and got["left"] == 0, (name, got)
        assert main_pid() == serving, f"the unit restarted after {name}"
    assert ask(WITH, "print(6*7)")["stdout"] == "42\n"
    assert not (host.root / "var/lib/rlfleet/escaped").exists()

    refused = ask(WITHOUT, "print(1)")
    assert "lacks CAP_KILL CAP_SETGID CAP_SETUID CAP_SYS_ADMIN" in refused.get("unavailable", ""), refused
    assert "50-sandbox.conf" in refused["unavailable"]
    journal = host.run(["journalctl", "--no-pager", "-u", plain.unit(WITHOUT.member_id)],
                       capture_output=True, text=True, timeout=60).stdout
    assert "lacks CAP_KILL CAP_SETGID CAP_SETUID CAP_SYS_ADMIN" in journal

    exposure = analyse(agent.unit(WITH.member_id), host.nsenter, None)
    plain_exposure = analyse(plain.unit(WITHOUT.member_id), host.nsenter, None)
    with capsys.disabled():
        print(f"\n[lab numbers] exposure (systemd-analyze security, loaded unit): with the sandbox drop-in "
              f"{exposure['exposure']} {exposure['rating']}, without {plain_exposure['exposure']} "
              f"{plain_exposure['rating']}")

    for b, p in ((agent, WITH), (plain, WITHOUT)):
        b.stop(p)
        wait_for(f"{p.member_id} stopped", lambda b=b, p=p: not b.observe(p).active, timeout_s=200, every_s=0.5)
    assert not dropin.exists() and not dropin.parent.exists()


# The drop-in less one line, and what the sandbox then does: each line is needed.
LEFT_BEHIND = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
               "    os.write(w, b'x')\n    time.sleep(3600)\nos.read(r, 1)\n")
ABLATIONS = {
    "RestrictNamespaces=mnt net": ("print(1)", "unshare: Operation not permitted"),
    "SystemCallFilter=mount setgroups setresuid capset": ("print(1)", "mount /: Operation not permitted"),
    "ProtectProc=default": (LEFT_BEHIND, None),  # the sweep cannot see the run's uid: a process survives
}


def test_each_line_of_the_drop_in_is_needed(lab_factory, tmp_path):
    lab = lab_factory("sbx2", 1, subnet="10.219.0")
    host = LabHost(lab.name, "h1")
    host.install()
    for n, (line, (source, refusal)) in enumerate(ABLATIONS.items(), start=2):
        placed = Placed("h1", "env-host", f"env-host-{n}")
        assert line in DROPIN_TEXT.splitlines()
        host.dropin(placed).parent.mkdir(parents=True)
        host.dropin(placed).write_text(DROPIN_TEXT.replace(line + "\n", ""))
        host.run(["systemctl", "daemon-reload"], check=True, timeout=60)
        b = host.backend(False, dropin_dir=tmp_path)  # starts it, leaving the ablated drop-in alone
        host.start_and_wait(b, placed)
        got = host.ask(placed, source)
        print(f"[sandbox unit] without {line}: {got}")
        if refusal:
            assert refusal in got.get("unavailable", ""), (line, got)
        else:
            assert got["reason"] == "" and got["left"] == 0, got  # what the unit's /proc shows it
            left = host.run(["pgrep", "-u", str(got["uid"])], capture_output=True, text=True, timeout=60)
            assert left.stdout.split(), f"without {line}, no process was left behind: {got}"
        b.stop(placed)  # KillMode=mixed: the unit's cgroup goes, leftovers included
        wait_for(f"{placed.member_id} stopped", lambda: not b.observe(placed).active, timeout_s=200, every_s=0.5)
