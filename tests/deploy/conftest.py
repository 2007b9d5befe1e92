"""Fixtures for the lab tests (tools/lab, docs/operations/lab.md): real systemd-nspawn hosts, real SSH.

They need root, the cached base rootfs and the wheelhouse (`make test-deploy` builds
both first and sets RLFLEET_LAB=1); elsewhere, `make test` included, they are skipped.
A lab a test brings up is always brought down by its fixture, failed test or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

LAB_CMD = [sys.executable, "-m", "rlfleet.tools.lab"]
ENABLED = os.environ.get("RLFLEET_LAB") == "1" and os.geteuid() == 0


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="lab test: run as root by `make test-deploy` (RLFLEET_LAB=1)")
    for item in items:
        if item.get_closest_marker("lab"):
            item.add_marker(skip)


def lab_cli(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m rlfleet.tools.lab ARGS`, its output shown in the test's report."""
    proc = subprocess.run([*LAB_CMD, *args], capture_output=True, text=True, timeout=timeout)
    print(f"$ lab {' '.join(args)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
    if check:
        assert proc.returncode == 0, f"lab {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@dataclass
class RunningLab:
    name: str
    hosts: int
    up_s: float

    def cli(self, command: str, *args: str, **kw) -> subprocess.CompletedProcess:
        return lab_cli(command, "--name", self.name, *args, **kw)

    def ssh(self, host: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return self.cli("ssh", host, "--", *cmd, **kw)

    def exec(self, host: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return self.cli("exec", host, "--", *cmd, **kw)

    def status(self) -> dict[str, dict]:
        return {r["host"]: r for r in json.loads(self.cli("status", "--output", "json").stdout)["hosts"]}


@pytest.fixture
def lab_factory():
    """lab_factory(name, hosts, subnet) -> RunningLab; every lab it started is brought down after."""
    started: list[str] = []

    def up(name: str, hosts: int, subnet: str = "10.211.0", timeout: float = 240) -> RunningLab:
        started.append(name)
        t0 = time.monotonic()
        lab_cli("up", "--name", name, "--hosts", str(hosts), "--subnet", subnet, "--timeout", str(timeout),
                timeout=timeout + 60)
        return RunningLab(name, hosts, time.monotonic() - t0)

    yield up
    for name in started:
        lab_cli("down", "--name", name, check=False)
