"""One rlfleet job on a lab of systemd hosts, as the lab tests and the lab benchmarks
drive it: shell inside a host, etcd and Prometheus read from an observer host with the
job's credentials, the playbooks run from the controller, and the trainer's progress
(docs/operations/lab.md). Used by tests/deploy/ and tools/bench/node_add.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlfleet.common.control.keys import MEMBERS, JobKeys

T = TypeVar("T")
LAB_CMD = [sys.executable, "-m", "rlfleet.tools.lab"]
REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
JOB = "arith"  # examples/cluster-arithmetic.toml
ENV_FILE = f"/etc/rlfleet/jobs/{JOB}.env"
RLFLEET = "/opt/rlfleet/venv/bin/rlfleet"
RUN_DIR = f"/var/lib/rlfleet/{JOB}"


def wait_for(what: str, fn: Callable[[], T], timeout_s: float, every_s: float = 1.0) -> T:
    """Poll fn (once a second: each look is a process inside a host) until it returns
    something truthy; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 — keep polling through transient errors
            last_exc = exc
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}"
                         + (f" (last error {last_exc!r})" if last_exc else ""))


def with_job_env(command: str) -> str:
    return f"set -a; . {ENV_FILE}; set +a; {command}"


def recap(stdout: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP: {host: {ok, changed, failed, ...}}."""
    rows = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", stdout, re.M):
        rows[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return rows


def task_timing(stdout: str) -> list[list]:
    """The slowest tasks the task_timing callback (ansible/callback_plugins) listed after the
    recap: [[seconds, "role : task"], ...], slowest first; [] when it listed none."""
    return [[float(m.group(1)), m.group(2)] for m in re.finditer(r"^\s+([\d.]+) s  (.+)$", stdout.split(
        "TASK TIMING:", 1)[1], re.M)] if "TASK TIMING:" in stdout else []


def job_spec(tmp: Path, max_steps: int, extra: str = "") -> Path:
    """The cluster example with max_steps changed and `extra` appended (same file name:
    job.yml puts it next to the models)."""
    text = (REPO / "examples" / "cluster-arithmetic.toml").read_text()
    text, n = re.subn(r"(?m)^max_steps = \d+", f"max_steps = {max_steps}", text)
    assert n == 1
    path = tmp / str(max_steps) / "cluster-arithmetic.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + extra)
    return path


class LabJob:
    def __init__(self, lab: str, hosts: int, observer: str) -> None:
        self.lab, self.hosts, self.observer = lab, hosts, observer  # the observer is never faulted

    def host_sh(self, host: str, script: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """A shell script inside a lab host (nsenter: works whatever the network does)."""
        proc = subprocess.run([*LAB_CMD, "exec", "--name", self.lab, host, "--", "bash", "-c", script],
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{host}$ {script}\n-> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def rlfleet(self, args: str, check: bool = True, timeout: float = 120, host: str | None = None):
        """`rlfleet ARGS` on the observer (or `host`) with the job's credentials."""
        return self.host_sh(host or self.observer, with_job_env(f"{RLFLEET} {args}"), check=check, timeout=timeout)

    def etcd(self, prefix: str) -> dict[str, Any]:
        """{key: value} under the job's PREFIX (e.g. "members/")."""
        found = {}
        for line in self.rlfleet(f"keys {JobKeys(JOB).prefix}{prefix}").stdout.splitlines():
            key, _, value = line.partition("\t")
            found[key] = json.loads(value)
        return found

    def trainer(self) -> dict[str, Any]:
        members = [v for v in self.etcd(f"{MEMBERS}/trainer/").values() if v.get("version") is not None]
        return members[0] if members else {}

    def version(self) -> int:
        return int(self.trainer().get("version") or 0)

    def advances(self, by: int, timeout_s: float, what: str) -> int:
        start = self.version()
        return wait_for(f"training to advance {by} steps from {start} ({what})",
                        lambda: (v := self.version()) >= start + by and v, timeout_s)

    def playbook(self, name: str, *extra: str, inventories: tuple[str, ...] = (),
                 timeout: float = 1200) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        inv = [a for i in ("inventory.lab.ini", *inventories) for a in ("-i", str(ANSIBLE / i))]
        proc = subprocess.run([*LAB_CMD, "ansible", "--name", self.lab, "--", "ansible-playbook", *inv,
                               str(ANSIBLE / name), *extra],
                              capture_output=True, text=True, timeout=timeout, cwd=ANSIBLE,
                              env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
                                   "ANSIBLE_FORCE_COLOR": "0"})
        took = time.monotonic() - t0
        print(f"$ ansible-playbook {name} {' '.join(extra)} -> {proc.returncode} in {took:.0f} s\n"
              f"{proc.stdout[-6000:]}")
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
        return proc, took

    def unit(self, host: str, member: str) -> dict[str, str]:
        out = self.host_sh(host, "systemctl show -p MainPID,NRestarts,ActiveState,SubState "
                                 f"'rlfleet@{JOB}:{member}.service'").stdout
        return dict(line.split("=", 1) for line in out.split())

    def prom(self, query: str) -> float:
        """One number from Prometheus on the observer (0 when the query has no result)."""
        out = self.host_sh(self.observer, "curl -sfG http://127.0.0.1:9090/api/v1/query "
                                          f"--data-urlencode 'query={query}'").stdout
        result = json.loads(out)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def diagnostics(self) -> None:
        """What every host's units said: printed when a test failed, so a CI log explains it."""
        for i in range(1, self.hosts + 1):
            proc = self.host_sh(f"h{i}", "systemctl --no-pager list-units 'rlfleet*' 'prometheus*'; "
                                         "journalctl --no-pager -n 60 -u 'rlfleet*' -o cat | cut -c1-300",
                                check=False, timeout=60)
            print(f"===== h{i}\n{proc.stdout[-8000:]}{proc.stderr[-1000:]}")
