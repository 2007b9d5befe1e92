"""The processes of a lab, as the machine sees them: nspawn, containers, their memory."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True for a running process; a zombie (dead, not yet reaped) counts as gone."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pids: list[int], deadline: float) -> list[int]:
    """Poll until every pid is gone or the deadline passes; returns those still alive."""
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def find_leader(netns_path: Path) -> int:
    """The container's PID 1 (systemd): the process in the host's network namespace whose pid in
    its own pid namespace is 1. (nspawn's process tree is an implementation detail; the
    namespace is what makes the host.) 0 while there is none yet."""
    try:
        want = f"net:[{os.stat(netns_path).st_ino}]"
    except OSError:
        return 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        nspid = _status(int(entry.name)).get("NSpid", "").split()
        if len(nspid) >= 2 and nspid[-1] == "1":
            try:
                if os.readlink(entry / "ns/net") == want and alive(int(entry.name)):
                    return int(entry.name)
            except OSError:
                continue
    return 0


def nspawn_pids_under(lab_dir: Path) -> list[int]:
    """Every systemd-nspawn whose directory is one of this lab's hosts (also after a crashed `up`
    that never wrote its state)."""
    needle = f"{lab_dir}/hosts/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"systemd-nspawn") and any(needle.encode() in a for a in argv):
            if alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def pid_namespace_members(leader: int) -> list[int]:
    try:
        ns = os.readlink(f"/proc/{leader}/ns/pid")
    except OSError:
        return []
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns/pid") == ns:
                    members.append(int(entry.name))
            except OSError:
                continue
    return members


def pss_kib(pids: list[int]) -> int:
    """Proportional set size of these processes together (shared pages split among sharers)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total


TERM, KILL = signal.SIGTERM, signal.SIGKILL
