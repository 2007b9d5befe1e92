"""Fixtures for the lab tests (tools/lab, docs/operations/lab.md): real systemd-nspawn hosts, real SSH.

They need root, the cached base rootfs and the wheelhouse (`make test-deploy` builds
both first and sets RLFLEET_LAB=1); elsewhere, `make test` included, they are skipped.
A lab a test brings up is always brought down by its fixture, failed test or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlfleet.tools.bench.output import provenance
from rlfleet.tools.lab.job import ANSIBLE, LabJob

LAB_CMD = [sys.executable, "-m", "rlfleet.tools.lab"]
REPO = Path(__file__).resolve().parents[2]
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


@contextlib.contextmanager
def module_lab(request: pytest.FixtureRequest, job: LabJob, subnet: str, results: Path,
               figures: dict[str, Any]) -> Iterator[None]:
    """A module's lab, from nothing (a new CA too): up on entry; on the way out the job's
    diagnostics when the setup or any test of the module failed, ``figures`` written to
    ``results`` (after the provenance every benchmark record starts with, so the file can be
    committed to tools/bench/results as it is) and printed, and the lab down."""
    shutil.rmtree(ANSIBLE / "pki", ignore_errors=True)
    lab_cli("up", "--name", job.lab, "--hosts", str(job.hosts), "--subnet", subnet, "--timeout", "240", timeout=320)
    failed_before = request.session.testsfailed
    failed = False
    made_by = provenance("pytest", ["-m", "lab", str(Path(request.module.__file__).relative_to(REPO))])
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        if failed or request.session.testsfailed > failed_before:
            job.diagnostics()
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps({**made_by, "tests_failed": failed or request.session.testsfailed > failed_before,
                                       **figures}, indent=2))
        print(json.dumps(figures, indent=2))
        lab_cli("down", "--name", job.lab, check=False)


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
