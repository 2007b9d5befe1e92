"""What the soak reads from the machine: the jobs' daemon processes and their usage.

The daemon processes of a job, found by its member records (``read_procs``); a process's
VmRSS, open fds and RSS with its children (``proc_usage``); whether a pid descends from
a run (``descends_from``: never kill another run's daemon); the trainer's last training
line, followed by offset (``MetricsReader``); the step lines for the drop-share windows
(``slim_step_lines``); a filesystem's use and the machine's available memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLE_S = 30.0              # the default sample interval (--sample-s)


@dataclass
class Proc:
    job: str
    label: str           # the member id, or "<first id>+<n>" for a process hosting several
    role: str
    pid: int
    members: list[str] = field(default_factory=list)


def read_procs(store: Any, job: str) -> list[Proc]:
    """The job's daemon processes that run here now, by their member records."""
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.members import members_from
    from rlfleet.common.procs import ProcessId
    keys = JobKeys(job)
    by_pid: dict[int, list[Any]] = {}
    for m in members_from(keys, store.get_prefix(keys.members_prefix)):
        if m.role == "agent" or m.pid <= 0:
            continue
        if ProcessId(m.boot_id, m.pid, m.pid_start, m.pid_ns).state() == "running":
            by_pid.setdefault(m.pid, []).append(m)
    out = []
    for pid, ms in by_pid.items():
        ids = sorted(m.id for m in ms)
        out.append(Proc(job, ids[0] if len(ids) == 1 else f"{ids[0]}+{len(ids) - 1}", ms[0].role, pid, ids))
    return sorted(out, key=lambda p: p.label)


def proc_usage(pid: int, tree: bool = True) -> dict[str, int | None] | None:
    """VmRSS (kB), open fds, and (``tree``) the RSS with its descendants (kB); None if it is gone."""
    import psutil
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with_children = (rss + sum(c.memory_info().rss // 1024 for c in psutil.Process(pid).children(recursive=True))
                         if tree else None)
    except (OSError, StopIteration, psutil.Error):
        return None
    return {"rss_kb": rss, "fds": fds, "tree_rss_kb": with_children}


def descends_from(pid: int, roots: set[int]) -> bool:
    """Whether ``pid`` is a descendant of one of ``roots`` (never kill another run's daemon)."""
    import psutil
    try:
        return any(p.pid in roots for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class MetricsReader:
    """metrics.jsonl followed by offset; only the last training line is kept (a 2-hour
    arithmetic run writes ~70k lines: the soak must not grow with them)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last = path, 0, None

    def poll(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.last
        end = chunk.rfind(b"\n")
        if end >= 0:
            self.offset += end + 1
            for raw in chunk[:end].splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and "loss" in line:
                    self.last = line
        return self.last


def slim_step_lines(path: Path) -> list[dict[str, Any]]:
    """The training lines with only what drops.windows reads."""
    keep = ("time", "dropped", "trained_groups", "staleness", "wait_s", "pending_groups")
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and "loss" in line:
                    out.append({k: line[k] for k in keep if k in line})
    except OSError:
        pass
    return out


def used_mib(folder: Path) -> float:
    st = os.statvfs(folder)
    return round((st.f_blocks - st.f_bfree) * st.f_frsize / 2**20, 1)


def mem_available_mib() -> float | None:
    """The machine's MemAvailable: memory a leak outside the sampled processes takes (shm, tmpfs, page cache)."""
    try:
        with open("/proc/meminfo") as f:
            return round(next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:")) / 1024, 1)
    except (OSError, StopIteration):
        return None
