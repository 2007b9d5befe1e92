"""Placed daemons as supervised subprocesses (the process backend).

Each daemon runs `python -m rlfleet.tools.cli daemon ROLE ...` in its own session
(so a kill of its process group takes its worker processes too), armed to get
SIGTERM when its parent dies (a clean drain even after a kill -9 of the agent or
of `rlfleet run`), with stdout and stderr appended to `<log dir>/<id>.log`. Its
CPU time, descendants included, is sampled for the end-of-run summary.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from rlfleet.common.control.placement import Placed
from rlfleet.common.procs import with_parent_death
from rlfleet.daemons.agent.backend import Observed
from rlfleet.daemons.agent.policy import exit_description

TREE_RESCAN_S = 10.0  # how often a daemon's descendants are looked up again (a scan of all of /proc)


def daemon_command(job: str, etcd: str, placed: Placed) -> list[str]:
    return [sys.executable, "-m", "rlfleet.tools.cli", "daemon", placed.role, "--job", job, "--etcd", etcd,
            "--id", placed.member_id, "--host", placed.host]


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and its live descendants (reward workers)."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # a descendant that just exited
                pass
        return total
    except psutil.Error:
        return 0.0


class TreeCpu:
    """`tree_cpu_s` for one daemon, sampled often: finding the descendants scans every
    process on the machine (psutil reads each /proc/<pid>/stat for its parent), so it
    is done every TREE_RESCAN_S, and at once after one of them ended; a sample in
    between reads only the known processes' own counters."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._procs: list[psutil.Process] = []
        self._scanned_at = -TREE_RESCAN_S

    def read(self) -> float:
        now = time.monotonic()
        if now - self._scanned_at >= TREE_RESCAN_S:
            self._scanned_at = now
            try:
                root = psutil.Process(self.pid)
                self._procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return 0.0
        total = 0.0
        for proc in self._procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # it ended: look the tree up again at the next sample
                self._scanned_at = -TREE_RESCAN_S
        return total


@dataclass
class _Child:
    log_path: Path
    proc: subprocess.Popen | None = None
    cpu_s_ended: float = 0.0    # CPU of its earlier (dead) processes, as last sampled
    cpu_s_current: float = 0.0  # CPU of the running process at the last sample
    cpu_meter: TreeCpu | None = None

    def sample_cpu(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.cpu_meter is None or self.cpu_meter.pid != self.proc.pid:
                self.cpu_meter = TreeCpu(self.proc.pid)
            self.cpu_s_current = max(self.cpu_s_current, self.cpu_meter.read())

    def ended(self) -> None:
        self.cpu_s_ended += self.cpu_s_current
        self.cpu_s_current = 0.0
        self.proc = None


class ProcessBackend:
    name = "process"

    def __init__(self, command: Callable[[Placed], list[str]], env: Callable[[Placed], dict[str, str]],
                 log_dir: Path) -> None:
        self.command, self.env, self.log_dir = command, env, log_dir
        self.children: dict[str, _Child] = {}

    # -- the backend interface ----------------------------------------------------
    def start(self, placed: Placed) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = self.children.setdefault(placed.member_id, _Child(self.log_dir / f"{placed.member_id}.log"))
        with open(child.log_path, "ab") as out:
            child.proc = subprocess.Popen(with_parent_death(self.command(placed), signal.SIGTERM),  # a clean drain
                                          stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                          env=self.env(placed), start_new_session=True)
        return f"pid {child.proc.pid}"

    def observe(self, placed: Placed) -> Observed:
        child = self.children.get(placed.member_id)
        if child is None or child.proc is None:
            return Observed(False)
        code = child.proc.poll()
        if code is None:
            return Observed(True)
        child.ended()
        return Observed(False, (exit_description(code),))

    def stop(self, placed: Placed) -> None:
        child = self.children.get(placed.member_id)
        if child is not None and child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)

    def existing(self, job_hosts: frozenset[str]) -> list[Placed]:
        return []  # its daemons die with it (with_parent_death): a new agent finds none

    def release(self, grace_s: float, note: Callable[[str], None]) -> str:
        self.stop_all(grace_s, note)  # they would get SIGTERM from the kernel anyway (with_parent_death)
        return "stopped its daemons"

    # -- what the supervisor reads -------------------------------------------------
    def pid(self, member_id: str) -> int | None:
        child = self.children.get(member_id)
        if child is None or child.proc is None or child.proc.poll() is not None:
            return None
        return child.proc.pid

    def log_path(self, member_id: str) -> Path:
        return self.log_dir / f"{member_id}.log"

    def log_tail(self, member_id: str, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path(member_id).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def sample_cpu(self) -> None:
        for child in self.children.values():
            child.sample_cpu()

    def cpu_s(self, member_id: str) -> float:
        child = self.children.get(member_id)
        return 0.0 if child is None else child.cpu_s_ended + child.cpu_s_current

    def stop_all(self, grace_s: float, note: Callable[[str], None]) -> None:
        """SIGTERM every running daemon, SIGKILL those still there after grace_s."""
        running = [(mid, c.proc) for mid, c in self.children.items() if c.proc is not None]
        for _, proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for mid, proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                note(f"{mid} ignored SIGTERM for {grace_s:.0f}s; killing it")
                proc.kill()
                proc.wait()
        self.sample_cpu()
        for _, child in self.children.items():
            if child.proc is not None:
                child.ended()
