"""Who a registration's process is, and whether it still runs — checked where it can be.

A member record carries its process's identity: the machine's boot id
(/proc/sys/kernel/random/boot_id, new at every boot, unique per machine), its pid
namespace (the inode of /proc/self/ns/pid) and the process's pid and start time
(clock ticks since boot, /proc/<pid>/stat field 22). In the same boot and pid
namespace these name one process for good, even after its pid is reused, so
`rlfleet status` and a daemon's successor can tell at once that a registration
belongs to a dead or stopped process instead of waiting for its lease to run out.
Elsewhere the lease is the only evidence: "remote". The namespace matters where
machines share a kernel: containers (the lab's hosts, pods) can show their host's
boot id, and a pid from one means nothing in another's process table.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
from dataclasses import dataclass
from typing import Any, Literal

State = Literal["running", "stopped", "zombie", "dead", "remote"]


@functools.cache
def boot_id() -> str:
    """This machine's current boot id; "" where the kernel does not say (then nothing is local)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def pid_namespace() -> int:
    """This process's pid namespace (an inode number); 0 where the kernel does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ticks) of a pid, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot; 0 if unknown."""
    stat = _stat(pid)
    return stat[1] if stat else 0


@dataclass(frozen=True)
class ProcessId:
    boot_id: str
    pid: int
    start: int  # clock ticks since boot; 0: unknown (then a live pid is taken at its word)
    pid_ns: int = 0  # 0: unknown (a record from before it was written): never local

    @classmethod
    def current(cls) -> ProcessId:
        return cls.local(os.getpid(), start_ticks(os.getpid()))

    @classmethod
    def local(cls, pid: int, start: int = 0) -> ProcessId:
        """A pid of this machine, as this process sees it (from a pid file, a child)."""
        return cls(boot_id(), pid, start, pid_namespace())

    @classmethod
    def of(cls, value: Any) -> ProcessId | None:
        """The identity a record carries (`boot_id`, `pid`, `pid_start`, `pid_ns`), None if it has none."""
        if not isinstance(value, dict):
            return None
        bid, pid, start, ns = value.get("boot_id"), value.get("pid"), value.get("pid_start", 0), value.get("pid_ns", 0)
        if (not isinstance(bid, str) or not bid or type(pid) is not int or pid <= 0 or type(start) is not int
                or type(ns) is not int):
            return None
        return cls(bid, pid, start, ns)

    def to_fields(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "pid": self.pid, "pid_start": self.start, "pid_ns": self.pid_ns}

    def state(self) -> State:
        """What this machine can say about the process ("remote": it runs, or ran, elsewhere)."""
        if not self.boot_id or self.boot_id != boot_id() or not self.pid_ns or self.pid_ns != pid_namespace():
            return "remote"
        stat = _stat(self.pid)
        if stat is None or (self.start and stat[1] != self.start):
            return "dead"  # gone, or the pid now names a younger process
        letter = stat[0]
        if letter in ("Z", "X", "x"):
            return "zombie" if letter == "Z" else "dead"
        if letter in ("T", "t"):
            return "stopped"  # SIGSTOP, or held by a debugger
        return "running"


def with_parent_death(argv: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """`argv` started so that it gets `sig` when the process that started it dies (even by
    kill -9): no etcd or daemon outlives `rlfleet run`, an agent or a test (Linux only).

    setpriv(1) sets PR_SET_PDEATHSIG and execs `argv` (same pid), rather than a preexec_fn:
    a preexec_fn makes Popen fork() and run Python's at-fork hooks in the child, where
    gRPC's (the etcd client's) restarts its poller on the epoll fd that Popen then closes,
    and the child aborts before exec (seen in CI: an etcd member "exited with -6")."""
    signame = signal.Signals(sig).name.removeprefix("SIG")
    return [shutil.which("setpriv") or "setpriv", "--pdeathsig", signame, "--", *argv]
